"""The web console through the ASGI app (fast): sign-in, the session cookie, CSRF on every
form, another project's pods as 404 pages, admin-only node actions, the GPU grid."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.console.session import LOGIN_COOKIE, SESSION_COOKIE
from tests.conftest import ADMIN_KEY
from tests.integration.conftest import agent_headers

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


class ConsoleUser:
    """One browser: its own cookies, sent explicitly (the TestClient's jar is shared)."""

    def __init__(self, client: TestClient, key: str) -> None:
        self.client = client
        self.cookies: dict[str, str] = {}
        self.csrf = ""
        self.login(key)

    def _cookie_header(self) -> dict[str, str]:
        return {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}

    def _remember(self, response: Any) -> None:
        for name in (SESSION_COOKIE, LOGIN_COOKIE):
            if name in response.cookies:
                self.cookies[name] = response.cookies[name]
        self.client.cookies.clear()

    def get(self, path: str) -> Any:
        response = self.client.get(path, headers=self._cookie_header(), follow_redirects=False)
        self._remember(response)
        found = CSRF.search(response.text)
        if found and response.status_code == 200:
            self.csrf = found.group(1)
        return response

    def post(self, path: str, data: dict[str, str], csrf: str | None = None) -> Any:
        body = {"csrf_token": self.csrf if csrf is None else csrf, **data}
        response = self.client.post(path, data=body, headers=self._cookie_header(),
                                    follow_redirects=False)
        self._remember(response)
        return response

    def login(self, key: str) -> Any:
        self.get("/console/login")
        response = self.post("/console/login", {"api_key": key})
        if response.status_code == 303:
            self.get("/console/pods")  # the session's CSRF token
        return response


@pytest.fixture
def team(api: TestClient) -> Callable[[str], str]:
    def make(name: str) -> str:
        response = api.post("/v1/projects", json={"name": name})
        assert response.status_code == 201, response.text
        key: str = response.json()["key"]["key"]
        return key

    return make


@pytest.fixture
def anonymous(app_client: TestClient) -> TestClient:
    app_client.headers.pop("Authorization", None)
    return app_client


def test_root_redirects_and_pages_need_a_session(anonymous: TestClient) -> None:
    assert anonymous.get("/", follow_redirects=False).headers["location"] == "/console"
    response = anonymous.get("/console/pods", follow_redirects=False)
    assert (response.status_code, response.headers["location"]) == (303, "/console/login")
    assert "/console" not in str(anonymous.get("/openapi.json").json()["paths"])


def test_sign_in_sets_a_strict_httponly_cookie_without_the_key(anonymous: TestClient) -> None:
    user = ConsoleUser(anonymous, "gpc_wrong-key-0123456789")
    assert SESSION_COOKIE not in user.cookies
    anonymous.get("/console/login")
    page = anonymous.get("/console/login")
    token = CSRF.search(page.text)
    assert token
    response = anonymous.post("/console/login", data={"csrf_token": token.group(1),
                                                      "api_key": ADMIN_KEY},
                              headers={"Cookie": f"{LOGIN_COOKIE}="
                                                 f"{page.cookies[LOGIN_COOKIE]}"},
                              follow_redirects=False)
    assert response.status_code == 303
    header = response.headers["set-cookie"].lower()
    assert "httponly" in header and "samesite=strict" in header and "path=/console" in header
    assert ADMIN_KEY.lower() not in header


def test_wrong_key_and_missing_login_csrf_are_refused(anonymous: TestClient) -> None:
    user = ConsoleUser(anonymous, "gpc_wrong-key-0123456789")
    response = user.post("/console/login", {"api_key": ADMIN_KEY}, csrf="")
    assert response.status_code == 403
    user.get("/console/login")
    wrong = user.post("/console/login", {"api_key": "gpc_not-a-key-0123456789"})
    assert wrong.status_code == 401 and "invalid or revoked" in wrong.text


def test_forms_need_the_sessions_csrf_token(anonymous: TestClient, api: TestClient,
                                            team: Callable[[str], str]) -> None:
    user = ConsoleUser(anonymous, team("alpha"))
    other = ConsoleUser(anonymous, team("beta"))
    pod = {"name": "p1", "image": "busybox", "command": "sleep 60"}
    for token in ("", "0" * 64, other.csrf):
        refused = user.post("/console/pods", pod, csrf=token)
        assert refused.status_code == 403 and "CSRF" in refused.text
    assert "p1" not in user.get("/console/pods").text
    created = user.post("/console/pods", pod)
    assert created.status_code == 303
    page = user.get(created.headers["location"])
    assert page.status_code == 200 and "Pod p1" in page.text
    assert user.post("/console/logout", {}, csrf="").status_code == 403


def test_another_projects_pod_is_a_404_page(anonymous: TestClient,
                                            team: Callable[[str], str]) -> None:
    owner = ConsoleUser(anonymous, team("alpha"))
    stranger = ConsoleUser(anonymous, team("beta"))
    created = owner.post("/console/pods", {"name": "secret", "image": "busybox"})
    pod_url = created.headers["location"]
    for path in (pod_url, pod_url + "/stream"):
        response = stranger.get(path)
        assert response.status_code == 404 and "not found" in response.text
        assert "text/html" in response.headers["content-type"]
    assert stranger.post(pod_url + "/stop", {}).status_code == 404
    assert stranger.post(pod_url + "/delete", {}).status_code == 404
    assert "secret" not in stranger.get("/console/pods").text
    assert owner.get(pod_url).status_code == 200


def test_bad_input_names_the_field(anonymous: TestClient) -> None:
    user = ConsoleUser(anonymous, ADMIN_KEY)
    response = user.post("/console/pods", {"name": "Not A Name", "image": "busybox"})
    assert response.status_code == 422 and "name" in response.text
    response = user.post("/console/pods", {"name": "no-image"})
    assert response.status_code == 422 and "image" in response.text


def test_tampered_or_revoked_sessions_sign_out(anonymous: TestClient, api: TestClient,
                                               team: Callable[[str], str]) -> None:
    user = ConsoleUser(anonymous, team("alpha"))
    assert user.get("/console/pods").status_code == 200
    sealed = user.cookies[SESSION_COOKIE]
    user.cookies[SESSION_COOKIE] = sealed[:-6] + ("A" if sealed[-6] != "A" else "B") + sealed[-5:]
    assert user.get("/console/pods").status_code == 303
    user.cookies[SESSION_COOKIE] = sealed
    revoked = user.post("/console/keys/api/default/revoke", {})
    assert revoked.status_code == 303
    assert user.get("/console/pods").headers["location"] == "/console/login"


def test_logout_clears_the_session(anonymous: TestClient) -> None:
    user = ConsoleUser(anonymous, ADMIN_KEY)
    response = user.post("/console/logout", {})
    assert response.status_code == 303
    assert 'gpucloud_session=""' in response.headers["set-cookie"]


def test_node_actions_are_for_admins_and_the_grid_shows_allocations(
    anonymous: TestClient, team: Callable[[str], str],
    register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
) -> None:
    register_node("gpu-1")
    user = ConsoleUser(anonymous, team("alpha"))
    user.post("/console/pods", {"name": "two", "image": "busybox", "gpus": "2"})
    user.post("/console/pods", {"name": "half", "image": "busybox", "gpus": "0.5"})
    schedule()
    page = user.get("/console/nodes").text.split('class="gpu-grid"')[1]
    assert page.count('class="gpu whole"') == 2 and page.count('class="gpu free"') == 5
    assert "shared 50% (half 0.5)" in page
    assert "/cordon" not in page
    assert user.post("/console/nodes/gpu-1/cordon", {}).status_code == 403
    form = user.get("/console/pods").text
    assert '<option value="5">5</option>' in form and '<option value="6">' not in form
    admin = ConsoleUser(anonymous, ADMIN_KEY)
    assert admin.post("/console/nodes/gpu-1/cordon", {}).status_code == 303
    assert "data-cordoned" in admin.get("/console/nodes").text
    assert admin.post("/console/nodes/gpu-1/cordon", {}, csrf="x").status_code == 403


def test_every_page_renders(anonymous: TestClient) -> None:
    admin = ConsoleUser(anonymous, ADMIN_KEY)
    for path in ("/console/pods", "/console/jobs", "/console/nodes", "/console/usage",
                 "/console/keys", "/console/static/console.css", "/console/static/console.js"):
        assert admin.get(path).status_code == 200, path
    assert "default-src 'self'" in admin.get("/console/pods").headers["content-security-policy"]
    created = admin.post("/console/keys/api", {"name": "ci"})
    assert created.status_code == 200 and re.search(r'id="new-key">gpc_', created.text)


def test_a_job_page_lists_members_by_rank_and_the_gang_state(
    anonymous: TestClient, api: TestClient, register_node: Callable[..., dict[str, Any]],
) -> None:
    register_node("n1")
    register_node("n2")
    job = api.post("/v1/jobs", json={"name": "train", "image": "busybox", "nodes": 2,
                                     "gpus_per_node": 8})
    assert job.status_code == 201, job.text
    admin = ConsoleUser(anonymous, ADMIN_KEY)
    assert "train" in admin.get("/console/jobs").text
    page = admin.get(f"/console/jobs/{job.json()['id']}").text
    ranks = re.findall(r'<tr><td class="num">(\d)</td><td><a href="/console/pods/[^"]+">'
                       r'(train-\d)</a>', page)
    assert ranks == [("0", "train-0"), ("1", "train-1")]
    assert 'id="gang-state"' in page and "2 nodes × 8 GPUs" in page


def _console_job(user: ConsoleUser, csrf: str | None = None, **fields: str) -> Any:
    return user.post("/console/jobs", {"nodes": "1", "gpus_per_node": "0", **fields}, csrf)


def test_a_job_is_created_from_a_template_then_stopped_and_deleted(
    anonymous: TestClient, api: TestClient, team: Callable[[str], str],
    register_node: Callable[..., dict[str, Any]],
) -> None:
    register_node("n1")
    register_node("n2")
    key = team("alpha")
    owner, stranger = ConsoleUser(anonymous, key), ConsoleUser(anonymous, team("beta"))
    made = owner.post("/console/templates", {"name": "trainer", "image": "busybox",
                                             "command": "sleep 60", "gpus": "1"})
    assert made.status_code == 303
    form = owner.get("/console/jobs").text
    assert '<option value="trainer">' in form and '<option value="8">8</option>' in form
    created = _console_job(owner, name="train", template="trainer", nodes="2",
                           gpus_per_node="8")
    assert created.status_code == 303, created.text
    job_url = created.headers["location"]
    job = api.get("/v1/jobs/train", headers={"Authorization": f"Bearer {key}"}).json()
    assert job_url == f"/console/jobs/{job['id']}"
    assert (job["image"], job["command"], job["nodes"], job["gpus_per_node"]) == \
        ("busybox", ["sleep", "60"], 2, 8)
    page = owner.get(job_url).text
    assert "2 nodes × 8 GPUs" in page and f"{job_url}/stop" in page
    assert stranger.get(job_url).status_code == 404
    for action in ("/stop", "/delete"):
        assert stranger.post(job_url + action, {}).status_code == 404
        assert owner.post(job_url + action, {}, csrf="").status_code == 403
    assert ">train<" not in stranger.get("/console/jobs").text
    assert owner.post(job_url + "/stop", {}).status_code == 303
    assert owner.post(job_url + "/delete", {}).headers["location"] == "/console/jobs"
    assert owner.get(job_url).status_code == 404
    assert 'href="/console/jobs/' not in owner.get("/console/jobs").text


def test_the_job_form_names_the_bad_field_and_writes_nothing(
    anonymous: TestClient, team: Callable[[str], str],
) -> None:
    user = ConsoleUser(anonymous, team("alpha"))
    for fields, field in (({"name": "j", "image": "busybox", "nodes": "0"}, "nodes"),
                          ({"name": "j"}, "image"),
                          ({"name": "j", "template": "nope"}, "template"),
                          ({"name": "Bad Name", "image": "busybox"}, "name"),
                          ({"name": "j", "image": "busybox", "gpus_per_node": "x"},
                           "gpus_per_node")):
        response = _console_job(user, **fields)
        assert response.status_code == 422 and f"{field}: " in response.text, fields
    refused = _console_job(user, name="j", image="busybox", csrf="")
    assert refused.status_code == 403
    assert 'href="/console/jobs/' not in user.get("/console/jobs").text


def test_templates_are_created_offered_and_deleted(
    anonymous: TestClient, team: Callable[[str], str],
) -> None:
    owner, stranger = ConsoleUser(anonymous, team("alpha")), ConsoleUser(anonymous, team("beta"))
    template = {"name": "nb", "image": "jupyter/base", "command": "start.sh", "gpus": "0.5",
                "ports": "8888/http"}
    assert owner.post("/console/templates", template, csrf="").status_code == 403
    assert owner.post("/console/templates", template).status_code == 303
    listed = owner.get("/console/templates").text
    assert 'data-template="nb"' in listed and "8888/http" in listed and "0.5" in listed
    assert '<option value="nb">nb — jupyter/base</option>' in owner.get("/console/pods").text
    assert 'data-template="nb"' not in stranger.get("/console/templates").text
    for fields, field in (({**template}, "name"),  # taken
                          ({**template, "name": "x", "gpus": "-1"}, "gpus"),
                          ({**template, "name": "x", "image": ""}, "image"),
                          ({**template, "name": "x", "ports": "http"}, "ports")):
        response = owner.post("/console/templates", fields)
        assert response.status_code == 422 and f"{field}: " in response.text, fields
    assert 'data-template="x"' not in owner.get("/console/templates").text
    assert stranger.post("/console/templates/nb/delete", {}).status_code == 404
    assert owner.post("/console/templates/nb/delete", {}, csrf="").status_code == 403
    assert owner.post("/console/templates/nb/delete", {}).status_code == 303
    assert 'data-template="nb"' not in owner.get("/console/templates").text


def test_the_pods_rows_refresh_and_the_pod_shows_when_it_started(
    anonymous: TestClient, api: TestClient, team: Callable[[str], str],
    register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
) -> None:
    reg = register_node("gpu-1")
    owner, stranger = ConsoleUser(anonymous, team("alpha")), ConsoleUser(anonymous, team("beta"))
    pod_url = owner.post("/console/pods", {"name": "web", "image": "busybox",
                                           "gpus": "1"}).headers["location"]
    assert 'data-refresh="/console/pods/_rows"' in owner.get("/console/pods").text
    rows = owner.get("/console/pods/_rows").text
    assert 'data-pod="web"' in rows and "phase-pending" in rows and "<html" not in rows
    assert '<dt>Started</dt><dd id="started">—</dd>' in owner.get(pod_url).text
    schedule()
    running = api.post(f"/v1/agent/pods/{pod_url.rsplit('/', 1)[1]}/status",
                       headers=agent_headers(reg),
                       json={"fencing_token": reg["fencing_token"], "phase": "Running"})
    assert running.status_code == 200, running.text
    rows = owner.get("/console/pods/_rows").text
    assert "phase-running" in rows and "gpu-1" in rows
    assert re.search(r'<dt>Started</dt><dd id="started"><time datetime="\d{4}-[^"]+Z">',
                     owner.get(pod_url).text)
    assert 'data-pod="web"' not in stranger.get("/console/pods/_rows").text
    anonymous.cookies.clear()
    assert anonymous.get("/console/pods/_rows", follow_redirects=False).status_code == 303


def test_a_restarting_pod_can_still_be_stopped(
    anonymous: TestClient, api: TestClient, team: Callable[[str], str],
    register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
) -> None:
    """While its agent stops it for a restart, the pod page offers Stop (not Start), and
    Stop turns the restart into a stop."""
    reg = register_node("gpu-1")
    key = team("alpha")
    owner = ConsoleUser(anonymous, key)
    pod_url = owner.post("/console/pods", {"name": "web", "image": "busybox"}).headers["location"]
    pod_id = pod_url.rsplit("/", 1)[1]
    schedule()
    running = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                       json={"fencing_token": reg["fencing_token"], "phase": "Running"})
    assert running.status_code == 200, running.text
    restart = api.post(f"/runpod/v1/pods/{pod_id}/restart",
                       headers={"Authorization": f"Bearer {key}"})
    assert restart.status_code == 200, restart.text
    page = owner.get(pod_url).text
    assert f'action="{pod_url}/stop"' in page and f'action="{pod_url}/start"' not in page
    assert owner.post(pod_url + "/stop", {}).status_code == 303
    pod = api.get(f"/v1/pods/{pod_id}", headers={"Authorization": f"Bearer {key}"}).json()
    assert pod["desired_state"] == "stopped"
