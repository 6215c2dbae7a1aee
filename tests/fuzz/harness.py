"""Schemathesis against a live gpucloud server: the target, the run, and its tally.

The server is the real app under uvicorn on a loopback port (``tests.fixtures.server``),
with its controllers running, on SQLite or PostgreSQL. The fuzzer reads the server's own
``/openapi.json`` and authenticates through the document's security schemes: ``ApiKey``
(an admin key, or a project key) and ``NodeToken`` (a node registered here), so every
route, the agent protocol included, is reached with credentials that work. The node's lease
is kept alive through the run (``LeaseKeeper``), so the agent routes meet a live node, not a
lost one, after the lease's TTL.

Used by ``tests/fuzz/test_schemathesis.py`` (fixed seeds, bounded examples) and by
``bench/fuzz.py`` (a longer random run).

A run is CPU-bound in one process: the fuzzer's case generation (about four fifths of the
time) and the server share one interpreter, and nothing in it waits. ``run_keys_at_once``
therefore gives each key a process, server and database of its own, at a lower CPU priority:
the runs use cores that the rest of ``make test`` (mostly waiting on agents, leases and
containers) leaves idle, and yield them to it when it needs them.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import traceback
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from schemathesis.engine import Status, events

from gpucloud.client.sdk import AgentClient, GpucloudClient
from gpucloud.core.errors import Conflict, GpucloudError
from gpucloud.core.settings import Settings
from tests.fixtures.server import live_server

ADMIN_KEY = "gpc_fuzz-admin-key-0123456789"
ALL_PHASES = ("examples", "coverage", "fuzzing", "stateful")
#: The keys a run authenticates with (``Target.key``).
WHO = ("admin", "project")
#: The CPU priority of the processes of ``run_keys_at_once`` (``nice``): below the tests
#: that run beside them, whose agents and leases keep time.
NICE = 10


@dataclass(frozen=True)
class Target:
    """A running server and the credentials the fuzzer uses on it."""

    url: str
    admin_key: str
    project_key: str
    node_token: str
    #: what renews the node's lease meanwhile, and what it was answered
    lease: LeaseKeeper

    def key(self, who: str) -> str:
        """The API key of ``who``: ``admin`` or ``project``."""
        return {"admin": self.admin_key, "project": self.project_key}[who]


@contextmanager
def live_target(home: Path, database_url: str) -> Iterator[Target]:
    """A server with an admin key, a second project's key and a registered node."""
    # The fuzzer fails authentication on purpose thousands of times a run, from one
    # address: with the production burst, every request after the first few would be a
    # 429 (documented, but it would test nothing else).
    settings = Settings(home=home, database_url=database_url, admin_key=ADMIN_KEY,
                        lease_ttl_seconds=30.0, auth_failure_burst=10**9,
                        auth_failures_per_minute=10.0**9,
                        # long polls answer within the fuzzer's request timeout
                        serverless_long_poll_seconds=1.0,
                        serverless_runsync_max_wait_seconds=1.0, log_wait_max_seconds=1.0)
    with live_server(settings) as url:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=url, headers=admin, timeout=30) as client:
            project = client.post("/v1/projects", json={"name": "fuzz"})
            project.raise_for_status()
            join = client.post("/v1/nodes/join-tokens")
            join.raise_for_status()
            node = client.post("/v1/agent/register", json={
                "join_token": join.json()["token"], "name": "fuzz-node", "cpu_cores": 16,
                "memory_bytes": 64 * 1024**3, "gpus": []})
            node.raise_for_status()
            grant = node.json()
            keeping = LeaseKeeper.running(url, grant["node_token"], grant["fencing_token"],
                                          grant["lease_ttl_seconds"])
            with keeping as keeper:
                # The document is built on first use (seconds of CPU at NICE, on a busy
                # machine): built here, schemathesis' loader (10 s timeout) reads a cached
                # one.
                client.get("/openapi.json", timeout=300).raise_for_status()
                yield Target(url, ADMIN_KEY, project.json()["key"]["key"],
                             grant["node_token"], keeper)


class LeaseKeeper:
    """Renews the fuzz node's lease as its agent would (``POST /v1/agent/lease`` with the
    node token, every third of the TTL the server grants), so that the node stays Ready
    while the fuzzer works on the agent routes.

    The fuzzer renews too, with fencing tokens of its own (``null`` takes a new grant, the
    keeper's token then is stale: a 409, answered by asking for a new grant as an agent
    does) and it may cordon or drain the node; whatever the keeper is answered is counted in
    ``answers`` and it goes on: it never fails the run. ``lapses`` counts the renewals that
    found the lease lapsed (a new grant for the current token): the node was Lost."""

    def __init__(self, url: str, node_token: str, fencing_token: int, ttl: float) -> None:
        self._client = AgentClient(url, node_token, timeout=ttl)
        self._ttl = ttl
        self._fencing: int | None = fencing_token
        self._stop = threading.Event()
        self.answers: Counter[str] = Counter()
        self.lapses = 0

    @classmethod
    @contextmanager
    def running(cls, url: str, node_token: str, fencing_token: int,
                ttl: float) -> Iterator[LeaseKeeper]:
        """A keeper of the grant ``fencing_token``, renewing on a thread of its own until
        the block ends."""
        keeper = cls(url, node_token, fencing_token, ttl)
        thread = threading.Thread(target=keeper._run, name="fuzz-lease", daemon=True)
        thread.start()
        try:
            yield keeper
        finally:
            keeper._stop.set()
            thread.join(timeout=keeper._ttl + 5)
            keeper._client.close()

    def summary(self) -> str:
        answers = ", ".join(f"{key} {count}" for key, count in sorted(self.answers.items()))
        return f"lease renewals: {answers or 'none'}; lapses {self.lapses}"

    def _run(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            self.renew()

    def renew(self) -> None:
        """One renewal through the agent's own client (a new grant after a 409: the fuzzer
        took one); never raises."""
        sent = self._fencing
        try:
            try:
                grant = self._client.lease(sent)
            except Conflict:  # stale (the fuzzer took a grant): a new one
                self.answers["409"] += 1
                sent = None
                grant = self._client.lease(None)
        except GpucloudError as error:
            status = getattr(error, "status", None)
            self.answers[str(status) if status else type(error).__name__] += 1
            return
        self.answers["200 new grant" if grant.new_grant else "200"] += 1
        if grant.new_grant and sent is not None:
            self.lapses += 1
        self._fencing = grant.fencing_token
        self._ttl = grant.lease_ttl_seconds


@dataclass
class Report:
    """What a run found: counts, and one line per unique failure."""

    operations: int = 0
    cases: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: the fuzz node at the end of the run (``status``, cordoned or not) and its lease's
    #: renewals (``LeaseKeeper``)
    node: str = ""
    lease: str = ""
    lease_lapses: int = 0
    _seen: set[tuple[str, str, str]] = field(default_factory=set)

    def add_failure(self, check: str, label: str, title: str, sample: str) -> None:
        key = (check, label, title)
        if key in self._seen:
            return
        self._seen.add(key)
        self.failures[check] += 1
        self.details.append(f"{check} {label}: {title}\n    {sample[:600]}")

    def summary(self) -> str:
        checks = ", ".join(f"{name} {count}" for name, count in sorted(self.failures.items()))
        return (f"{self.operations} operations, {self.cases} test cases, "
                f"{sum(self.failures.values())} unique failures ({checks or 'none'}), "
                f"{len(self.errors)} errors")


#: What counts as refusing invalid data: schemathesis' default set, plus 413.
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428",
              "429", "5XX"]


def config(target: Target, key: str, *, seed: int | None, max_examples: int,
           phases: tuple[str, ...] = ALL_PHASES, workers: int = 2,
           max_time: int | None = None) -> schemathesis.Config:
    """All checks, the given phases, the target's credentials by security scheme."""
    data: dict[str, Any] = {
        "workers": workers,
        # A body past the size limit is refused with 413 before it is validated.
        "checks": {"enabled": True,
                   "negative_data_rejection": {"expected-statuses": REJECTIONS}},
        "generation": {"max-examples": max_examples},
        "phases": {name: {"enabled": name in phases} for name in ALL_PHASES},
        "auth": {"openapi": {"ApiKey": {"bearer": key},
                             "NodeToken": {"bearer": target.node_token}}},
        "request-timeout": 30,
        "warnings": False,
    }
    if seed is not None:
        data["seed"] = seed
        data["generation"]["deterministic"] = True
    if max_time is not None:
        data["max-time"] = max_time
    return schemathesis.Config.from_dict(data)


def run(target: Target, settings: schemathesis.Config) -> Report:
    """Run every enabled phase against the target; tally cases and failures by check."""
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json", config=settings)
    report = Report(operations=schema.statistic.operations.selected)
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            _tally(report, event)
        elif isinstance(event, events.NonFatalError | events.FatalError):
            report.errors.append(_error_line(event))
    return report


def fuzz_as(who: str, home: Path, database_url: str, *, seed: int | None,
            max_examples: int) -> Report:
    """One key's run (every phase) on a server of its own, on ``database_url``."""
    with live_target(home, database_url) as target:
        report = run(target, config(target, target.key(who), seed=seed,
                                    max_examples=max_examples))
        report.node = _node_state(target)
        report.lease, report.lease_lapses = target.lease.summary(), target.lease.lapses
        return report


def _node_state(target: Target) -> str:
    """The fuzz node's status now, as the admin reads it (``Ready``, ``Lost``...)."""
    client = GpucloudClient(target.url, target.admin_key)
    try:
        node = client.get_node("fuzz-node")
    except GpucloudError as error:
        return f"unreadable ({error})"
    finally:
        client.close()
    return str(node.status) + (", cordoned" if node.cordoned else "")


def run_keys_at_once(jobs: Mapping[str, tuple[Path, str]], *, seed: int | None,
                     max_examples: int) -> dict[str, Report]:
    """``fuzz_as`` for each key of ``jobs`` (key → home, database URL), each in a process of
    its own at ``NICE``, all at once; their reports by key. A process that ends without a
    report (killed, crashed) fails the run with its exit code."""
    context = multiprocessing.get_context("spawn")  # the caller's threads stay behind
    started = []
    for who, (home, url) in jobs.items():
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_fuzz_in_child, name=f"fuzz-{who}",
                                  args=(sender, who, home, url, seed, max_examples))
        process.start()
        sender.close()
        started.append((who, process, receiver))
    reports: dict[str, Report] = {}
    try:
        for who, process, receiver in started:
            try:
                outcome, value = receiver.recv()
            except EOFError:
                process.join()
                raise RuntimeError(f"the {who} run ended without a report "
                                   f"(exit code {process.exitcode})") from None
            if outcome != "report":
                raise RuntimeError(f"the {who} run failed:\n{value}")
            reports[who] = value
    finally:
        for _, process, receiver in started:
            if process.is_alive() and len(reports) < len(started):
                process.kill()
            process.join()
            receiver.close()
    return reports


def _fuzz_in_child(sender: Connection, who: str, home: Path, database_url: str,
                   seed: int | None, max_examples: int) -> None:
    os.nice(NICE)
    try:
        report = fuzz_as(who, home, database_url, seed=seed, max_examples=max_examples)
    except BaseException:
        sender.send(("error", traceback.format_exc()))
        raise
    sender.send(("report", report))
    sender.close()


def _tally(report: Report, event: events.ScenarioFinished) -> None:
    recorder = event.recorder
    report.cases += len(recorder.cases)
    for checks in recorder.checks.values():
        for check in checks:
            if check.status == Status.FAILURE and check.failure_info is not None:
                info = check.failure_info
                report.add_failure(check.name, recorder.label, info.failure.title,
                                   f"{info.failure.message}\n    {info.code_sample}")


def _error_line(event: events.NonFatalError | events.FatalError) -> str:
    if isinstance(event, events.NonFatalError):
        return f"{event.label}: {event.info.title}: {event.value!r}"[:800]
    return f"fatal: {event.exception!r}"[:800]
