"""Bad input the fuzzer found (tests/fuzz): each class of bug once, on SQLite and on
PostgreSQL — a 422 naming the field (or 413), never a 500, nothing written."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.api.limits import (
    DEFAULT_BODY_LIMIT,
    LONG_QUERY_VALUES,
    MAX_PATH_SEGMENT,
    MAX_QUERY_VALUE,
    check_json_body,
    check_url,
)
from gpucloud.core.errors import InvalidInput
from gpucloud.core.quantities import parse_cpu_milli, parse_duration, parse_memory

POD = {"name": "a1", "image": "busybox:1"}


def _refused(response: Any, field: str, status: int = 422) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["field"] == field and body["detail"], body


@pytest.mark.parametrize(("fields", "field"), [
    ({"cpu": 1.7976931348623157e+308}, "cpu"),   # OverflowError in round(cpu * 1000)
    ({"cpu": "9" * 400}, "cpu"),                   # float("999…") is inf
    ({"memory": "9" * 400 + "Gi"}, "memory"),
    ({"volume_size": "9" * 400}, "volume_size"),
    ({"max_duration": {}}, "max_duration"),        # TypeError in the duration regex
    ({"max_duration": [1]}, "max_duration"),
])
def test_numbers_past_any_bound_are_422_naming_the_field(
        api: TestClient, fields: dict[str, Any], field: str) -> None:
    _refused(api.post("/v1/pods", json={**POD, **fields}), field)
    assert api.get("/v1/pods").json() == []


@pytest.mark.parametrize(("body", "field"), [
    ({**POD, "env": {"A": "x\x00y"}}, "env.A"),   # PostgreSQL's text cannot hold NUL
    ({**POD, "env": {"A\x00": "x"}}, "env"),
    ({**POD, "command": ["sh", "-c\x00"]}, "command.1"),
    ({**POD, "name": "a\x00"}, "name"),
])
def test_nul_in_any_string_is_422_on_both_databases(
        api: TestClient, body: dict[str, Any], field: str) -> None:
    _refused(api.post("/v1/pods", json=body), field)
    assert api.get("/v1/pods").json() == []


def test_integers_past_bigint_are_422(api: TestClient) -> None:
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    response = api.post("/v1/agent/register", json={
        "join_token": token, "name": "n1", "cpu_cores": 8, "memory_bytes": 2**70})
    _refused(response, "memory_bytes")
    assert api.get("/v1/nodes").json() == []


def test_non_finite_numbers_are_422(api: TestClient) -> None:
    body = '{"name": "a1", "image": "busybox:1", "cpu": NaN}'
    response = api.post("/v1/pods", content=body,
                        headers={"Content-Type": "application/json"})
    _refused(response, "cpu")


def test_a_body_past_the_limit_is_413_in_the_error_shape(api: TestClient) -> None:
    body = json.dumps({**POD, "env": {"A": "x" * DEFAULT_BODY_LIMIT}})
    response = api.post("/v1/pods", content=body,
                        headers={"Content-Type": "application/json"})
    _refused(response, "body", 413)


def test_agent_routes_take_bodies_past_the_default_limit(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    node = register_node("n1", gpus=[])
    chunk = {"fencing_token": node["fencing_token"], "offset": 0,
             "data": "x" * (DEFAULT_BODY_LIMIT - 100) + "\u00e9" * 100}
    response = api.post("/v1/agent/pods/nope/logs", json=chunk,
                        headers={"Authorization": f"Bearer {node['node_token']}"})
    assert response.status_code == 404, response.text  # read whole: no such pod here


def test_unparsable_json_is_422_naming_the_body(api: TestClient) -> None:
    for content in (b"\xff\xfe{", b"{not json"):
        response = api.post("/v1/pods", content=content,
                            headers={"Content-Type": "application/json"})
        _refused(response, "body")


def test_a_path_segment_past_its_bound_is_422_before_any_route(api: TestClient) -> None:
    ok = api.get("/v1/pods/" + "a" * MAX_PATH_SEGMENT)
    assert ok.status_code == 404  # at the bound: the route answers
    _refused(api.get("/v1/pods/" + "a" * (MAX_PATH_SEGMENT + 1)), "path")
    _refused(api.post("/v1/nodes/" + "n" * 5000 + "/cordon"), "path")
    _refused(api.delete("/v1/pods/" + "%C3%A9" * (MAX_PATH_SEGMENT + 1)), "path")  # decoded
    assert api.get("/v1/pods").json() == []


def test_a_query_value_past_its_bound_is_422_naming_it(api: TestClient) -> None:
    _refused(api.get("/v1/usage", params={"project": "p" * (MAX_QUERY_VALUE + 1)}), "project")
    at_bound = api.get("/v1/usage", params={"project": "p" * MAX_QUERY_VALUE})
    assert at_bound.status_code == 404  # the route decides: no such project
    # A job's log offsets hold up to 1,024 positions: a longer bound of their own.
    long = ",".join(f"{rank}:0:{2**40}" for rank in range(1024))
    assert MAX_QUERY_VALUE < len(long) <= LONG_QUERY_VALUES["offsets"]
    assert api.get("/v1/jobs/nope/logs", params={"offsets": long}).status_code == 404
    past = b"offsets=" + b"1" * (LONG_QUERY_VALUES["offsets"] + 1)  # past httpx's own limit
    assert check_url("/v1/jobs/nope/logs", past) == (
        "offsets", f"offsets: at most {LONG_QUERY_VALUES['offsets']} characters")


def test_url_check_measures_decoded_values() -> None:
    assert check_url("/v1/pods/" + "é" * MAX_PATH_SEGMENT, b"") is None
    assert check_url("/v1/pods", b"a=" + b"%41" * MAX_QUERY_VALUE) is None  # decodes to A*N
    assert check_url("/v1/pods", b"a=" + b"%41" * (MAX_QUERY_VALUE + 1)) == (
        "a", f"a: at most {MAX_QUERY_VALUE} characters")


def test_405_lists_every_method_of_the_path(api: TestClient) -> None:
    response = api.request("OPTIONS", "/v1/pods/abc")
    assert response.status_code == 405
    assert response.headers["allow"] == "DELETE, GET"
    assert api.request("PUT", "/v1/pods").headers["allow"] == "GET, POST"


def test_openapi_describes_errors_and_both_credentials(app_client: TestClient) -> None:
    schema = app_client.get("/openapi.json").json()
    assert set(schema["components"]["securitySchemes"]) == {
        "ApiKey", "NodeToken", "RunPodApiKey", "RunPodApiKeyQuery"}  # the last two: /runpod
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    pods = schema["paths"]["/v1/pods"]["post"]
    assert pods["security"] == [{"ApiKey": []}]
    for code in ("401", "403", "404", "409", "413", "422", "429"):
        assert pods["responses"][code]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorOut"}
    assert schema["paths"]["/v1/agent/lease"]["post"]["security"] == [{"NodeToken": []}]
    assert "401" in schema["paths"]["/v1/agent/register"]["post"]["responses"]
    for operation in (op for item in schema["paths"].values() for op in item.values()):
        assert not any(p["name"].lower() == "authorization"
                       for p in operation.get("parameters", []))
        for parameter in operation.get("parameters", []):  # every string in the URL bounded
            if parameter["in"] not in ("path", "query"):
                continue
            for option in parameter["schema"].get("anyOf", [parameter["schema"]]):
                if option.get("type") == "string" and "enum" not in option:
                    assert option["maxLength"] <= LONG_QUERY_VALUES["offsets"], parameter
                    # the worst URL (12 bytes a character) fits the server's request line,
                    # or the HTTP parser's bare 400 past it is documented
                    if option["maxLength"] * 12 > 65_535:
                        assert "text/plain" in operation["responses"]["400"]["content"]
                        assert parameter["name"] in LONG_QUERY_VALUES


def test_quantity_parsers_refuse_what_would_overflow() -> None:
    for parse, value in ((parse_cpu_milli, 1e308), (parse_cpu_milli, "9" * 400),
                         (parse_memory, "1" + "0" * 30), (parse_duration, float("inf")),
                         (parse_duration, {}), (parse_cpu_milli, [1])):
        with pytest.raises(InvalidInput):
            parse("x", value)  # type: ignore[operator]


def test_json_body_check_names_the_first_bad_value() -> None:
    assert check_json_body(b'{"a": [1, {"b": 9223372036854775808}]}') == (
        "a.1.b", "a.1.b: must be between -2^63 and 2^63-1")
    assert check_json_body(b'{"a": -9223372036854775808, "b": 1.5, "c": true}') is None
    assert check_json_body(b'{"a": "x\\u0000"}', nul_allowed=True) is None
    assert check_json_body(b'{"a": "x\\u0000"}') is not None
    assert check_json_body(b"not json") is None
