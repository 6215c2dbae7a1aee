"""The replicas' LISTEN/NOTIFY bridge on a real PostgreSQL: what one replica publishes
reaches the others' long polls (node assignments, serverless queue wake-ups) and caches."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import psycopg
import pytest

from gpucloud.services import notify, serverless_queue, wakeups
from gpucloud.services.context import TtlCache
from gpucloud.services.wakeups import Wakeups


@pytest.fixture
def bridge(postgres_url: str) -> Iterator[notify.NotifyBridge]:
    running = notify.NotifyBridge(postgres_url, TtlCache())
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        running.start()  # its hello, sent once it listens, is the first thing it sends
        hello = [n.payload for n in listener.notifies(timeout=10.0, stop_after=1)]
        assert hello == [notify.HELLO + running.origin]
    yield running
    running.stop()


def _another_replica_publishes(postgres_url: str, payload: str) -> None:
    """What a replica's publisher thread sends (one NOTIFY, keys space-separated)."""
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (notify.CHANNEL, payload))


async def _woken(hub: Wakeups, key: str, postgres_url: str, payload: str) -> bool:
    with hub.listen(key) as event:
        for _ in range(50):  # until the bridge's LISTEN is up: a hint sent before is lost
            await asyncio.to_thread(_another_replica_publishes, postgres_url, payload)
            if await wakeups.wait(event, 0.2):
                return True
    return False


def test_serverless_and_assignment_wakeups_cross_replicas(bridge: notify.NotifyBridge,
                                                          postgres_url: str) -> None:
    queue_key, request_key, node = "q:endpoint-1", "r:request-1", "node-1"
    payload = f"s:{queue_key} s:{request_key} a:{node}"
    assert asyncio.run(_woken(serverless_queue.WAKEUPS, queue_key, postgres_url, payload))
    assert asyncio.run(_woken(serverless_queue.WAKEUPS, request_key, postgres_url, payload))
    assert asyncio.run(_woken(wakeups.ASSIGNMENTS, node, postgres_url, payload))
    # a pod's log grew on another replica: its waiting reads here re-read it now
    assert asyncio.run(_woken(wakeups.LOGS, "pod-1", postgres_url, "l:pod-1"))
    assert not asyncio.run(_woken_once(wakeups.LOGS, node, postgres_url, f"a:{node}"))
    # a serverless key is not an assignment key and the other way round
    assert not asyncio.run(_woken_once(wakeups.ASSIGNMENTS, queue_key, postgres_url,
                                       f"s:{queue_key}"))


async def _woken_once(hub: Wakeups, key: str, postgres_url: str, payload: str) -> bool:
    with hub.listen(key) as event:
        await asyncio.to_thread(_another_replica_publishes, postgres_url, payload)
        return await wakeups.wait(event, 0.5)


def _received(listener: psycopg.Connection[tuple[object, ...]], seconds: float) -> list[str]:
    return [note.payload for note in listener.notifies(timeout=seconds, stop_after=1)]


def test_a_stored_log_chunk_is_published_only_while_another_replica_follows_the_pod(
        bridge: notify.NotifyBridge, postgres_url: str) -> None:
    """Most logs have no reader: their chunks cost no NOTIFY. A replica whose read waits
    on a pod announces it (``f:<origin>:<pod>``); from then on the pod's chunks stored
    here are published for it, and this replica's own follows are announced too."""
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        wakeups.LOGS.notify("pod-2")
        assert _received(listener, 1.0) == []  # no follower anywhere: nothing sent
        for _ in range(50):  # until the bridge's LISTEN is up: a hint sent before is lost
            _another_replica_publishes(postgres_url, "f:other:pod-2")
            if _received(listener, 0.2) == ["f:other:pod-2"] and wakeups.LOGS.followed(
                    "pod-2"):
                break
        assert wakeups.LOGS.followed("pod-2") and not wakeups.LOGS.followed("pod-3")
        wakeups.LOGS.notify("pod-2")
        wakeups.LOGS.notify("pod-3")
        assert _received(listener, 5.0) == ["l:pod-2"]
        assert _received(listener, 0.5) == []
        assert wakeups.LOGS.follow("pod-4")  # a read waits here: the others are told
        assert _received(listener, 5.0) == [f"f:{bridge.origin}:pod-4"]
        assert not wakeups.LOGS.followed("pod-4")  # its own announcement is no news here
        assert not wakeups.LOGS.follow("pod-4")  # told already
        _another_replica_publishes(postgres_url, f"h:{bridge.origin}")  # its own: no news
        _another_replica_publishes(postgres_url, "h:other")  # a replica joined: tell it
        hellos = _received(listener, 5.0)
        hellos += _received(listener, 5.0) if len(hellos) < 2 else []
        assert hellos == [f"h:{bridge.origin}", "h:other"]
        for _ in range(50):  # once the bridge has read it
            if wakeups.LOGS.follow("pod-4"):
                break
            threading.Event().wait(0.1)
        assert _received(listener, 5.0) == [f"f:{bridge.origin}:pod-4"]


def test_a_serverless_wakeup_is_published_for_the_other_replicas(
        bridge: notify.NotifyBridge, postgres_url: str) -> None:
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        serverless_queue.WAKEUPS.notify("r:request-2")
        payloads = [n.payload for n in listener.notifies(timeout=5.0, stop_after=1)]
    assert payloads == ["s:r:request-2"]
