"""Where a container's files live under the agent's state directory.

    <state>/runc/                   runc --root (container state, private to this agent)
    <state>/containers/<id>/        one directory per container (one pod attempt)
        config.json                 the OCI runtime config; this directory is the bundle
        meta.json                   labels the agent attached (pod id, attempt …)
        container.log               the container's stdout and stderr
        run/gpus.json               bind-mounted read-only at /run/gpucloud in the container
        etc/hosts, etc/hostname, etc/resolv.conf    bind-mounted into /etc
        supervisor.pid              the supervisor process, written by itself
        supervisor.log              the supervisor's own diagnostics
        runc.log                    runc's JSON log (errors of create/start/delete)
        start.release               created by the agent to start a gated container
        started.json                written once the container's process runs
        stop.json                   a stop request (grace period), read by the supervisor
        exit.json                   the exit record, written once by the supervisor

Only the standard library is imported here: the supervisor uses this module.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class ContainerPaths:
    root: Path

    @property
    def container_id(self) -> str:
        return self.root.name

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def meta(self) -> Path:
        return self.root / "meta.json"

    @property
    def log(self) -> Path:
        return self.root / "container.log"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def gpus_json(self) -> Path:
        return self.run_dir / "gpus.json"

    @property
    def etc_dir(self) -> Path:
        return self.root / "etc"

    @property
    def supervisor_pid(self) -> Path:
        return self.root / "supervisor.pid"

    @property
    def supervisor_log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def runc_log(self) -> Path:
        return self.root / "runc.log"

    @property
    def start_release(self) -> Path:
        """Its appearance lets a gated supervisor ``runc start`` (the job start barrier)."""
        return self.root / "start.release"

    @property
    def started(self) -> Path:
        return self.root / "started.json"

    @property
    def stop_request(self) -> Path:
        return self.root / "stop.json"

    @property
    def exit_record(self) -> Path:
        return self.root / "exit.json"

    @property
    def checkpointed(self) -> Path:
        """Written before ``runc checkpoint`` stops the container: its end is a dump."""
        return self.root / "checkpointed.json"


def write_json_atomic(path: Path, value: Any) -> None:
    """Write JSON so that readers see either nothing or the whole document."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value, indent=2) + "\n")
    temporary.replace(path)


def read_json(path: Path) -> Any:
    """The JSON document at ``path``, or None when it does not exist (yet)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
