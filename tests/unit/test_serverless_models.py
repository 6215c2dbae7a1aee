"""The serverless wire types: RunPod's GPU pools onto fleet models, durations, limits."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import lookup
from gpucloud.core.serverless import (
    GPU_POOLS,
    EndpointCreateRequest,
    EndpointUpdateRequest,
    RequestStatus,
    RunRequest,
    gpu_types_for_pools,
)


def test_every_pool_maps_onto_catalog_models() -> None:
    for pool, models in GPU_POOLS.items():
        assert models, pool
        assert all(lookup(model) is not None for model in models), pool


@pytest.mark.parametrize(("pools", "models"), [
    ("HOPPER_141", ["H200-141GB"]),
    ("ada_24, ADA_80_PRO", ["L4", "RTX4090", "H100-80GB", "H800-80GB"]),
    ("AMPERE_80,AMPERE_80", ["A100-80GB"]),
])
def test_pools_in_preference_order(pools: str, models: list[str]) -> None:
    assert gpu_types_for_pools(pools) == models


@pytest.mark.parametrize("pools", ["AMPERE_99", "", " , "])
def test_unknown_pools_are_refused(pools: str) -> None:
    with pytest.raises(InvalidInput) as error:
        gpu_types_for_pools(pools)
    assert error.value.field == "gpu_ids"


def test_create_defaults_and_durations() -> None:
    request = EndpointCreateRequest(name="echo", image="r/x:1", idle_timeout="2m",
                                    execution_timeout=90, gpu_ids="ada_24")
    assert (request.idle_timeout, request.execution_timeout) == (120.0, 90.0)
    assert (request.min_workers, request.max_workers, request.scaler.value) == (
        0, 3, "queue-delay")
    assert request.gpu_ids == "ADA_24"


@pytest.mark.parametrize(("field", "value"), [
    ("min_workers", -1), ("max_workers", 0), ("max_workers", 101), ("scaler_value", 0),
    ("max_retries", 11), ("idle_timeout", "2d"), ("execution_timeout", "0s"),
    ("scaler", "fastest"), ("gpu_ids", "VOLTA_1"), ("name", "Not_A_Label")])
def test_create_refuses(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as error:
        EndpointCreateRequest.model_validate({"name": "echo", "image": "r/x:1", field: value})
    assert error.value.errors()[0]["loc"][0] == field


def test_update_records_only_the_given_fields() -> None:
    update = EndpointUpdateRequest(max_workers=2, env={"A": "1"})
    assert update.model_fields_set == {"max_workers", "env"}


def test_statuses_and_run_bodies() -> None:
    assert [s for s in RequestStatus if s.final] == [
        RequestStatus.COMPLETED, RequestStatus.FAILED, RequestStatus.CANCELLED,
        RequestStatus.TIMED_OUT]
    assert RunRequest.model_validate({"input": None, "s3Config": {}}).input is None
    with pytest.raises(ValidationError):
        RunRequest.model_validate({"webhook": "http://h"})
    with pytest.raises(ValidationError):
        RunRequest.model_validate({"input": 1, "policy": {"ttl": 5}})
