"""The agent renews at a third of the TTL the server granted last (it grows with the
fleet: services/lease_ttl.py), jittered down by up to a tenth, never later."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

from gpucloud.agent.connection import Connection as AgentConnection
from gpucloud.agent.identity import IdentityFile
from gpucloud.core.models import LeaseResponse, NodeRegisterRequest


def test_the_renewal_period_follows_the_granted_ttl_jittered_never_later(
        tmp_path: Path) -> None:
    registration = NodeRegisterRequest(join_token="gpj_x", name="n1", cpu_cores=1,
                                       memory_bytes=1 << 30, gpus=[])
    connection = AgentConnection("http://127.0.0.1:1", registration, IdentityFile(tmp_path),
                                 threading.Event())
    assert 3.0 <= connection.renewal_period() <= 10.0 / 3  # before any grant: 10 s
    connection._set_token(LeaseResponse(  # noqa: SLF001 - a renewal's answer
        fencing_token=1, lease_expires_at=datetime.now(UTC), lease_ttl_seconds=30.0,
        new_grant=False))
    periods = [connection.renewal_period() for _ in range(500)]
    assert all(9.0 <= p <= 10.0 for p in periods)  # TTL/3, less up to a tenth
    assert max(periods) - min(periods) > 0.5  # spread out, not in lockstep
    assert connection.lease_timeout == 15.0
