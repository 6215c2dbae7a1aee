"""The gpucloud SDK: one method per API call, typed with the wire models of core.models.

Errors come back as the matching class of the exception tree (``NotFound``, ``Conflict``,
…) carrying the server's one-line ``detail``; a server that cannot be reached raises
``ApiError`` with status 0.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from gpucloud.core.access import PodAccessOut, SshKeyOut, VolumeCreateRequest, VolumeOut
from gpucloud.core.errors import (
    Conflict,
    Forbidden,
    GpucloudError,
    InvalidInput,
    NotFound,
    StaleFencingToken,
    Unauthorized,
)
from gpucloud.core.jobs import (
    AgentPodReadyRequest,
    JobCreateRequest,
    JobEventOut,
    JobLogsOut,
    JobOut,
    JobWhyOut,
)
from gpucloud.core.models import (
    AgentLogChunkRequest,
    AgentPodStatusRequest,
    AssignmentsOut,
    JoinTokenOut,
    KeyCreatedOut,
    KeyOut,
    LeaseResponse,
    NodeOut,
    NodeRegisterRequest,
    NodeRegisterResponse,
    PodCreateRequest,
    PodEventOut,
    PodLogsOut,
    PodOut,
    PodWhyOut,
    ProjectCreatedOut,
    ProjectOut,
)
from gpucloud.core.policy import (
    PriorityClassCreateRequest,
    PriorityClassOut,
    QuotaOut,
    QuotaSetRequest,
)
from gpucloud.core.spec import (
    RegistryAuthAddRequest,
    RegistryAuthOut,
    TemplateCreateRequest,
    TemplateOut,
)

T = TypeVar("T")


class ApiError(GpucloudError):
    """An API error with no more specific class, or no answer at all (status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
        detail = str(body.get("detail") or response.reason_phrase)
        field = body.get("field")
    except ValueError:
        detail, field = response.text.strip() or response.reason_phrase, None
    code = response.status_code
    if code == 422:
        error = InvalidInput(field or "request", detail)
        error.message = detail
        raise error
    if code == 409 and "fencing token" in detail:
        raise StaleFencingToken(detail)
    kinds: dict[int, type[GpucloudError]] = {
        401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
    }
    if code in kinds:
        raise kinds[code](detail)
    raise ApiError(code, f"server answered {code}: {detail}")


class _Base:
    def __init__(self, url: str, token: str | None, transport: httpx.BaseTransport | None = None,
                 timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._transport = transport
        self._http = httpx.Client(base_url=self.url, headers=headers, transport=transport,
                                  timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, json: Any = None,
              params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        try:
            response = self._http.request(
                method, path, json=json, params=params,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as error:
            raise ApiError(0, f"cannot reach the gpucloud server at {self.url}: {error}") from None
        _raise_for(response)
        return response.json() if response.content else None

    def _typed(self, kind: type[T], method: str, path: str, **kwargs: Any) -> T:
        return TypeAdapter(kind).validate_python(self._call(method, path, **kwargs))


def _body(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_unset=True)


class GpucloudClient(_Base):
    """A user's client, authenticated with an API key."""

    def health(self) -> dict[str, str]:
        return self._typed(dict[str, str], "GET", "/healthz")

    # projects and keys
    def create_project(self, name: str) -> ProjectCreatedOut:
        return self._typed(ProjectCreatedOut, "POST", "/v1/projects", json={"name": name})

    def list_projects(self) -> list[ProjectOut]:
        return self._typed(list[ProjectOut], "GET", "/v1/projects")

    def create_key(self, name: str) -> KeyCreatedOut:
        return self._typed(KeyCreatedOut, "POST", "/v1/keys", json={"name": name})

    def list_keys(self) -> list[KeyOut]:
        return self._typed(list[KeyOut], "GET", "/v1/keys")

    def revoke_key(self, ref: str) -> KeyOut:
        return self._typed(KeyOut, "POST", f"/v1/keys/{ref}/revoke")

    # nodes
    def create_join_token(self) -> JoinTokenOut:
        return self._typed(JoinTokenOut, "POST", "/v1/nodes/join-tokens")

    def list_nodes(self) -> list[NodeOut]:
        return self._typed(list[NodeOut], "GET", "/v1/nodes")

    def get_node(self, ref: str) -> NodeOut:
        return self._typed(NodeOut, "GET", f"/v1/nodes/{ref}")

    def cordon(self, ref: str, cordoned: bool = True) -> NodeOut:
        action = "cordon" if cordoned else "uncordon"
        return self._typed(NodeOut, "POST", f"/v1/nodes/{ref}/{action}")

    # pods
    def create_pod(self, request: PodCreateRequest | dict[str, Any]) -> PodOut:
        body = _body(request) if isinstance(request, BaseModel) else request
        return self._typed(PodOut, "POST", "/v1/pods", json=body)

    def list_pods(self, phase: str | None = None) -> list[PodOut]:
        params = {"phase": phase} if phase else None
        return self._typed(list[PodOut], "GET", "/v1/pods", params=params)

    def get_pod(self, ref: str) -> PodOut:
        return self._typed(PodOut, "GET", f"/v1/pods/{ref}")

    def pod_events(self, ref: str) -> list[PodEventOut]:
        return self._typed(list[PodEventOut], "GET", f"/v1/pods/{ref}/events")

    def pod_why(self, ref: str) -> PodWhyOut:
        return self._typed(PodWhyOut, "GET", f"/v1/pods/{ref}/why")

    def pod_logs(self, ref: str, offset: int = 0, tail: int | None = None,
                 attempt: int | None = None) -> PodLogsOut:
        params: dict[str, Any] = {"offset": offset}
        if tail is not None:
            params["tail"] = tail
        if attempt is not None:
            params["attempt"] = attempt
        return self._typed(PodLogsOut, "GET", f"/v1/pods/{ref}/logs", params=params)

    def stop_pod(self, ref: str, grace: float | None = None) -> PodOut:
        params = {"grace": grace} if grace is not None else None
        return self._typed(PodOut, "POST", f"/v1/pods/{ref}/stop", params=params)

    def start_pod(self, ref: str, gpus: float | None = None, migrate: bool = False) -> PodOut:
        """``gpus``: start it with this many GPUs from now on (0: for data access).
        ``migrate``: on any node with room, its volume disk copied there first."""
        params: dict[str, Any] = {"gpus": gpus} if gpus is not None else {}
        if migrate:
            params["migrate"] = "true"
        return self._typed(PodOut, "POST", f"/v1/pods/{ref}/start", params=params or None)

    # network volumes
    def create_volume(self, request: VolumeCreateRequest | dict[str, Any]) -> VolumeOut:
        body = _body(request) if isinstance(request, BaseModel) else request
        return self._typed(VolumeOut, "POST", "/v1/volumes", json=body)

    def list_volumes(self) -> list[VolumeOut]:
        return self._typed(list[VolumeOut], "GET", "/v1/volumes")

    def get_volume(self, ref: str) -> VolumeOut:
        return self._typed(VolumeOut, "GET", f"/v1/volumes/{ref}")

    def delete_volume(self, ref: str) -> None:
        self._call("DELETE", f"/v1/volumes/{ref}")

    def delete_pod(self, ref: str) -> None:
        self._call("DELETE", f"/v1/pods/{ref}")

    def pod_access(self, ref: str) -> PodAccessOut:
        """The pod's ``ssh`` command and the proxy URLs of its HTTP ports."""
        return self._typed(PodAccessOut, "GET", f"/v1/pods/{ref}/access")

    # SSH keys
    def add_ssh_key(self, public_key: str, name: str | None = None) -> SshKeyOut:
        body: dict[str, Any] = {"public_key": public_key}
        if name is not None:
            body["name"] = name
        return self._typed(SshKeyOut, "POST", "/v1/ssh-keys", json=body)

    def list_ssh_keys(self) -> list[SshKeyOut]:
        return self._typed(list[SshKeyOut], "GET", "/v1/ssh-keys")

    def remove_ssh_key(self, ref: str) -> SshKeyOut:
        return self._typed(SshKeyOut, "DELETE", f"/v1/ssh-keys/{ref}")

    # jobs
    def create_job(self, request: JobCreateRequest | dict[str, Any]) -> JobOut:
        body = _body(request) if isinstance(request, BaseModel) else request
        return self._typed(JobOut, "POST", "/v1/jobs", json=body)

    def list_jobs(self) -> list[JobOut]:
        return self._typed(list[JobOut], "GET", "/v1/jobs")

    def get_job(self, ref: str) -> JobOut:
        return self._typed(JobOut, "GET", f"/v1/jobs/{ref}")

    def job_why(self, ref: str) -> JobWhyOut:
        return self._typed(JobWhyOut, "GET", f"/v1/jobs/{ref}/why")

    def job_logs(self, ref: str, offsets: str | None = None,
                 tail: int | None = None) -> JobLogsOut:
        """Members' output; to follow, pass ``offsets`` ("" first, then each answer's
        ``offsets``) to get only the whole lines written since."""
        params: dict[str, Any] = {}
        if offsets is not None:
            params["offsets"] = offsets
        if tail is not None:
            params["tail"] = tail
        return self._typed(JobLogsOut, "GET", f"/v1/jobs/{ref}/logs", params=params)

    def job_events(self, ref: str) -> list[JobEventOut]:
        return self._typed(list[JobEventOut], "GET", f"/v1/jobs/{ref}/events")

    def stop_job(self, ref: str) -> JobOut:
        return self._typed(JobOut, "POST", f"/v1/jobs/{ref}/stop")

    def delete_job(self, ref: str) -> None:
        self._call("DELETE", f"/v1/jobs/{ref}")

    # templates and registry credentials: a template takes the same spec as a pod
    def create_template(self, request: TemplateCreateRequest | dict[str, Any]) -> TemplateOut:
        body = _body(request) if isinstance(request, BaseModel) else request
        return self._typed(TemplateOut, "POST", "/v1/templates", json=body)

    def list_templates(self) -> list[TemplateOut]:
        return self._typed(list[TemplateOut], "GET", "/v1/templates")

    def get_template(self, ref: str) -> TemplateOut:
        return self._typed(TemplateOut, "GET", f"/v1/templates/{ref}")

    def delete_template(self, ref: str) -> None:
        self._call("DELETE", f"/v1/templates/{ref}")

    def add_registry_auth(self, request: RegistryAuthAddRequest) -> RegistryAuthOut:
        return self._typed(RegistryAuthOut, "POST", "/v1/registry-auths", json=_body(request))

    def list_registry_auths(self) -> list[RegistryAuthOut]:
        return self._typed(list[RegistryAuthOut], "GET", "/v1/registry-auths")

    def remove_registry_auth(self, ref: str) -> None:
        self._call("DELETE", f"/v1/registry-auths/{ref}")

    # scheduling policy
    def list_priority_classes(self) -> list[PriorityClassOut]:
        return self._typed(list[PriorityClassOut], "GET", "/v1/priority-classes")

    def create_priority_class(self, request: PriorityClassCreateRequest) -> PriorityClassOut:
        return self._typed(PriorityClassOut, "POST", "/v1/priority-classes",
                           json=_body(request))

    def list_quotas(self) -> list[QuotaOut]:
        return self._typed(list[QuotaOut], "GET", "/v1/quotas")

    def set_quota(self, project: str, request: QuotaSetRequest) -> QuotaOut:
        return self._typed(QuotaOut, "PUT", f"/v1/quotas/{project}", json=_body(request))


class AgentClient(_Base):
    """The node agent's side of the protocol; authenticated with the node token."""

    def register(self, request: NodeRegisterRequest) -> NodeRegisterResponse:
        return self._typed(NodeRegisterResponse, "POST", "/v1/agent/register",
                           json=_body(request))

    def lease(self, fencing_token: int | None) -> LeaseResponse:
        return self._typed(LeaseResponse, "POST", "/v1/agent/lease",
                           json={"fencing_token": fencing_token})

    def assignments(self, revision: int | None = None, wait: float = 0) -> AssignmentsOut:
        params: dict[str, Any] = {"wait": wait}
        if revision is not None:
            params["revision"] = revision
        return self._typed(AssignmentsOut, "GET", "/v1/agent/assignments", params=params,
                           timeout=wait + 30)

    def report_status(self, pod_id: str, report: AgentPodStatusRequest) -> str:
        body = self._call("POST", f"/v1/agent/pods/{pod_id}/status", json=_body(report))
        return str(body["phase"])

    def report_ready(self, pod_id: str, report: AgentPodReadyRequest) -> None:
        """A job member's container is created and waits at the start barrier."""
        self._call("POST", f"/v1/agent/pods/{pod_id}/ready", json=_body(report))

    def append_log(self, pod_id: str, chunk: AgentLogChunkRequest) -> int:
        body = self._call("POST", f"/v1/agent/pods/{pod_id}/logs", json=_body(chunk))
        return int(body["next_offset"])

    def with_token(self, token: str) -> AgentClient:
        """A client for the same server authenticated with a node token."""
        return AgentClient(self.url, token, transport=self._transport)
