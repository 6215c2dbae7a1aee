"""The agent's supervision of the node's lazyfs daemon (images/lazy/mounter.py): a pod's
watch asks for its events every period, and a daemon found dead under pods that hold lazy
mounts is started again, re-mounting their layers for new pods, and every holder is told
that its overlay still sits on the dead mount. Real registry, real daemon, real FUSE.

Needs root, /dev/fuse and libfuse3 (Debian fuse3); the registry is Debian's docker-registry.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpucloud.images.client import RegistryClient
from gpucloud.images.lazy.client import LazyfsClient
from gpucloud.images.lazy.mounter import RESTARTED_MESSAGE, LazyMounter, node_lazyfs
from gpucloud.images.store import BlobStore
from tests.fixtures.registry import Registry, start_registry
from tests.integration.images.lazy_testing import estargz_image
from tests.integration.runtime.runc_testing import wait_until

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                                reason="needs root and /dev/fuse")

FILES: dict[str, bytes | str | object] = {
    "etc/hello.txt": "hello from a lazy layer\n",
    "opt/tool.bin": os.urandom(200 << 10),
}


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    with start_registry(tmp_path / "registry") as running:
        yield running


def _node(tmp_path: Path, registry: Registry, repository: str
          ) -> tuple[tuple[Any, str], LazyfsClient, LazyMounter]:
    """An eStargz image of ``FILES`` pushed as ``repository``, and a node's lazyfs client
    and the agent's mounter over it: ((the image's one layer, its TOC digest), client,
    mounter)."""
    lazy = estargz_image([FILES], tmp_path)
    lazy.image.push(registry.host, f"{repository}:v1")
    state = tmp_path / "state"
    client = LazyfsClient(state, cache_limit=64 << 20, read_deadline=2.0)
    mounter = LazyMounter(client, RegistryClient(insecure=()), BlobStore(state / "images"),
                          {}, ())
    return (lazy.image.layers[0], lazy.toc_digests[0]), client, mounter


def test_a_dead_daemon_is_started_again_and_its_pods_are_told(registry: Registry,
                                                               tmp_path: Path) -> None:
    (layer, toc_digest), client, mounter = _node(tmp_path, registry, "lazy-supervised")
    pods = [tmp_path / "containers" / name for name in ("pod-a", "pod-b")]
    try:
        for pod in pods:  # as ``LazyMounter.mount`` does for each pod's layer
            mnt = client.mount(digest=layer.digest, registry=registry.host,
                               repository="lazy-supervised", size=len(layer.data),
                               toc_digest=toc_digest, holder=str(pod))
        assert (mnt / "etc/hello.txt").read_text() == "hello from a lazy layer\n"
        assert mounter.take_events(pods[0]) == []  # alive: nothing to say
        old = client.pid()

        os.kill(old, signal.SIGKILL)
        wait_until(lambda: not client.running(), what="the daemon's death")
        with pytest.raises(OSError) as dead:
            os.listdir(mnt / "opt")  # not in the kernel's cache: needs the dead daemon
        assert dead.value.errno == errno.ENOTCONN

        # pod-a's next watch finds the daemon dead: started again, both pods told once
        assert mounter.take_events(pods[0]) == [("LazyfsRestarted", RESTARTED_MESSAGE)]
        assert client.running() and client.pid() != old
        assert client.status()["layers"][layer.digest]["holders"] == [str(p) for p in pods]
        assert mounter.take_events(pods[1]) == [("LazyfsRestarted", RESTARTED_MESSAGE)]
        assert mounter.take_events(pods[0]) == []
        # new pods get the new mount, at the same path
        assert (mnt / "opt/tool.bin").read_bytes() == FILES["opt/tool.bin"]
    finally:
        client.shutdown()


def test_a_dead_daemon_is_left_alone_when_no_pod_holds_a_lazy_mount(registry: Registry,
                                                                   tmp_path: Path) -> None:
    (layer, toc_digest), client, mounter = _node(tmp_path, registry, "lazy-unheld")
    pod = tmp_path / "containers" / "pod-a"
    try:
        client.mount(digest=layer.digest, registry=registry.host, repository="lazy-unheld",
                     size=len(layer.data), toc_digest=toc_digest, holder=str(pod))
        client.release(str(pod))
        os.kill(client.pid(), signal.SIGKILL)
        wait_until(lambda: not client.running(), what="the daemon's death")
        other = tmp_path / "containers" / "pod-b"  # a pod of fully pulled layers
        assert mounter.take_events(pod) == [] and mounter.take_events(other) == []
        assert not client.running()
    finally:
        client.shutdown()


def test_a_pod_released_while_the_daemon_is_down_is_not_mounted_again(
        registry: Registry, tmp_path: Path) -> None:
    (layer, toc_digest), client, mounter = _node(tmp_path, registry, "lazy-released")
    pod = tmp_path / "containers" / "pod-a"
    try:
        mnt = client.mount(digest=layer.digest, registry=registry.host,
                           repository="lazy-released", size=len(layer.data),
                           toc_digest=toc_digest, holder=str(pod))
        os.kill(client.pid(), signal.SIGKILL)
        wait_until(lambda: not client.running(), what="the daemon's death")
        mounter.release(pod)  # the pod was removed meanwhile
        assert str(pod) not in client.holders()
        assert layer.digest not in client.status()["layers"]
        assert not os.path.ismount(mnt)
    finally:
        client.shutdown()


def test_the_agents_lazyfs_settings_reach_the_daemon_it_starts(tmp_path: Path) -> None:
    """``gpucloud agent --lazy-cache-gib/--lazy-read-deadline`` (AgentConfig) go to the
    daemon the node's client starts."""
    client = node_lazyfs(tmp_path / "state", cache_limit=5 << 20, read_deadline=7.5)
    assert client is not None
    try:
        client.ensure_running()
        argv = Path(f"/proc/{client.pid()}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--cache-limit") + 1] == str(5 << 20).encode()
        assert argv[argv.index(b"--read-deadline") + 1] == b"7.5"
    finally:
        client.shutdown()
