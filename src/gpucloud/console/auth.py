"""Sign-in with an API key, sign-out."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import RedirectResponse

from gpucloud.console.session import COOKIE_PATH, LOGIN_COOKIE, SESSION_COOKIE
from gpucloud.console.web import (
    BadCsrf,
    ConsoleRoute,
    Form,
    authenticate_key,
    back,
    get_form,
    keeper,
    page,
    set_session,
)
from gpucloud.core.errors import GpucloudError

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)


@router.get("/login")
def login_page(request: Request) -> Response:
    nonce = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(18)
    response = page(request, "login.html", None, csrf_login=keeper(request).token("login", nonce))
    response.set_cookie(LOGIN_COOKIE, nonce, max_age=3600, path=COOKIE_PATH, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


@router.post("/login")
async def login(request: Request,
                form: Annotated[dict[str, str], Depends(get_form)]) -> Response:
    sessions = keeper(request)
    if not sessions.check("login", request.cookies.get(LOGIN_COOKIE), form.get("csrf_token")):
        raise BadCsrf
    key = form.get("api_key", "").strip()
    try:
        await authenticate_key(request, key)
    except GpucloudError as error:
        nonce = request.cookies.get(LOGIN_COOKIE, "")
        return page(request, "login.html", None, status=401, error=error.message,
                    csrf_login=sessions.token("login", nonce))
    response = back("/console/pods")
    set_session(response, request, sessions.seal(key))
    response.delete_cookie(LOGIN_COOKIE, path=COOKIE_PATH)
    return response


@router.post("/logout")
def logout(_form: Form) -> Response:
    response: Response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH)
    return response
