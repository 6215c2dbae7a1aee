"""The agent's access server as the runtime tests reach it: started on 127.0.0.1:0 for one
container with a new gateway key, and the real OpenSSH client or asyncssh pointed at it
(user name = pod id, as the control plane's gateway logs in)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from gpucloud.agent.access import AccessServer, running_container
from gpucloud.runtime.driver import RuncDriver
from tests.fixtures.openssh import keygen, unpinned_options
from tests.fixtures.postgres import free_port
from tests.integration.runtime.runc_testing import wait_until


@contextmanager
def access_server(driver: RuncDriver, container_id: str,
                  tmp: Path) -> Iterator[tuple[AccessServer, Path]]:
    """A listening access server for ``container_id``'s pod and the gateway key it lets in
    (``tmp/gateway_key``); stopped afterwards."""
    server = AccessServer(driver, lambda pod_id: running_container(driver, [container_id],
                                                                   pod_id),
                          host_key_path=tmp / "access_host_key", python=sys.executable)
    key = tmp / "gateway_key"
    public = keygen(key)
    server.start()
    server.set_gateway_keys([public])
    try:
        yield server, key
    finally:
        server.stop()


@dataclass
class AccessClient:
    """A gateway's view of one pod: the access server, the gateway key, the pod id."""

    server: AccessServer
    key: Path
    pod_id: str

    @property
    def port(self) -> int:
        assert self.server.bound_port is not None
        return self.server.bound_port

    def ssh_options(self, key: Path | None = None) -> list[str]:
        return unpinned_options(key or self.key)

    @contextmanager
    def forward(self, destination: str, remote_port: int) -> Iterator[int]:
        """``ssh -N -L`` to ``destination:remote_port`` in the pod; yields the local port
        once it listens."""
        local = free_port()
        process = subprocess.Popen(
            ["ssh", *self.ssh_options(), "-p", str(self.port), "-N",
             "-o", "ExitOnForwardFailure=yes", "-L", f"{local}:{destination}:{remote_port}",
             f"{self.pod_id}@127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            def listening() -> bool:
                with socket.socket() as sock:
                    return sock.connect_ex(("127.0.0.1", local)) == 0

            wait_until(listening, timeout=15, what="ssh -L listening")
            yield local
        finally:
            process.terminate()
            process.wait(10)

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[asyncssh.SSHClientConnection]:
        """An asyncssh connection as the gateway makes it (no host key check)."""
        async with asyncssh.connect("127.0.0.1", self.port, username=self.pod_id,
                                    client_keys=[str(self.key)], known_hosts=None,
                                    config=None) as conn:
            yield conn
