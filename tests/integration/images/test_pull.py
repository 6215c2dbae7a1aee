"""Pulling from a real docker-registry on loopback, and preparing pod root filesystems."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.images import (
    Credentials,
    DigestMismatch,
    ImageError,
    ImageManager,
    ImageNotFound,
    NoMatchingPlatform,
    RegistryUnauthorized,
    RootfsMode,
)
from gpucloud.images.testing import BuiltIndex, build_image, busybox_image, make_layer, whiteout
from tests.fixtures.registry import CorruptingProxy, Registry

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chroot and overlay mounts need root")
MODES = [pytest.param(RootfsMode.OVERLAY, marks=needs_root), RootfsMode.COPY]


def repo() -> str:
    return f"test/{uuid.uuid4().hex[:12]}"


def other_arch(manager: ImageManager) -> str:
    return "arm64" if manager.platform.architecture != "arm64" else "amd64"


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[ImageManager]:
    with ImageManager(tmp_path / "state") as images:
        yield images


@needs_root
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk_size", [None, 256 * 1024])
def test_pushed_busybox_image_pulls_and_runs(
    registry: Registry, tmp_path: Path, mode: RootfsMode, chunk_size: int | None
) -> None:
    image = busybox_image(
        cmd=["cat", "/etc/motd"],
        env={"GREETING": "hi"},
        working_dir="/srv",
        extra_files={"etc/motd": "hello from the image\n", "srv/data": "x"},
    )
    name = repo()
    image.push(registry.host, f"{name}:v1", chunk_size=chunk_size)
    with ImageManager(tmp_path / "state", rootfs_mode=mode) as manager:
        pulled = manager.pull(f"{registry.host}/{name}:v1")
        assert pulled.manifest_digest == image.digest
        assert pulled.config.cmd == ("cat", "/etc/motd") and "GREETING=hi" in pulled.config.env
        rootfs = manager.prepare_rootfs(pulled, tmp_path / "bundle")
        try:
            result = subprocess.run(
                ["chroot", str(rootfs), *pulled.config.cmd],
                capture_output=True,
                text=True,
                check=True,
            )
            assert result.stdout == "hello from the image\n"
        finally:
            manager.release_rootfs(tmp_path / "bundle")
        assert not (tmp_path / "bundle" / "rootfs").exists()


@pytest.mark.parametrize("mode", MODES)
def test_cached_image_gives_pods_isolated_rootfs_quickly(
    registry: Registry, tmp_path: Path, mode: RootfsMode
) -> None:
    base = make_layer({"etc/a": "1", "etc/removed": "2", "bin/tool": "t"})
    top = make_layer({"etc/removed": whiteout(), "etc/b": "3"}, compression="zstd")
    name = repo()
    build_image([base, top], cmd=["/bin/tool"], docker=True).push(registry.host, f"{name}:1")
    with ImageManager(tmp_path / "state", rootfs_mode=mode) as manager:
        image = manager.pull(f"{registry.host}/{name}:1")
        first = manager.prepare_rootfs(image, tmp_path / "pod1")
        (first / "etc/a").write_text("changed by pod 1")
        started = time.monotonic()
        second = manager.prepare_rootfs(manager.get(f"{registry.host}/{name}:1"), tmp_path / "pod2")
        assert time.monotonic() - started < 1.0
        assert sorted(p.name for p in (second / "etc").iterdir()) == ["a", "b"]
        assert (second / "etc/a").read_text() == "1"
        for bundle in ("pod1", "pod2"):
            manager.release_rootfs(tmp_path / bundle)


def test_multi_platform_index_resolves_this_hosts_manifest(
    registry: Registry, manager: ImageManager
) -> None:
    ours = build_image([make_layer({"arch": "ours"})])
    theirs = build_image([make_layer({"arch": "theirs"})], architecture=other_arch(manager))
    name = repo()
    BuiltIndex.of([theirs, ours]).push(registry.host, f"{name}:multi")
    assert manager.pull(f"{registry.host}/{name}:multi").manifest_digest == ours.digest


def test_image_for_another_architecture_fails_naming_platforms(
    registry: Registry, manager: ImageManager
) -> None:
    foreign = other_arch(manager)
    name = repo()
    image = build_image([make_layer({"a": "b"})], architecture=foreign)
    BuiltIndex.of([image], docker=True).push(registry.host, f"{name}:index")
    image.push(registry.host, f"{name}:single")
    for tag in ("index", "single"):
        with pytest.raises(NoMatchingPlatform, match=f"available platforms: linux/{foreign}"):
            manager.pull(f"{registry.host}/{name}:{tag}")
    assert not manager.list_images()


def test_missing_image_or_tag_is_not_found(registry: Registry, manager: ImageManager) -> None:
    name = repo()
    busybox_image().push(registry.host, f"{name}:exists")
    for ref in (f"{registry.host}/{name}:nope", f"{registry.host}/{repo()}:v1"):
        with pytest.raises(ImageNotFound, match="not found"):
            manager.pull(ref)


def test_corrupted_layer_is_refused_naming_its_digest(
    registry: Registry, corrupting_proxy: CorruptingProxy, manager: ImageManager
) -> None:
    image = build_image([make_layer({"good": "1"}), make_layer({"bad": "2" * 5000})])
    name = repo()
    image.push(registry.host, f"{name}:1")
    bad = image.layers[1].digest
    corrupting_proxy.corrupt.add(bad)
    with pytest.raises(DigestMismatch, match=f"blob {bad} is corrupted") as caught:
        manager.pull(f"{corrupting_proxy.host}/{name}:1")
    assert caught.value.reason == "DigestMismatch"
    assert not (manager.root / "blobs" / "sha256" / bad[7:]).exists()
    assert not manager.list_images()


def test_basic_auth_registry_wants_the_right_credentials(
    basic_auth_registry: Registry, tmp_path: Path
) -> None:
    host, name = basic_auth_registry.host, repo()
    busybox_image().push(host, f"{name}:1", credentials=basic_auth_registry.credentials)
    good = {host: basic_auth_registry.credentials}
    with ImageManager(tmp_path / "ok", credentials=good) as manager:  # type: ignore[arg-type]
        manager.pull(f"{host}/{name}:1")
    for label, creds in (("none", None), ("wrong", {host: Credentials("alice", "nope")})):
        with ImageManager(tmp_path / label, credentials=creds) as manager:
            with pytest.raises(RegistryUnauthorized, match="HTTP 401"):
                manager.pull(f"{host}/{name}:1")


def test_token_auth_registry_serves_anonymous_and_credentialed_pulls(
    token_auth_registry: Registry, tmp_path: Path
) -> None:
    host, name = token_auth_registry.host, repo()
    creds = token_auth_registry.credentials
    assert creds is not None and token_auth_registry.token_server is not None
    busybox_image().push(host, f"{name}:1", credentials=creds)
    with ImageManager(tmp_path / "anon") as manager:
        manager.pull(f"{host}/{name}:1")
    with ImageManager(tmp_path / "alice", credentials={host: creds}) as manager:
        manager.pull(f"{host}/{name}:1")
    scopes = {scope for _, scope in token_auth_registry.token_server.requests}
    assert f"repository:{name}:pull" in scopes
    with ImageManager(tmp_path / "bad", credentials={host: Credentials("alice", "x")}) as manager:
        with pytest.raises(RegistryUnauthorized, match="refused user 'alice'"):
            manager.pull(f"{host}/{name}:1")


def test_concurrent_pulls_share_one_store(registry: Registry, tmp_path: Path) -> None:
    name = repo()
    image = build_image([make_layer({f"f{i}": str(i) * 10000}) for i in range(6)])
    image.push(registry.host, f"{name}:1")
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            with ImageManager(tmp_path / "shared") as manager:
                manager.pull(f"{registry.host}/{name}:1")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=pull) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    blobs = tmp_path / "shared" / "images" / "blobs" / "sha256"
    assert len(list(blobs.iterdir())) == 8  # 6 layers, config, manifest
    assert list((tmp_path / "shared" / "images" / "tmp").iterdir()) == []


def test_pull_by_digest_and_cached_lookup(registry: Registry, manager: ImageManager) -> None:
    name = repo()
    digest = busybox_image().push(registry.host, f"{name}:1")
    pinned = manager.pull(f"{registry.host}/{name}@{digest}")
    assert pinned.manifest_digest == digest
    assert manager.get(f"{registry.host}/{name}@{digest}").manifest_digest == digest
    with pytest.raises(ImageNotFound, match="not in the local image store"):
        manager.get(f"{registry.host}/{name}:1")


def test_layer_damaged_in_the_store_is_dropped_and_fetched_again(
    registry: Registry, tmp_path: Path
) -> None:
    name = repo()
    image = build_image([make_layer({"data": "z" * 20000})])
    image.push(registry.host, f"{name}:1")
    with ImageManager(tmp_path / "state", rootfs_mode=RootfsMode.COPY) as manager:
        pulled = manager.pull(f"{registry.host}/{name}:1")
        blob = manager.root / "blobs" / "sha256" / image.layers[0].digest[7:]
        blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # as after a crash
        with pytest.raises(ImageError, match="not a valid tar|corrupted"):
            manager.prepare_rootfs(pulled, tmp_path / "bundle")
        assert not blob.exists()
        again = manager.pull(f"{registry.host}/{name}:1")
        rootfs = manager.prepare_rootfs(again, tmp_path / "bundle")
        assert (rootfs / "data").read_text() == "z" * 20000
