"""Concurrent requests against the real databases: no duplicate or half-written pods."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import PodCreateRequest
from gpucloud.services import pods, projects
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY


def test_racing_creates_of_one_name_make_exactly_one_pod(ctx: ServiceContext) -> None:
    projects.bootstrap_admin(ctx)
    caller = projects.authenticate(ctx, ADMIN_KEY)
    request = PodCreateRequest(name="same", image="busybox", gpus=1)

    def create(_: int) -> str:
        try:
            return pods.create_pod(ctx, caller, request).id
        except InvalidInput as error:
            assert error.field == "name"
            return "duplicate"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(create, range(16)))
    assert outcomes.count("duplicate") == 15
    [pod] = pods.list_pods(ctx, caller)
    assert pod.id in outcomes
    assert len(pods.list_events(ctx, caller, "same")) == 1


def test_many_concurrent_creates_all_land(ctx: ServiceContext) -> None:
    projects.bootstrap_admin(ctx)
    caller = projects.authenticate(ctx, ADMIN_KEY)

    def create(i: int) -> str:
        return pods.create_pod(ctx, caller, PodCreateRequest(name=f"p{i}", image="x")).id

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(create, range(200)))
    listed = pods.list_pods(ctx, caller)
    assert len(set(ids)) == 200 and sorted(p.id for p in listed) == sorted(ids)
    assert [p.id for p in listed] == sorted(ids)
