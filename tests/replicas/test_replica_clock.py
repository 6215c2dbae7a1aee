"""Invariant (issue 16: leases use the database's clock, never a replica's): replicas whose
wall clocks are an hour apart write nothing on their own timelines. Through every replica
(an hour behind, an hour ahead, in step), whether the one in step or one an hour ahead
leads:

- a node registered and renewing its lease only through that replica stays Ready on its
  first grant (never marked Lost, never a new fencing token), its ``lease_expires_at``
  within a second or two of the database's ``now()`` + TTL;
- a node registered there that never renews is marked Lost within a few TTLs, not before
  its lease lapsed;
- a pod created there has ``created_at`` within a second or two of the database's
  ``now()``.

Each skewed replica runs under libfaketime (tests/fixtures/faketime.py) an hour off. Only
the replica named to lead runs the controllers (the others ``GPUCLOUD_CONTROLLERS=0``).
Before db/clock.py each replica wrote times off its own wall clock: through the replica an
hour behind every renewal wrote an expiry the leader saw as an hour past (the node Lost,
then a new grant), through the one an hour ahead a dead node's lease ran another hour
(never Lost), every ``created_at`` was an hour off, and a leader an hour ahead marked
even the nodes renewing through the replica in step Lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.fixtures.faketime import fake_clock
from tests.replicas.cluster import Cluster, Replica, replica_cluster, wait_for

LEASE_TTL = 3.0
#: How far a time written may be from the database's: renewals every TTL/3 (1 s), and
#: the statement's own delay.
SLACK = 2.0
#: How long the nodes are watched after they registered.
WATCH = 4 * LEASE_TTL
#: The replicas' clocks (libfaketime's offsets, seconds).
OFFSETS = ("-3600", "+3600", "+0")
#: What the nodes and pods made through each replica are named after.
NAMES = {"-3600": "behind", "+3600": "ahead", "+0": "in-step"}
#: The leader's, case by case: one in step with the database, one an hour ahead.
LEADERS = ("+0", "+3600")


@dataclass
class Node:
    replica: Replica
    name: str
    token: str
    fencing_token: int
    registered: float  # time.monotonic() of the registration's answer
    answers: list[str] = field(default_factory=list)  # renewals answered otherwise
    slowest: float = 0.0  # the slowest renewal's round trip (s)


def _register(cluster: Cluster, replica: Replica, name: str) -> Node:
    body = cluster.register_node(replica, name)
    return Node(replica, name, body["node_token"], body["fencing_token"], time.monotonic())


def _renew(node: Node, stop: threading.Event) -> None:
    """The node's agent: a renewal every TTL/3 through its replica (counted from when the
    previous one was sent, as agent/renewal.py does), on its first grant."""
    while True:
        sent = time.monotonic()
        try:
            response = httpx.post(
                f"{node.replica.url}/v1/agent/lease", timeout=LEASE_TTL / 2,
                headers={"Authorization": f"Bearer {node.token}"},
                json={"fencing_token": node.fencing_token})
        except httpx.HTTPError as error:
            node.answers.append(f"{error!r} after {time.monotonic() - sent:.1f} s")
        else:
            node.slowest = max(node.slowest, time.monotonic() - sent)
            if response.status_code != 200 or response.json()["new_grant"]:
                node.answers.append(f"{response.status_code} {response.text}")
        if stop.wait(max(0.0, sent + LEASE_TTL / 3 - time.monotonic())):
            return


@pytest.fixture(params=LEADERS, ids=lambda offset: f"leader{offset}")
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Cluster, Replica]]:
    """A replica on each of ``OFFSETS``' clocks, and the one that leads (its offset is
    the case's)."""
    env = {"GPUCLOUD_LEASE_TTL": str(LEASE_TTL), "GPUCLOUD_LEADER_TTL": "2"}
    each: list[dict[str, str]] = []
    with ExitStack() as stack:
        for offset in OFFSETS:
            extra = {} if offset == request.param else {"GPUCLOUD_CONTROLLERS": "0"}
            if offset != "+0":
                clock = stack.enter_context(fake_clock(tmp_path / f"clock{offset}"))
                clock.set(offset)
                extra |= clock.env
            each.append(extra)
        running = stack.enter_context(replica_cluster(len(OFFSETS), tmp_path, env, each))
        yield running, running.replicas[OFFSETS.index(request.param)]


def _off_database(cluster: Cluster, query: str, *params: object) -> float:
    """``query``'s one value, seconds, as measured against the database's ``now()``."""
    return float(cluster.sql(query, *params)[0][0])


Problems = dict[tuple[str, str], str]  # (node or pod, kind): the first of its kind


def _watch(cluster: Cluster, alive: list[Node], problems: Problems) -> dict[str, float]:
    """Look at every node every 0.25 s for ``WATCH`` seconds: the live ones' grants and
    expiries. Returns when each node was first seen Lost (``time.monotonic``)."""
    by_name = {node.name: node for node in alive}
    lost_at: dict[str, float] = {}
    started = time.monotonic()
    while time.monotonic() < started + WATCH:
        for name, status, token, left in cluster.sql(
                "SELECT name, status, fencing_token, "
                "extract(epoch FROM lease_expires_at - now()) FROM nodes"):
            if status == "Lost":
                lost_at.setdefault(name, time.monotonic())
            node = by_name.get(name)
            if node is None:
                continue
            if (status, token) != ("Ready", node.fencing_token):
                problems.setdefault((name, "grant"), f"{status}, fencing token {token} "
                                    f"(registered with {node.fencing_token})")
            elif abs(float(left) - LEASE_TTL) > SLACK:
                problems.setdefault((name, "expiry"), (
                    f"lease expires {float(left):+.1f} s from the database's now() "
                    f"(TTL {LEASE_TTL:.0f} s)"))
        time.sleep(0.25)
    return lost_at


def test_every_replica_writes_the_databases_time(cluster: tuple[Cluster, Replica]) -> None:
    replicas, leader = cluster
    wait_for(lambda: replicas.sql(
        "SELECT 1 FROM controller_leases WHERE expires_at > now()"), 30, "a leader")
    assert replicas.leader()[0] is leader
    problems: Problems = {}
    alive, dead, renewers = [], [], []
    stop = threading.Event()
    try:
        for offset, replica in zip(OFFSETS, replicas.replicas, strict=True):
            alive.append(_register(replicas, replica, f"alive-{NAMES[offset]}"))
            renewers.append(threading.Thread(target=_renew, args=(alive[-1], stop),
                                             daemon=True))
            renewers[-1].start()
            dead.append(_register(replicas, replica, f"dead-{NAMES[offset]}"))
            pod = replicas.on(replica, "POST", "/v1/pods", json={
                "name": f"pod-{NAMES[offset]}", "image": "busybox:1", "cpu": 1})
            assert pod.status_code == 201, pod.text
            off = _off_database(replicas, "SELECT extract(epoch FROM created_at - now()) "
                                "FROM pods WHERE id = %s", pod.json()["id"])
            if abs(off) > SLACK:
                problems[f"pod-{NAMES[offset]}", "created"] = (
                    f"created_at {off:+.1f} s off the database's now()")
        lost_at = _watch(replicas, alive, problems)
    finally:
        stop.set()
        for renewer in renewers:
            renewer.join(timeout=10)
    for node in alive:
        if node.answers:
            problems[node.name, "renewal"] = (
                f"{len(node.answers)} renewals answered otherwise, first: "
                f"{node.answers[0]} (the slowest answered in {node.slowest:.2f} s)")
    for node in dead:
        if node.name not in lost_at:
            problems[node.name, "lost"] = f"not Lost {WATCH:.0f} s after it registered"
        elif lost_at[node.name] - node.registered < LEASE_TTL - 0.5:
            problems[node.name, "lost"] = (
                f"Lost {lost_at[node.name] - node.registered:.1f} s after it registered, "
                "before its lease lapsed")
    assert not problems, "\n".join(f"{name}: {text}"
                                    for (name, _), text in sorted(problems.items()))
