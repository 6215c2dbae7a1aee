"""API keys (create, shown once; revoke) and SSH keys (add, remove) of the project."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gpucloud.console.web import ConsoleRoute, CurrentViewer, Form, Viewer, back, page
from gpucloud.core.access import SshKeyAddRequest
from gpucloud.core.errors import InvalidInput
from gpucloud.services import projects, ssh_keys

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)


def _keys_page(request: Request, viewer: Viewer, new_key: str | None = None) -> Response:
    ctx, caller = viewer.ctx, viewer.principal
    return page(request, "keys.html", viewer, api_keys=projects.list_keys(ctx, caller),
                ssh_keys=ssh_keys.list_keys(ctx, caller), new_key=new_key)


@router.get("/keys")
def keys_page(request: Request, viewer: CurrentViewer) -> Response:
    return _keys_page(request, viewer)


@router.post("/keys/api")
def api_key_create(request: Request, viewer: CurrentViewer, form: Form) -> Response:
    name = form.get("name", "").strip()
    if not name:
        raise InvalidInput("name", "a key needs a name")
    created = projects.create_key(viewer.ctx, viewer.principal, name)
    # Rendered, not redirected: the key is shown this once and never stored for display.
    return _keys_page(request, viewer, new_key=created.key)


@router.post("/keys/api/{ref}/revoke")
def api_key_revoke(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    projects.revoke_key(viewer.ctx, viewer.principal, ref)
    return back("/console/keys")


@router.post("/keys/ssh")
def ssh_key_add(viewer: CurrentViewer, form: Form) -> Response:
    request = SshKeyAddRequest(public_key=form.get("public_key", "").strip(),
                               name=form.get("name", "").strip() or None)
    ssh_keys.add_key(viewer.ctx, viewer.principal, request)
    return back("/console/keys")


@router.post("/keys/ssh/{ref}/remove")
def ssh_key_remove(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    ssh_keys.remove_key(viewer.ctx, viewer.principal, ref)
    return back("/console/keys")
