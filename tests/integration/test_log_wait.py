"""Waiting log reads (``GET /v1/pods/{ref}/logs?wait=S``): answered as soon as the log
ingest stores output past the caller's offset (its wake-up, not the periodic re-read),
empty at the deadline, and at once for a finished pod (real SQLite and PostgreSQL)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.core.settings import Settings
from gpucloud.services import wakeups
from tests.integration.conftest import agent_headers

POD = {"name": "talker", "image": "busybox", "command": ["sleep", "60"], "gpus": 1}
#: Longer than any wait here: a read that answers early was woken, not re-checked.
RECHECK = 600.0
#: How long a woken read may take to come back (the wake-up is at once; this is slack
#: for a loaded machine, far below the 30 s the read would otherwise wait).
WOKEN_WITHIN = 20.0


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return dataclasses.replace(settings, log_wait_recheck_seconds=RECHECK)


def _running_pod(api: TestClient, register_node: Callable[..., dict[str, Any]],
                 schedule: Callable[[], Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    status = api.post(f"/v1/agent/pods/{pod['id']}/status", headers=agent_headers(reg),
                      json={"fencing_token": reg["fencing_token"], "phase": "Running"})
    assert status.status_code == 200, status.text
    return reg, pod


def _ship(api: TestClient, reg: dict[str, Any], pod: dict[str, Any], offset: int,
          data: str) -> None:
    response = api.post(f"/v1/agent/pods/{pod['id']}/logs", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "offset": offset,
                              "data": data})
    assert response.status_code == 200, response.text


def _waiting_read(api: TestClient, pod: dict[str, Any],
                  **params: Any) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """A read with ``wait=30`` on a thread, returned once the server listens for it."""
    answers: list[dict[str, Any]] = []

    def read() -> None:
        response = api.get(f"/v1/pods/{pod['id']}/logs", params={"wait": 30, **params})
        assert response.status_code == 200, response.text
        answers.append(response.json())

    reader = threading.Thread(target=read)
    reader.start()
    while wakeups.LOGS.listeners(pod["id"]) == 0 and reader.is_alive():
        threading.Event().wait(0.005)
    return reader, answers


def test_a_waiting_read_answers_when_a_line_is_stored(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg, pod = _running_pod(api, register_node, schedule)
    reader, answers = _waiting_read(api, pod)
    assert reader.is_alive() and answers == []  # nothing yet: it waits
    _ship(api, reg, pod, 0, "hello\n")
    reader.join(timeout=WOKEN_WITHIN)
    assert not reader.is_alive(), "the stored chunk did not wake the read"
    [answer] = answers
    assert (answer["text"], answer["next_offset"], answer["finished"]) == ("hello\n", 6, False)
    # following on: the next read waits past its offset, and gets only what is new
    reader, answers = _waiting_read(api, pod, offset=6, attempt=answer["attempt"])
    _ship(api, reg, pod, 6, "wörld\n")
    reader.join(timeout=WOKEN_WITHIN)
    assert not reader.is_alive()
    assert (answers[0]["text"], answers[0]["offset"], answers[0]["next_offset"]) == (
        "wörld\n", 6, 13)


def test_output_of_another_pod_does_not_answer_a_waiting_read(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg, pod = _running_pod(api, register_node, schedule)
    other = api.post("/v1/pods", json={**POD, "name": "other"}).json()
    schedule()
    reader, answers = _waiting_read(api, pod)
    _ship(api, reg, other, 0, "not yours\n")
    assert reader.is_alive() and answers == []
    _ship(api, reg, pod, 0, "yours\n")
    reader.join(timeout=WOKEN_WITHIN)
    assert not reader.is_alive() and answers[0]["text"] == "yours\n"


def test_the_pod_finishing_answers_a_waiting_read(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg, pod = _running_pod(api, register_node, schedule)
    _ship(api, reg, pod, 0, "bye\n")
    reader, answers = _waiting_read(api, pod, offset=4)
    done = api.post(f"/v1/agent/pods/{pod['id']}/status", headers=agent_headers(reg),
                    json={"fencing_token": reg["fencing_token"], "phase": "Succeeded",
                          "exit_code": 0})
    assert done.status_code == 200, done.text
    reader.join(timeout=WOKEN_WITHIN)
    assert not reader.is_alive(), "the final status did not wake the read"
    assert (answers[0]["text"], answers[0]["finished"]) == ("", True)
    assert wakeups.LOGS.listeners(pod["id"]) == 0


def test_a_waiting_read_answers_empty_at_its_deadline(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg, pod = _running_pod(api, register_node, schedule)
    _ship(api, reg, pod, 0, "one\n")
    answer = api.get(f"/v1/pods/{pod['id']}/logs", params={"offset": 4, "wait": 0.2}).json()
    assert (answer["text"], answer["offset"], answer["next_offset"]) == ("", 4, 4)
    assert not answer["finished"] and wakeups.LOGS.listeners(pod["id"]) == 0
    # output already there, or an attempt newer than the caller's: no wait at all
    at_once = api.get(f"/v1/pods/{pod['id']}/logs", params={"wait": 30}).json()
    assert at_once["text"] == "one\n"
    newer = api.get(f"/v1/pods/{pod['id']}/logs",
                    params={"offset": 4, "attempt": 0, "wait": 30}).json()
    assert (newer["attempt"], newer["text"]) == (1, "one\n")


class TestAServerHoldingReadsShorter:
    @pytest.fixture
    def settings(self, settings: Settings) -> Settings:
        return dataclasses.replace(settings, log_wait_max_seconds=0.1)

    def test_a_read_is_held_no_longer_than_the_setting(
        self, api: TestClient, register_node: Callable[..., dict[str, Any]],
        schedule: Callable[[], Any]
    ) -> None:
        _, pod = _running_pod(api, register_node, schedule)
        answer = api.get(f"/v1/pods/{pod['id']}/logs", params={"wait": 30}).json()
        assert (answer["text"], answer["next_offset"]) == ("", 0)


def test_a_bad_wait_is_422_naming_the_field(api: TestClient) -> None:
    pod = api.post("/v1/pods", json=POD).json()
    for wait in ["-1", "30.5", "soon", "nan", "inf"]:
        response = api.get(f"/v1/pods/{pod['id']}/logs", params={"wait": wait})
        assert response.status_code == 422, (wait, response.text)
        assert response.json()["field"] == "wait", wait


def test_a_follower_reads_each_offset_of_chunked_output(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    """A follower's read takes only the chunks from the one holding its offset on: every
    offset, within a chunk or on a boundary, still gets exactly the rest."""
    reg, pod = _running_pod(api, register_node, schedule)
    output, offset = b"", 0
    for piece in ["ab\n", "cdé\n", "f", "gh\n"]:
        _ship(api, reg, pod, offset, piece)
        output += piece.encode()
        offset = len(output)
    for at in range(len(output) + 2):
        read = api.get(f"/v1/pods/{pod['id']}/logs", params={"offset": at}).json()
        expected = output[min(at, len(output)):].decode(errors="ignore")
        assert (read["text"], read["offset"], read["next_offset"]) == (
            expected, min(at, len(output)), len(output)), at
