"""The FastAPI application: migrations and admin bootstrap at start, controllers in the
background, the routers, and the error mapping."""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI

from gpucloud import __version__
from gpucloud.access import gateway
from gpucloud.access.proxy import ProxyMiddleware
from gpucloud.api import errors, lease_capacity, openapi, usage_admission
from gpucloud.api import metrics as metrics_routes
from gpucloud.api.agent_fast import AgentFastPath
from gpucloud.api.limits import BodyLimitMiddleware
from gpucloud.api.routers import access as access_routes
from gpucloud.api.routers import agent, jobs, nodes, pods, policy, projects
from gpucloud.api.routers import billing as billing_routes
from gpucloud.api.routers import checkpoints as checkpoint_routes
from gpucloud.api.routers import endpoints as endpoint_routes
from gpucloud.api.routers import registry_auths as registry_auth_routes
from gpucloud.api.routers import ssh_keys as ssh_key_routes
from gpucloud.api.routers import templates as template_routes
from gpucloud.api.routers import volumes as volume_routes
from gpucloud.compat.runpod import graphql as runpod_graphql
from gpucloud.compat.runpod import rest_v1 as runpod_rest_v1
from gpucloud.compat.runpod import rest_v2 as runpod_rest_v2
from gpucloud.compat.runpod import serverless as runpod_serverless
from gpucloud.console import routes as console_routes
from gpucloud.controllers.loops import ControllerRunner
from gpucloud.core import redact
from gpucloud.core.clock import Clock
from gpucloud.core.settings import Settings
from gpucloud.db.clock import DatabaseClock, server_clock
from gpucloud.db.migrate import upgrade
from gpucloud.db.session import Database
from gpucloud.services import priorities
from gpucloud.services.context import ServiceContext, TtlCache
from gpucloud.services.notify import NotifyBridge
from gpucloud.services.projects import bootstrap_admin

log = logging.getLogger(__name__)
GIL_SWITCH_SECONDS = 0.001


def prepare(settings: Settings, clock: Clock | None = None) -> tuple[ServiceContext, str | None]:
    """Open the database, migrate it, create the admin project; returns a new admin key
    when one was just written to ``admin.key`` (to print once). Without ``clock`` the
    service clock is the database's on PostgreSQL (db/clock.py: read here, before anything
    is written; the lifespan keeps it read), the system's on SQLite."""
    settings.home.mkdir(parents=True, exist_ok=True)
    db = Database(settings.database_url)
    upgrade(db.engine)
    ctx = ServiceContext(db=db, clock=clock or server_clock(db), settings=settings,
                         cache=TtlCache(settings.auth_cache_ttl_seconds))
    priorities.ensure_defaults(ctx)
    return ctx, bootstrap_admin(ctx)


def create_app(settings: Settings | None = None, clock: Clock | None = None,
               run_controllers: bool = True) -> FastAPI:
    """The server app. Tests pass a manual clock and drive the controllers themselves;
    ``settings.controllers`` False (``gpucloud server --no-controllers``) never runs them."""
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx, new_key = prepare(settings, clock)
        if new_key:
            print(f"gpucloud: admin API key (shown once): {new_key}", flush=True)
            print(f"gpucloud: also saved to {settings.home / 'admin.key'}", flush=True)
        app.state.ctx = ctx
        database_clock = ctx.clock if clock is None and isinstance(
            ctx.clock, DatabaseClock) else None
        if database_clock:
            database_clock.start()  # read again every 10 s
        ssh_gateway = await gateway.start_for_app(ctx, app.state)
        # Start-up objects (routes, schemas, the ORM) live as long as the process: keep
        # them out of the collector's full passes, which otherwise stall requests.
        gc.freeze()
        # Requests hop between the event loop and worker threads, each hop waiting for the
        # GIL; a shorter switch interval keeps a busy thread (a scheduling pass) from
        # holding every request up to 5 ms per hop.
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        anyio.to_thread.current_default_thread_limiter().total_tokens = (
            settings.request_threads)
        bridge = (NotifyBridge(settings.database_url, ctx.cache)
                  if settings.notify and not ctx.db.is_sqlite else None)
        if bridge:
            bridge.start()  # wake-ups and cache clears across replicas (a hint)
        runner = ControllerRunner(ctx) if run_controllers and settings.controllers else None
        app.state.controllers = runner
        if runner:
            runner.start()
        try:
            yield
        finally:
            if runner:
                runner.stop()
            if bridge:
                bridge.stop()
            await gateway.stop(ssh_gateway)
            if database_clock:
                database_clock.stop()
            usage_admission.close(app)  # its niced ingest worker, if one started
            lease_capacity.close(ctx.db)  # the lease renewals' own pool
            ctx.db.dispose()

    # Request lines (uvicorn's access log, httpx's) may hold the proxy's ?gpucloud_token=.
    redact.install("uvicorn.access", "uvicorn.error", "asyncssh", "httpx", "httpcore", "httpx2",
                   "httpcore2")
    app = FastAPI(title="gpucloud", version=__version__, lifespan=lifespan)
    errors.install(app)
    openapi.install(app)
    # Innermost: the agent's renewals and long polls without the framework's request
    # cycle (api/agent_fast.py); the middlewares below still see them.
    app.add_middleware(AgentFastPath)
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(metrics_routes.MetricsMiddleware)
    # API calls make usage ingest yield (api/usage_admission.py).
    app.add_middleware(usage_admission.ApiActivityMiddleware)
    # Requests for pods' HTTP ports (by Host or /proxy/…) never reach the routers, nor
    # the body limit (added last, so outermost).
    app.add_middleware(ProxyMiddleware)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    for module in (projects, nodes, agent, pods, jobs, policy, volume_routes, ssh_key_routes,
                   access_routes, template_routes, registry_auth_routes, checkpoint_routes):
        app.include_router(module.router)
    app.include_router(checkpoint_routes.agent_router)
    app.include_router(billing_routes.router)
    app.include_router(metrics_routes.router)
    app.include_router(runpod_graphql.router)  # RunPod's POST /graphql (docs/runpod.md)
    app.include_router(runpod_rest_v2.router)  # RunPod's REST under /runpod/v2, /runpod/v1
    app.include_router(runpod_rest_v1.router)
    app.include_router(endpoint_routes.router)
    app.include_router(runpod_serverless.router)  # RunPod's serverless /v2 (docs/serverless.md)
    # The web console (docs/console.md) and `/` → `/console`; not in the OpenAPI schema.
    app.include_router(console_routes.router)
    app.mount("/console/static", console_routes.static, name="console-static")
    return app
