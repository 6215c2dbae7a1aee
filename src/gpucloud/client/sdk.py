"""The gpucloud SDK: one method per API call, typed with the wire models of core.models.

Errors come back as the matching class of the exception tree (``NotFound``, ``Conflict``,
…) carrying the server's one-line ``detail``; a server that cannot be reached raises
``ApiError`` with status 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from gpucloud.core.access import PodAccessOut, SshKeyOut, VolumeCreateRequest, VolumeOut
from gpucloud.core.billing import (
    InvoiceOut,
    PriceOut,
    PriceSetRequest,
    SpendLimitOut,
    SpendLimitSetRequest,
    UsageOut,
)
from gpucloud.core.checkpoints import (
    AgentCheckpointRequest,
    CheckpointCommitRequest,
    CheckpointDetailOut,
    CheckpointMissingOut,
    CheckpointMissingRequest,
    CheckpointOut,
    CheckpointRejectRequest,
    ChunkUploadOut,
    Manifest,
)
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
    JoinTokenInfoOut,
    JoinTokenOut,
    JoinTokenRequest,
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
from gpucloud.core.serverless import EndpointCreateRequest, EndpointOut, EndpointUpdateRequest
from gpucloud.core.spec import (
    RegistryAuthAddRequest,
    RegistryAuthOut,
    TemplateCreateRequest,
    TemplateOut,
)
from gpucloud.core.usage import AgentUsageBatchOut, AgentUsageBatchRequest

T = TypeVar("T")


class ApiError(GpucloudError):
    """An API error with no more specific class, or no answer at all (status 0)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        #: The server's ``Retry-After`` in seconds (a 503 or 429), None when it sent none.
        self.retry_after = retry_after


#: The error class an HTTP status stands for (422 is ``InvalidInput``, with its field).
ERROR_KINDS: dict[int, type[GpucloudError]] = {
    401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
}


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
    if code in ERROR_KINDS:
        raise ERROR_KINDS[code](detail)
    raise ApiError(code, f"server answered {code}: {detail}",
                   _retry_after(response.headers.get("Retry-After")))


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in delay-seconds (the HTTP-date form is not used by gpucloud)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class _Base:
    #: how long an idle connection is kept for the next request (httpx's default: 5 s)
    keepalive_expiry = 5.0

    def __init__(self, url: str, token: str | None, transport: httpx.BaseTransport | None = None,
                 timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._transport = transport
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20,
                              keepalive_expiry=self.keepalive_expiry)  # httpx's, but that
        self._http = httpx.Client(base_url=self.url, headers=headers, transport=transport,
                                  timeout=timeout, limits=limits)

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

    def _raw(self, method: str, path: str, *, content: bytes | None = None,
             headers: dict[str, str] | None = None,
             params: dict[str, Any] | None = None) -> httpx.Response:
        """A request whose body or answer is bytes, not JSON (checkpoint chunks)."""
        try:
            response = self._http.request(method, path, content=content, headers=headers,
                                          params=params)
        except httpx.TransportError as error:
            raise ApiError(0, f"cannot reach the gpucloud server at {self.url}: {error}") from None
        _raise_for(response)
        return response


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
    def create_join_token(self, uses: int | None = None,
                          ttl_seconds: float | None = None) -> JoinTokenOut:
        body = _body(JoinTokenRequest(uses=uses, ttl_seconds=ttl_seconds))
        return self._typed(JoinTokenOut, "POST", "/v1/nodes/join-tokens",
                           json={k: v for k, v in body.items() if v is not None})

    def list_join_tokens(self) -> list[JoinTokenInfoOut]:
        return self._typed(list[JoinTokenInfoOut], "GET", "/v1/nodes/join-tokens")

    def revoke_join_token(self, ref: str) -> JoinTokenInfoOut:
        return self._typed(JoinTokenInfoOut, "POST", f"/v1/nodes/join-tokens/{ref}/revoke")

    def list_nodes(self) -> list[NodeOut]:
        return self._typed(list[NodeOut], "GET", "/v1/nodes")

    def get_node(self, ref: str) -> NodeOut:
        return self._typed(NodeOut, "GET", f"/v1/nodes/{ref}")

    def cordon(self, ref: str, cordoned: bool = True) -> NodeOut:
        action = "cordon" if cordoned else "uncordon"
        return self._typed(NodeOut, "POST", f"/v1/nodes/{ref}/{action}")

    def set_mig_policy(self, ref: str, mode: str) -> NodeOut:
        """``gpucloud node mig NODE --mode dynamic|fixed|off``."""
        return self._typed(NodeOut, "POST", f"/v1/nodes/{ref}/mig", json={"mode": mode})

    def gpu_action(self, ref: str, action: str, gpu: int | None = None,
                   level: int = 1, wait_seconds: float = 0) -> NodeOut:
        """``gpucloud node gpu-reset NODE GPU`` (``reset``) / ``node diag`` (``diag``) /
        ``node mig-mode NODE GPU --on|--off`` (``mig-on``/``mig-off``: ``wait_seconds``
        how long the switch may wait for the GPU's pods to end; 0: 409 while they run)."""
        return self._typed(NodeOut, "POST", f"/v1/nodes/{ref}/gpu-actions",
                           json={"action": action, "gpu": gpu, "level": level,
                                 "wait_seconds": wait_seconds})

    def set_mig_mode(self, ref: str, gpu: int, on: bool, wait_seconds: float = 0) -> NodeOut:
        """Switch GPU ``gpu``'s MIG mode at drain time (``gpucloud node mig-mode``)."""
        return self.gpu_action(ref, "mig-on" if on else "mig-off", gpu,
                               wait_seconds=wait_seconds)

    def drain(self, ref: str, deadline: str | float | None = None) -> NodeOut:
        """Drain a node (``deadline``: ``60s``, ``10m``; None: the server's default)."""
        body = {} if deadline is None else {"deadline": deadline}
        return self._typed(NodeOut, "POST", f"/v1/nodes/{ref}/drain", json=body)

    def undrain(self, ref: str) -> NodeOut:
        return self._typed(NodeOut, "POST", f"/v1/nodes/{ref}/undrain")

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
                 attempt: int | None = None, wait: float = 0) -> PodLogsOut:
        """The pod's output from byte ``offset``. ``wait`` (up to 30 s): a long poll that
        answers as soon as there is output past ``offset`` (or the pod has finished), else
        with no text once it is over; follow with ``next_offset`` and ``attempt``."""
        params: dict[str, Any] = {"offset": offset}
        if tail is not None:
            params["tail"] = tail
        if attempt is not None:
            params["attempt"] = attempt
        if wait:
            params["wait"] = wait
        return self._typed(PodLogsOut, "GET", f"/v1/pods/{ref}/logs", params=params,
                           timeout=wait + 30 if wait else None)

    def follow_pod_logs(self, ref: str, tail: int | None = None,
                        wait: float = 30) -> Iterator[PodLogsOut]:
        """The pod's output as it comes, piece by piece (each a waiting read of up to
        ``wait`` s: no polling), until the pod has finished and all of it was read."""
        chunk = self.pod_logs(ref, tail=tail)
        yield chunk
        while not chunk.finished:
            chunk = self.pod_logs(ref, offset=chunk.next_offset, attempt=chunk.attempt,
                                  wait=wait)
            if chunk.text:
                yield chunk

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

    # serverless endpoints

    def create_endpoint(self, request: EndpointCreateRequest | dict[str, Any]) -> EndpointOut:
        body = _body(request) if isinstance(request, BaseModel) else request
        return self._typed(EndpointOut, "POST", "/v1/endpoints", json=body)

    def list_endpoints(self) -> list[EndpointOut]:
        return self._typed(list[EndpointOut], "GET", "/v1/endpoints")

    def get_endpoint(self, ref: str) -> EndpointOut:
        return self._typed(EndpointOut, "GET", f"/v1/endpoints/{ref}")

    def update_endpoint(self, ref: str,
                        request: EndpointUpdateRequest | dict[str, Any]) -> EndpointOut:
        body = _body(request) if isinstance(request, BaseModel) else request
        return self._typed(EndpointOut, "PATCH", f"/v1/endpoints/{ref}", json=body)

    def delete_endpoint(self, ref: str) -> None:
        self._call("DELETE", f"/v1/endpoints/{ref}")

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

    # prices, usage, invoices, spend limits
    def list_prices(self) -> list[PriceOut]:
        return self._typed(list[PriceOut], "GET", "/v1/prices")

    def set_price(self, request: PriceSetRequest | dict[str, Any]) -> PriceOut:
        body = request if isinstance(request, dict) else _body(request)
        return self._typed(PriceOut, "POST", "/v1/prices", json=body)

    def usage(self, project: str | None = None, since: str | None = None,
              until: str | None = None, by: str = "pod") -> UsageOut:
        params = {k: v for k, v in (("project", project), ("since", since), ("until", until),
                                    ("by", by)) if v is not None}
        return self._typed(UsageOut, "GET", "/v1/usage", params=params)

    def invoice(self, project: str, month: str) -> InvoiceOut:
        return self._typed(InvoiceOut, "GET", f"/v1/invoices/{project}",
                           params={"month": month})

    def get_spend_limit(self, project: str) -> SpendLimitOut:
        return self._typed(SpendLimitOut, "GET", f"/v1/projects/{project}/spend-limit")

    def set_spend_limit(self, project: str,
                        request: SpendLimitSetRequest | dict[str, Any]) -> SpendLimitOut:
        body = request if isinstance(request, dict) else _body(request)
        return self._typed(SpendLimitOut, "PUT", f"/v1/projects/{project}/spend-limit",
                           json=body)


    # checkpoints (``--checkpoint-dir``)
    def list_checkpoints(self, pod: str) -> list[CheckpointOut]:
        return self._typed(list[CheckpointOut], "GET", f"/v1/pods/{pod}/checkpoints")

    def get_checkpoint(self, pod: str, checkpoint_id: str = "latest") -> CheckpointDetailOut:
        return self._typed(CheckpointDetailOut, "GET",
                           f"/v1/pods/{pod}/checkpoints/{checkpoint_id}")

    def delete_checkpoints(self, pod: str, checkpoint_id: str | None = None) -> int:
        """Delete one checkpoint of the pod, or (no id) all of them; returns how many."""
        path = f"/v1/pods/{pod}/checkpoints" + (f"/{checkpoint_id}" if checkpoint_id else "")
        return int(self._call("DELETE", path)["deleted"])


class AgentClient(_Base):
    """The node agent's side of the protocol; authenticated with the node token."""

    #: Longer than a renewal's period (TTL/3; the TTL grows with the fleet,
    #: services/lease_ttl.py), else each renewal opens a new connection; shorter than the
    #: server's keep-alive (cli/server.py, 75 s), so that the agent, not the server, closes
    #: an idle one (no request sent on a connection the server is closing).
    keepalive_expiry = 60.0

    def register(self, request: NodeRegisterRequest) -> NodeRegisterResponse:
        return self._typed(NodeRegisterResponse, "POST", "/v1/agent/register",
                           json=_body(request))

    def lease(self, fencing_token: int | None, health: dict[str, Any] | None = None,
              timeout: float | None = None) -> LeaseResponse:
        """Renew the lease; ``health``: the GPUs' health and any node-level fault;
        ``timeout``: the agent's, inside its lease (AgentConnection.lease_timeout)."""
        return self._typed(LeaseResponse, "POST", "/v1/agent/lease",
                           json={"fencing_token": fencing_token, **(health or {})},
                           timeout=timeout)

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

    def post_usage(self, batch: AgentUsageBatchRequest) -> AgentUsageBatchOut:
        """Usage samples (agent/usage); idempotent per (pod, attempt, seq)."""
        return self._typed(AgentUsageBatchOut, "POST", "/v1/agent/usage", json=_body(batch))

    # checkpoints of --checkpoint-dir (services/checkpoints: upload, commit, restore)
    def open_checkpoint_upload(self, pod_id: str,
                               request: CheckpointMissingRequest) -> CheckpointMissingOut:
        return self._typed(CheckpointMissingOut, "POST",
                           f"/v1/agent/pods/{pod_id}/checkpoints/uploads", json=_body(request))

    def checkpoint_chunk_status(self, pod_id: str, digest: str, fencing_token: int,
                                attempt: int) -> ChunkUploadOut:
        return self._typed(ChunkUploadOut, "GET",
                           f"/v1/agent/pods/{pod_id}/checkpoint-chunks/{digest}/upload",
                           params={"fencing_token": fencing_token, "attempt": attempt})

    def put_checkpoint_chunk(self, pod_id: str, digest: str, data: bytes, start: int,
                             total: int, fencing_token: int, attempt: int) -> ChunkUploadOut:
        """One piece of a chunk at ``start`` (``Content-Range``) of its ``total`` bytes."""
        headers = {"Content-Range": f"bytes {start}-{start + len(data) - 1}/{total}",
                   "Content-Type": "application/octet-stream",
                   "X-Gpucloud-Fencing-Token": str(fencing_token),
                   "X-Gpucloud-Attempt": str(attempt)}
        response = self._raw("PUT", f"/v1/agent/pods/{pod_id}/checkpoint-chunks/{digest}",
                             content=data, headers=headers)
        return ChunkUploadOut.model_validate_json(response.content)

    def get_checkpoint_chunk(self, pod_id: str, digest: str, fencing_token: int,
                             attempt: int) -> bytes:
        return self._raw("GET", f"/v1/agent/pods/{pod_id}/checkpoint-chunks/{digest}",
                         params={"fencing_token": fencing_token, "attempt": attempt}).content

    def commit_checkpoint(self, pod_id: str, request: CheckpointCommitRequest) -> CheckpointOut:
        return self._typed(CheckpointOut, "POST", f"/v1/agent/pods/{pod_id}/checkpoints",
                           json=_body(request))

    def pod_checkpoints(self, pod_id: str, fencing_token: int,
                        attempt: int) -> list[CheckpointOut]:
        return self._typed(list[CheckpointOut], "GET", f"/v1/agent/pods/{pod_id}/checkpoints",
                           params={"fencing_token": fencing_token, "attempt": attempt})

    def checkpoint_manifest(self, pod_id: str, checkpoint_id: str, fencing_token: int,
                            attempt: int) -> Manifest:
        return self._typed(Manifest, "GET",
                           f"/v1/agent/pods/{pod_id}/checkpoints/{checkpoint_id}/manifest",
                           params={"fencing_token": fencing_token, "attempt": attempt})

    def reject_checkpoint(self, pod_id: str, checkpoint_id: str,
                          request: CheckpointRejectRequest) -> None:
        self._call("POST", f"/v1/agent/pods/{pod_id}/checkpoints/{checkpoint_id}/reject",
                   json=_body(request))

    def checkpoint_restored(self, pod_id: str, checkpoint_id: str,
                            request: AgentCheckpointRequest) -> None:
        self._call("POST", f"/v1/agent/pods/{pod_id}/checkpoints/{checkpoint_id}/restored",
                   json=_body(request))

    def with_token(self, token: str) -> AgentClient:
        """A client for the same server authenticated with a node token."""
        return AgentClient(self.url, token, transport=self._transport)
