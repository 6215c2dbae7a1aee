"""The console's request plumbing: templates, the signed-in caller, forms, CSRF, errors.

Every console route uses ``ConsoleRoute``: a service error becomes an HTML page with the
API's status code (404 for another project's pod, 422 naming the field …), and a request
without a valid session is sent to the sign-in page."""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import Depends, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError

from gpucloud import __version__
from gpucloud.api import deps
from gpucloud.api.errors import status_of
from gpucloud.console.session import (
    COOKIE_PATH,
    SESSION_COOKIE,
    SESSION_SECONDS,
    Session,
    SessionKeeper,
    load_secret,
)
from gpucloud.core.errors import GpucloudError
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal

HERE = Path(__file__).parent
TEMPLATES = Jinja2Templates(directory=HERE / "templates")
MAX_FORM_BYTES = 64 * 1024
#: Only the server's own scripts and styles (the GPU grid's share is a style attribute),
#: no framing, forms only to the console.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'none'; "
                               "form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class LoginRequired(Exception):
    """No session, or one whose key no longer authenticates: go to the sign-in page."""


class BadCsrf(Exception):
    """A form without the session's CSRF token."""


@dataclass(frozen=True)
class Viewer:
    """The signed-in caller of a console page: the API's principal and the CSRF token."""

    principal: Principal
    csrf: str
    request: Request

    @property
    def ctx(self) -> ServiceContext:
        ctx: ServiceContext = self.request.app.state.ctx
        return ctx


def keeper(request: Request) -> SessionKeeper:
    """The app's session keeper (its secret is read or made on first use)."""
    state = request.app.state
    found: SessionKeeper | None = getattr(state, "console_sessions", None)
    if found is None:
        ctx: ServiceContext = state.ctx
        found = SessionKeeper(load_secret(ctx.settings.home))
        state.console_sessions = found
    return found


async def authenticate_key(request: Request, key: str) -> Principal:
    """A key, checked as a Bearer key of the API is (``api.deps.authenticate_key``: the
    same rate limits, cache and failure counting)."""
    return await deps.authenticate_key(request, request.app.state.ctx, key)


async def get_viewer(request: Request) -> Viewer:
    sessions = keeper(request)
    session: Session | None = sessions.open(request.cookies.get(SESSION_COOKIE))
    if session is None:
        raise LoginRequired
    try:
        principal = await authenticate_key(request, session.api_key)
    except GpucloudError:
        raise LoginRequired from None
    return Viewer(principal, sessions.token("csrf", session.session_id), request)


async def get_form(request: Request) -> dict[str, str]:
    """The url-encoded form of a POST (last value wins), checked against CSRF later."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise BadCsrf
    return dict(parse_qsl(body.decode(errors="replace"), keep_blank_values=True))


async def get_checked_form(request: Request,
                           form: Annotated[dict[str, str], Depends(get_form)]) -> dict[str, str]:
    """The form, once its ``csrf_token`` is the session's (else 403)."""
    session = keeper(request).open(request.cookies.get(SESSION_COOKIE))
    if session is None:
        raise LoginRequired
    if not keeper(request).check("csrf", session.session_id, form.get("csrf_token")):
        raise BadCsrf
    return form


CurrentViewer = Annotated[Viewer, Depends(get_viewer)]
Form = Annotated[dict[str, str], Depends(get_checked_form)]


def page(request: Request, name: str, viewer: Viewer | None, status: int = 200,
         **context: Any) -> HTMLResponse:
    base = {"viewer": viewer, "principal": viewer.principal if viewer else None,
            "csrf": viewer.csrf if viewer else "", "version": __version__,
            "path": request.url.path}
    return TEMPLATES.TemplateResponse(request, name, {**base, **context}, status_code=status,
                                      headers=SECURITY_HEADERS)


def back(url: str) -> RedirectResponse:
    """POST-redirect-GET."""
    return RedirectResponse(url, status_code=303)


def set_session(response: Response, request: Request, value: str) -> None:
    response.set_cookie(SESSION_COOKIE, value, max_age=SESSION_SECONDS, path=COOKIE_PATH,
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")


def validation_message(error: ValidationError) -> tuple[str, str]:
    """The first problem of a request body: the field's dotted name and what is wrong."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "body"
    return field, str(first["msg"])


async def _error_page(request: Request, status: int, title: str, detail: str) -> Response:
    viewer = None
    try:
        viewer = await get_viewer(request)
    except LoginRequired:
        viewer = None
    return page(request, "error.html", viewer, status=status, title=title, detail=detail)


class ConsoleRoute(APIRoute):
    """Service errors as HTML pages; no session: a redirect to the sign-in page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except LoginRequired:
                return RedirectResponse("/console/login", status_code=303)
            except BadCsrf:
                return await _error_page(request, 403, "Forbidden",
                                         "The form's CSRF token is missing or invalid; "
                                         "reload the page and try again.")
            except ValidationError as error:
                field, message = validation_message(error)
                return await _error_page(request, 422, "Invalid input", f"{field}: {message}")
            except GpucloudError as error:
                title = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", type(error).__name__)
                return await _error_page(request, status_of(error), title.capitalize(),
                                         error.message)

        return handle


def iso(value: datetime | None) -> str:
    """A time as UTC ISO 8601 (``<time datetime>``; the browser shows it in its zone)."""
    if value is None:
        return ""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


TEMPLATES.env.filters["iso"] = iso
