"""The replicas' LISTEN/NOTIFY bridge on a real PostgreSQL: what one replica publishes
reaches the others' long polls (node assignments, serverless queue wake-ups) and caches."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psycopg
import pytest

from gpucloud.services import notify, serverless_queue, wakeups
from gpucloud.services.context import TtlCache
from gpucloud.services.wakeups import Wakeups


@pytest.fixture
def bridge(postgres_url: str) -> Iterator[notify.NotifyBridge]:
    running = notify.NotifyBridge(postgres_url, TtlCache())
    running.start()
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


def test_a_stored_log_chunk_is_published_for_the_other_replicas(
        bridge: notify.NotifyBridge, postgres_url: str) -> None:
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        wakeups.LOGS.notify("pod-2")
        payloads = [n.payload for n in listener.notifies(timeout=5.0, stop_after=1)]
    assert payloads == ["l:pod-2"]


def test_a_serverless_wakeup_is_published_for_the_other_replicas(
        bridge: notify.NotifyBridge, postgres_url: str) -> None:
    with psycopg.connect(notify._dsn(postgres_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {notify.CHANNEL}")
        serverless_queue.WAKEUPS.notify("r:request-2")
        payloads = [n.payload for n in listener.notifies(timeout=5.0, stop_after=1)]
    assert payloads == ["s:r:request-2"]
