"""Usage ingest as background-priority work: a niced process of its own.

Pod creates and usage batches share the server's CPUs (and, on one host, PostgreSQL's).
A batch is deferrable (its node spools it until acknowledged), a create is not: so each
API worker hands the batches it admits (api/usage_admission.py) to an **ingest worker**,
a child process it supervises, which parses, validates and stores them. While API calls
run (the API workers' shared activity stamp) its ingest threads are at ``nice`` 19
(``GPUCLOUD_USAGE_INGEST_NICE``) within milliseconds of the first call: the kernel gives
a create's threads and its backend the CPU whenever they want it, and ingest runs on what
is left. While the API is quiet they are back at the level the worker started at (the
server's own, 0 unless it was started niced), so other work on the host does not starve
ingest. Where the host lets it (root, a writable cpu controller), the worker
is also in a cpu cgroup of its own, idle while API calls run (api/ingest_cgroup.py):
``nice`` alone holds only inside one scheduling group. A batch already running when API
calls begin pauses between its statements (``Pause``), where its PostgreSQL backend holds
no lock a create could wait for; the backends themselves keep PostgreSQL's priority
(``GPUCLOUD_USAGE_INGEST_BACKENDS=follow``: the worker's, which starved a backend inside
its statement, holding locks the creates then waited for). Nothing of a batch's parsing
competes for the API worker's GIL, and while API calls run a batch commits without
forcing a WAL flush that creates would queue behind (``CommitMode``).

The route's meaning is unchanged: the worker checks the fencing token, stores the batch
in one transaction (idempotent per sample key) and answers only after the commit, so a
200 is still durable; a worker that died or is restarting makes the batch a 503 (nothing
acknowledged; the agent resends, and a batch stored just before a crash stores nothing
twice). The server's clock travels with each batch (``now``), so the time checks are the
API worker's, manual clocks in tests included.

Wire: one socketpair per ingest slot (``slots``, the API worker's ingest threads), each
used by one request at a time: ``>QI`` (header length, body length), a JSON header
(``node_id``, ``now``), the body; the answer is ``>I`` + JSON (``out`` or ``error``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import event, text
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from gpucloud.api.errors import database_unavailable, describe_validation
from gpucloud.api.ingest_cgroup import IngestGroup, open_group
from gpucloud.core.errors import (
    Conflict,
    GpucloudError,
    InvalidInput,
    NotFound,
    StaleFencingToken,
)
from gpucloud.core.settings import Settings
from gpucloud.core.usage import AgentUsageBatchOut, AgentUsageBatchRequest
from gpucloud.db.session import Database, libpq_params
from gpucloud.services import usage
from gpucloud.services.context import ServiceContext

log = logging.getLogger(__name__)

NICE_ENV = "GPUCLOUD_USAGE_INGEST_NICE"
MODE_ENV = "GPUCLOUD_USAGE_INGEST"
CGROUP_ENV = "GPUCLOUD_USAGE_INGEST_CGROUP"
#: ``lazy`` (default): while API calls run, commits not flushed, answered once durable;
#: ``sync``: every batch's commit flushes its own WAL (bench/usage.py compares the two).
COMMIT_ENV = "GPUCLOUD_USAGE_INGEST_COMMIT"
#: ``normal`` (default): the worker's backends stay at PostgreSQL's own priority (a
#: backend starved while it holds a WAL insertion, buffer or lock-manager lock stalls the
#: creates that need it; ingest pauses between statements instead, see ``Pause``);
#: ``follow``: they take the worker's nice level and cgroup.
BACKENDS_ENV = "GPUCLOUD_USAGE_INGEST_BACKENDS"
DEFAULT_NICE = 19
#: The worker's PostgreSQL sessions, as pg_stat_activity names them.
APPLICATION_NAME = "gpucloud-usage-ingest"
#: The API workers' shared activity stamp, and their quiet gap (set for the worker).
ACTIVITY_ENV = "GPUCLOUD_USAGE_ACTIVITY"
QUIET_ENV = "GPUCLOUD_USAGE_QUIET_SECONDS"
#: The admission's deferral (api/usage_admission.py): a batch pauses between its
#: statements while a stretch of API calls is younger than this.
DEFER_ENV = "GPUCLOUD_USAGE_DEFER_SECONDS"
#: ``on`` (default): running batches pause between statements while API calls run
#: (``Pause``); ``off``: a batch runs to its end in one INSERT (bench/usage.py compares).
PAUSE_ENV = "GPUCLOUD_USAGE_INGEST_PAUSE"
_PAUSE_POLL_SECONDS = 0.005
#: A batch committed while busy waits this long for the WAL writer's flush at most.
FLUSH_WAIT_SECONDS = 0.25
_FLUSH_POLL_SECONDS = 0.01
_FLUSHED = text("SELECT pg_current_wal_flush_lsn() >= CAST(:lsn AS pg_lsn)")
_REQUEST = struct.Struct(">QI")
_ANSWER = struct.Struct(">I")
_ERRORS: dict[str, type[GpucloudError]] = {
    cls.__name__: cls for cls in (Conflict, StaleFencingToken, NotFound)}


#: The worker's error kind for "the database cannot be reached now" (api/errors.py).
DATABASE_UNAVAILABLE = "database-unavailable"


class IngestUnavailable(Exception):
    """The ingest worker is not running (starting, crashed): answer 503, nothing stored."""


# -- the API worker's side --------------------------------------------------------------


def use_process(database_url: str) -> bool:
    """``GPUCLOUD_USAGE_INGEST``: ``process`` (the niced worker), ``thread`` (in the API
    worker, as before), ``auto`` (default: the worker on PostgreSQL; on SQLite, whose
    writers serialize on one file lock anyway, threads)."""
    mode = os.environ.get(MODE_ENV, "auto").strip().lower()
    if mode not in ("auto", "process", "thread"):
        log.warning("%s=%r is not auto, process or thread; using auto", MODE_ENV, mode)
        mode = "auto"
    if mode == "auto":
        return not database_url.startswith("sqlite")
    return mode == "process"


def nice_from_env() -> int:
    value = os.environ.get(NICE_ENV, str(DEFAULT_NICE))
    try:
        nice = int(value)
    except ValueError:
        nice = -100
    if not 0 <= nice <= 19:
        log.warning("%s=%r is not 0..19; using %d", NICE_ENV, value, DEFAULT_NICE)
        return DEFAULT_NICE
    return nice


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    free: queue.SimpleQueue[socket.socket]
    sockets: list[socket.socket]
    broken: bool = False


class IngestWorker:
    """The supervised ingest process of one API worker; ``ingest`` is called from the
    API worker's ingest threads (at most ``slots`` at once), never its event loop."""

    def __init__(self, database_url: str, slots: int = 2, nice: int | None = None,
                 activity: Path | None = None, quiet_seconds: float = 0.5,
                 defer_seconds: float = 10.0) -> None:
        self.database_url = database_url
        self.activity, self.quiet_seconds = activity, quiet_seconds
        self.defer_seconds = defer_seconds
        self.slots = slots
        self.nice = nice_from_env() if nice is None else nice
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _running(self) -> _Child:
        with self._lock:
            child = self._child
            if child is not None and not child.broken and child.process.poll() is None:
                return child
            if child is not None:
                self.restarts += 1
                child.process.kill()
                _close(child)
                log.warning("usage ingest worker exited (%s); started another",
                            child.process.returncode)
            self._child = child = self._spawn()
            return child

    def _spawn(self) -> _Child:
        pairs = [socket.socketpair() for _ in range(self.slots)]
        ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
        fds = [s.fileno() for s in theirs]
        env = {**os.environ, "GPUCLOUD_DATABASE_URL": self.database_url,
               NICE_ENV: str(self.nice), QUIET_ENV: str(self.quiet_seconds),
               DEFER_ENV: str(self.defer_seconds)}
        if self.activity is not None:
            env[ACTIVITY_ENV] = str(self.activity)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "gpucloud.api.usage_worker",
                 ",".join(map(str, fds))], env=env, pass_fds=fds, stdin=subprocess.DEVNULL,
                close_fds=True)
        finally:
            for sock in theirs:
                sock.close()
        free: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        for sock in ours:
            free.put(sock)
        return _Child(process, free, ours)

    def ingest(self, node_id: str, body: bytes, now: datetime) -> AgentUsageBatchOut:
        """Store a batch through the worker; raises its GpucloudError (409, 422) as the
        in-process path would, or IngestUnavailable (503)."""
        child = self._running()
        sock = child.free.get()
        try:
            header = json.dumps({"node_id": node_id, "now": now.isoformat()}).encode()
            sock.sendall(_REQUEST.pack(len(header), len(body)) + header + body)
            answer = json.loads(_read(sock, _ANSWER.unpack(_read(sock, _ANSWER.size))[0]))
        except (OSError, EOFError) as error:
            child.broken = True  # the next call starts another worker
            child.process.kill()
            raise IngestUnavailable(f"usage ingest worker: {error}") from None
        child.free.put(sock)
        if "out" in answer:
            return AgentUsageBatchOut.model_validate(answer["out"])
        raise _error(answer["error"])

    def pid(self) -> int | None:
        """The running worker's pid (None: none started, or it exited)."""
        child = self._child
        return child.process.pid if child and child.process.poll() is None else None

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                _close(self._child)
                self._child = None


def _close(child: _Child) -> None:
    for sock in child.sockets:
        sock.close()  # the worker's threads read EOF and it exits
    try:
        child.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait()


def _error(payload: dict[str, Any]) -> Exception:
    kind, message = payload["kind"], payload["message"]
    if kind == "InvalidInput":
        error = InvalidInput(payload["field"], message)
        error.message = message
        return error
    if kind in _ERRORS:
        return _ERRORS[kind](message)
    if kind == DATABASE_UNAVAILABLE:  # the API's database handler answers 503 + Retry-After
        return OperationalError("usage ingest worker", None, ConnectionError(message))
    return RuntimeError(f"usage ingest worker: {message}")


def _read(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def parse_and_ingest(ctx: ServiceContext, node_id: str, body: bytes,
                     before_commit: Callable[[Session], None] | None = None,
                     between: Callable[[], None] | None = None) -> AgentUsageBatchOut:
    """Pydantic straight from the bytes, then store. The models bound every integer to
    BIGINT and every float to finite values, and ``usage.ingest`` refuses NUL in strings:
    what api/limits.py's generic walk (half the CPU of a batch) would check.
    ``between``: see ``usage.ingest`` (the worker's ``Pause``)."""
    try:
        batch = AgentUsageBatchRequest.model_validate_json(body)
    except ValidationError as error:
        raise _invalid(*describe_validation(error.errors())) from None
    return usage.ingest(ctx, node_id, batch, before_commit, between)


def _invalid(field: str, detail: str) -> InvalidInput:
    """The same 422 as FastAPI's own validation gives (``detail`` already names the field)."""
    error = InvalidInput(field, detail)
    error.message = detail
    return error


# -- the worker process ----------------------------------------------------------------


class _At:
    """The API worker's clock reading for one batch."""

    def __init__(self, now: datetime) -> None:
        self._now = now

    def now(self) -> datetime:
        return self._now


class Priority:
    """The nice level of the worker's ingest threads and of its PostgreSQL backends:
    ``nice`` while API calls run, ``base`` while the API is quiet (then there is nothing
    to yield to, and other work on the host should not starve ingest). ``base`` is the
    level the worker inherited from its server (0 unless that was started niced, as
    under ``nice -n 10 pytest``): quiet ingest never runs ahead of the API workers
    themselves, nor does busy ingest go below ``base``. Going back down to ``base``
    needs CAP_SYS_NICE (root has it); without it the level stays at ``nice`` for good.
    Raising another user's process's nice value (the backends) needs it too.

    ``group`` (api/ingest_cgroup.py), where there is one, holds the worker process and
    its backends and is idle whenever the level is ``nice``: that holds against API work
    in other scheduling groups too (PostgreSQL's), which ``nice`` does not."""

    def __init__(self, nice: int, group: IngestGroup | None = None) -> None:
        self.base = os.getpriority(os.PRIO_PROCESS, 0)
        self.nice = max(nice, self.base)
        self.level = self.base
        self.sticky = False
        self.group = group
        self._lock = threading.Lock()
        self._tasks: set[int] = set()  # thread ids and backend pids

    def add(self, task: int) -> None:
        with self._lock:
            self._tasks.add(task)
            self._set(task, self.level)

    def add_backend(self, pid: int) -> None:
        """A PostgreSQL backend of the worker's: its nice level, and the group."""
        if self.group is not None:
            self.group.join(pid)
        self.add(pid)

    def set(self, busy: bool) -> None:
        level = self.nice if busy or self.sticky else self.base
        with self._lock:
            if level == self.level:
                return
            self.level = level
            if self.group is not None:
                self.group.set_busy(level > self.base)
            for task in list(self._tasks):
                self._set(task, level)

    def _set(self, task: int, level: int) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, task, level)
        except ProcessLookupError:
            self._tasks.discard(task)  # a closed connection's backend, an ended thread
        except PermissionError as error:
            if not self.sticky:
                log.warning("cannot set nice %d on %d (%s): ingest stays at nice %d",
                            level, task, error, self.nice)
            self.sticky = True
            self.level = self.nice
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, task, self.nice)


def follow_api(priority: Priority, mode: CommitMode, every: float = 0.005) -> None:
    """Forever: the ingest priority follows the API activity (a thread at nice 0, so
    a burst of creates cannot starve the thread that lowers ingest for it; out of the
    ingest cgroup where the kernel allows, for the same reason)."""
    if priority.group is not None:
        priority.group.leave(threading.get_native_id())
    while True:
        priority.set(mode.busy())
        time.sleep(every)


def renice_backends(engine: Any, database_url: str, priority: Priority) -> bool:
    """Give each new connection's PostgreSQL backend to ``priority`` (False: not
    possible here: a remote server, or SQLite)."""
    if not database_url.startswith("postgresql"):
        return False
    hosts = str(libpq_params(database_url).get("host") or "").split(",")  # all (failover)
    if not all(host in ("", "localhost", "127.0.0.1", "::1") or host.startswith("/")
               for host in hosts):
        return False
    follow = os.environ.get(BACKENDS_ENV, "normal").strip().lower() == "follow"

    @event.listens_for(engine, "connect")
    def _renice(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"SET application_name = '{APPLICATION_NAME}'")  # pg_stat_activity
        cursor.execute("SELECT pg_backend_pid()")
        pid = int(cursor.fetchone()[0])
        cursor.close()
        dbapi_connection.commit()
        try:
            local = "postgres" in Path(f"/proc/{pid}/comm").read_text()  # that server's
        except OSError:
            local = False
        if local and follow:
            priority.add_backend(pid)

    return True


def _serve(sock: socket.socket, handle: Callable[[dict[str, Any], bytes], dict[str, Any]],
           priority: Priority) -> None:
    """One slot: requests one at a time until the API worker closes it."""
    priority.add(threading.get_native_id())
    with sock:
        while True:
            try:
                head_size, body_size = _REQUEST.unpack(_read(sock, _REQUEST.size))
                header = json.loads(_read(sock, head_size))
                body = _read(sock, body_size)
            except (EOFError, OSError):
                return
            answer = json.dumps(handle(header, body)).encode()
            try:
                sock.sendall(_ANSWER.pack(len(answer)) + answer)
            except OSError:
                return


class CommitMode:
    """While API calls run (the API workers' shared stamp, api/usage_admission.py), a
    batch commits without waiting for its WAL to be flushed, so a pod create's commit never
    queues behind ingest's fsync (PostgreSQL flushes WAL in order under one lock: a create
    whose commit follows an ingest commit waits for both flushes); the batch is answered
    only once the flush has passed its commit (the WAL writer's or a create's flush, else
    after FLUSH_WAIT_SECONDS one of its own). Quiet: ordinary synchronous commits."""

    def __init__(self, db: Database, stamp: Path | None, quiet_seconds: float,
                 lazy: bool = True) -> None:
        self.db, self.quiet_seconds, self.lazy = db, quiet_seconds, lazy
        self._stamp = _open_stamp(stamp) if stamp is not None else None

    def follows_api(self) -> bool:
        return self._stamp is not None

    def busy(self) -> bool:
        if self._stamp is None:
            return False
        last = struct.unpack_from("d", self._stamp, 0)[0]
        return bool(time.monotonic() - last < self.quiet_seconds)

    def before_commit(self, deferred: list[bool]) -> Callable[[Session], None]:
        def decide(session: Session) -> None:
            if self.lazy and not self.db.is_sqlite and self.busy():
                session.execute(text("SET LOCAL synchronous_commit = off"))
                deferred.append(True)
        return decide

    def wait_flushed(self) -> None:
        """Until the WAL is durable past this thread's last commit."""
        with self.db.engine.connect() as connection:
            auto = connection.execution_options(isolation_level="AUTOCOMMIT")
            target = auto.execute(text("SELECT pg_current_wal_insert_lsn()")).scalar_one()
            deadline = time.monotonic() + FLUSH_WAIT_SECONDS
            while time.monotonic() < deadline:
                if auto.execute(_FLUSHED, {"lsn": str(target)}).scalar_one():
                    return
                time.sleep(_FLUSH_POLL_SECONDS)
        with self.db.engine.begin() as transaction:
            # a record and commit of our own, flushed synchronously (a transaction that
            # wrote no WAL would not flush): all WAL before it is then durable too
            transaction.execute(text("SET LOCAL synchronous_commit = on"))
            transaction.execute(text(
                "SELECT pg_logical_emit_message(true, 'gpucloud-usage', '')"))


class Pause:
    """Between the statements of a batch (``usage.ingest``'s ``between``): wait while a
    stretch of API calls on this host is younger than ``defer_seconds``, the admission's
    deferral (api/usage_admission.py). The admission holds back the batches that wait;
    this holds the ones already running when a burst begins: they stop after their
    statement in progress (``usage.PAUSE_ROWS`` samples, milliseconds) and go on once
    the API is quiet, or once the stretch is ``defer_seconds`` old (then the admission's
    pacing takes over: a batch is never held longer, so ingest keeps its progress).
    Paused, the batch's backend is idle in its transaction and holds no lightweight lock
    (WAL insertion, buffer, lock manager) that a create's backend would wait for; what it
    has inserted so far stays uncommitted, so the batch is still all or nothing."""

    def __init__(self, stamp: Path | None, quiet_seconds: float, defer_seconds: float,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.quiet_seconds, self.defer_seconds = quiet_seconds, defer_seconds
        self.clock, self.sleep = clock, sleep
        self._stamp = _open_stamp(stamp) if stamp is not None else None
        self.paused = 0.0  # seconds spent paused, all batches

    def held(self) -> bool:
        """Whether a running batch waits now (an API stretch younger than the deferral)."""
        if self._stamp is None:
            return False
        last, since = struct.unpack_from("dd", self._stamp, 0)
        now = self.clock()
        return bool(now - last < self.quiet_seconds and now - since < self.defer_seconds)

    def __call__(self) -> None:
        began = self.clock()
        while self.held():
            self.sleep(_PAUSE_POLL_SECONDS)
        self.paused += self.clock() - began


def pause_from_env() -> bool:
    """``GPUCLOUD_USAGE_INGEST_PAUSE``: ``on`` (default) or ``off``."""
    value = os.environ.get(PAUSE_ENV, "on").strip().lower()
    if value not in ("on", "off"):
        log.warning("%s=%r is not on or off; using on", PAUSE_ENV, value)
    return value != "off"


def lazy_from_env() -> bool:
    """``GPUCLOUD_USAGE_INGEST_COMMIT``: ``lazy`` (default) or ``sync``."""
    value = os.environ.get(COMMIT_ENV, "lazy").strip().lower()
    if value not in ("lazy", "sync"):
        log.warning("%s=%r is not lazy or sync; using lazy", COMMIT_ENV, value)
    return value != "sync"


def _open_stamp(path: Path) -> mmap.mmap | None:
    try:
        with path.open("rb") as file:
            return mmap.mmap(file.fileno(), 16, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


def _handler(db: Database, database_url: str, priority: Priority
             ) -> Callable[[dict[str, Any], bytes], dict[str, Any]]:
    renice_backends(db.engine, database_url, priority)
    settings = Settings.from_env()
    stamp = os.environ.get(ACTIVITY_ENV)
    quiet = float(os.environ.get(QUIET_ENV, "0.5"))
    mode = CommitMode(db, Path(stamp) if stamp else None, quiet, lazy_from_env())
    pause = Pause(Path(stamp) if stamp else None, quiet,
                  float(os.environ.get(DEFER_ENV, "10")))
    between = pause if pause_from_env() else None
    if mode.follows_api():
        threading.Thread(target=follow_api, args=(priority, mode), daemon=True).start()
    else:  # no stamp to follow: background priority for good
        priority.sticky = True
        priority.set(True)

    def handle(header: dict[str, Any], body: bytes) -> dict[str, Any]:
        ctx = ServiceContext(db=db, clock=_At(datetime.fromisoformat(header["now"])),
                             settings=settings)
        deferred: list[bool] = []
        try:
            out = parse_and_ingest(ctx, str(header["node_id"]), body,
                                   mode.before_commit(deferred), between)
            if deferred:
                mode.wait_flushed()
        except InvalidInput as error:
            return {"error": {"kind": "InvalidInput", "field": error.field,
                              "message": error.message}}
        except GpucloudError as error:
            return {"error": {"kind": type(error).__name__, "message": error.message}}
        except SQLAlchemyError as error:
            if not database_unavailable(error):
                log.exception("usage batch failed")
                return {"error": {"kind": "internal", "message": repr(error)}}
            log.warning("usage batch: the database is unavailable: %s", error)
            return {"error": {"kind": DATABASE_UNAVAILABLE, "message": str(error)}}
        except Exception as error:  # a 500 in the API worker, logged here
            log.exception("usage batch failed")
            return {"error": {"kind": "internal", "message": repr(error)}}
        return {"out": out.model_dump()}

    return handle


def _group() -> IngestGroup | None:
    """This process in its ingest cgroup (None: not possible here, or
    ``GPUCLOUD_USAGE_INGEST_CGROUP=off``; nice alone)."""
    setting = os.environ.get(CGROUP_ENV, "auto").strip().lower()
    if setting not in ("auto", "off"):
        log.warning("%s=%r is not auto or off; using auto", CGROUP_ENV, setting)
    if setting == "off":
        return None
    group = open_group(os.getpid())
    if group is not None and not group.join(os.getpid()):
        group.close(os.getpid())
        return None
    return group


def main(fds: str) -> None:
    database_url = os.environ["GPUCLOUD_DATABASE_URL"]
    priority = Priority(nice_from_env(), _group())
    db = Database(database_url)
    try:
        handle = _handler(db, database_url, priority)
        threads = [threading.Thread(target=_serve, args=(socket.socket(fileno=int(fd)),
                                                         handle, priority))
                   for fd in fds.split(",")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        db.dispose()  # the backends end, so that the group can go
        if priority.group is not None:
            priority.group.close(os.getpid())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main(sys.argv[1])
