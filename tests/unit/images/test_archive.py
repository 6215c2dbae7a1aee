"""Importing OCI layouts and docker-save tarballs into the store."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from gpucloud.images import ImageManager, InvalidImage, NoMatchingPlatform, RootfsMode
from gpucloud.images.errors import UnsafeLayer
from gpucloud.images.testing import BuiltImage, build_image, make_layer, whiteout


@pytest.fixture
def image() -> BuiltImage:
    base = make_layer({"etc/os-release": "ID=test\n", "old": "x"})
    top = make_layer({"app/run": "hello", "old": whiteout()}, compression="zstd")
    return build_image([base, top], cmd=["/app/run"], env={"A": "1"}, working_dir="/app")


@pytest.fixture
def manager(tmp_path: Path) -> ImageManager:
    return ImageManager(tmp_path / "state", rootfs_mode=RootfsMode.COPY)


def check_rootfs(manager: ImageManager, reference: str, bundle: Path) -> None:
    stored = manager.get(reference)
    assert stored.config.cmd == ("/app/run",) and stored.config.working_dir == "/app"
    rootfs = manager.prepare_rootfs(stored, bundle)
    assert (rootfs / "app/run").read_text() == "hello"
    assert (rootfs / "etc/os-release").exists() and not (rootfs / "old").exists()


@pytest.mark.parametrize("as_tar", [False, True])
def test_oci_layout_imports_under_its_name(
    tmp_path: Path, image: BuiltImage, manager: ImageManager, as_tar: bool
) -> None:
    layout = image.write_oci_layout(tmp_path / "layout", "gpucloud/demo:1", as_tar=as_tar)
    imported = manager.import_archive(layout)
    assert [i.reference for i in imported] == ["docker.io/gpucloud/demo:1"]
    assert imported[0].manifest_digest == image.digest
    check_rootfs(manager, "gpucloud/demo:1", tmp_path / "bundle")
    assert [r.reference for r in manager.list_images()] == ["docker.io/gpucloud/demo:1"]


def test_docker_save_tarball_imports_with_its_repo_tags(
    tmp_path: Path, image: BuiltImage, manager: ImageManager
) -> None:
    archive = image.write_docker_archive(tmp_path / "save.tar", ["demo:latest", "demo:v2"])
    imported = manager.import_archive(archive)
    assert [i.reference for i in imported] == [
        "docker.io/library/demo:latest",
        "docker.io/library/demo:v2",
    ]
    check_rootfs(manager, "demo:v2", tmp_path / "bundle")


def test_nameless_archive_needs_a_name(
    tmp_path: Path, image: BuiltImage, manager: ImageManager
) -> None:
    layout = image.write_oci_layout(tmp_path / "layout")
    with pytest.raises(InvalidImage, match="does not name its image"):
        manager.import_archive(layout)
    imported = manager.import_archive(layout, name="local/named:3")
    assert [i.reference for i in imported] == ["docker.io/local/named:3"]


def test_foreign_architecture_imports_but_will_not_run(
    tmp_path: Path, manager: ImageManager
) -> None:
    foreign = "arm64" if manager.platform.architecture != "arm64" else "amd64"
    image = build_image([make_layer({"a": "b"})], architecture=foreign)
    manager.import_archive(image.write_oci_layout(tmp_path / "l", "x/foreign:1"))
    with pytest.raises(NoMatchingPlatform, match=f"linux/{foreign}"):
        manager.prepare_rootfs(manager.get("x/foreign:1"), tmp_path / "bundle")


def test_archive_members_outside_the_archive_are_refused(
    tmp_path: Path, manager: ImageManager
) -> None:
    bad = tmp_path / "bad.tar"
    manifest = [{"Config": "../../etc/passwd", "RepoTags": ["x:1"], "Layers": []}]
    data = json.dumps(manifest).encode()
    with tarfile.open(bad, "w") as tar:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(UnsafeLayer, match="outside the archive"):
        manager.import_archive(bad)


def test_something_else_is_not_an_archive(tmp_path: Path, manager: ImageManager) -> None:
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(InvalidImage, match="not an image archive"):
        manager.import_archive(junk)
