"""Offline images: a busybox image built from the host's busybox, imported, and run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpucloud.images import ImageManager
from gpucloud.images.testing import busybox_image


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root")
@pytest.mark.parametrize("fmt", ["docker-save", "oci-tar"])
def test_imported_busybox_image_runs_its_command(tmp_path: Path, fmt: str) -> None:
    image = busybox_image(
        entrypoint=["/bin/sh", "-c"],
        cmd=['echo "$GREETING from $(pwd)"'],
        env={"GREETING": "hello"},
        working_dir="/work",
        extra_files={"work/.keep": ""},
    )
    path = tmp_path / "image.tar"
    if fmt == "docker-save":
        image.write_docker_archive(path, ["gpucloud/demo:latest"])
    else:
        image.write_oci_layout(path, "gpucloud/demo:latest", as_tar=True)
    with ImageManager(tmp_path / "state") as manager:
        (imported,) = manager.import_archive(path)
        assert imported.reference == "docker.io/gpucloud/demo:latest"
        config = manager.get("gpucloud/demo").config
        rootfs = manager.prepare_rootfs(imported, tmp_path / "bundle")
        try:
            env = dict(line.split("=", 1) for line in config.env)
            command = [
                "chroot",
                str(rootfs),
                "/bin/sh",
                "-c",
                f'cd {config.working_dir} && exec "$@"',
                "-",
                *config.entrypoint,
                *config.cmd,
            ]
            result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        finally:
            manager.release_rootfs(tmp_path / "bundle")
    assert result.stdout == "hello from /work\n"
