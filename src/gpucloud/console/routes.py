"""The console's routes, for ``create_app`` to include: ``/console/…`` and its assets."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from gpucloud.console import auth, catalog, fleet, jobs, keys, pods
from gpucloud.console.web import HERE, ConsoleRoute

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)
for _module in (auth, pods, jobs, catalog, fleet, keys):
    router.include_router(_module.router)

#: Every asset is served from the package (no CDN).
static = StaticFiles(directory=HERE / "static")


@router.get("/")
def root() -> Response:
    return RedirectResponse("/console", status_code=307)


@router.get("/console")
def console_home() -> Response:
    return RedirectResponse("/console/pods", status_code=303)
