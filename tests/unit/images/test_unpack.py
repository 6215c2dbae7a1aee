"""Layer unpacking: whiteouts, hard links, compression, and refusing escapes."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from gpucloud.images.errors import UnsafeLayer
from gpucloud.images.testing import (
    compress_layer,
    directory,
    file,
    hardlink,
    layer_tar,
    opaque,
    symlink,
    whiteout,
)
from gpucloud.images.unpack import Whiteouts, unpack_layer, unpack_stream

is_root = os.geteuid() == 0


def apply(dest: Path, files: dict[str, object]) -> str:
    return unpack_stream(io.BytesIO(layer_tar(files)), dest, Whiteouts.APPLY)  # type: ignore[arg-type]


def tree(root: Path) -> dict[str, str]:
    """Every path under root: file contents, link targets, or 'dir'."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = path.read_text()
    return out


def test_whiteouts_delete_lower_paths_and_opaque_dirs_hide_lower_content(tmp_path: Path) -> None:
    apply(tmp_path, {"a/keep": "1", "a/gone": "2", "b/old1": "3", "b/sub/old2": "4", "c": "5"})
    apply(tmp_path, {"a/gone": whiteout(), "b": opaque(), "b/new": "6", "c": whiteout()})
    assert tree(tmp_path) == {"a": "dir", "a/keep": "1", "b": "dir", "b/new": "6"}


def test_later_layers_replace_files_dirs_and_links(tmp_path: Path) -> None:
    apply(tmp_path, {"x": "file", "d/f": "1", "l": symlink("x")})
    apply(tmp_path, {"x": directory(), "x/in": "2", "d": "now a file", "l": "plain"})
    assert tree(tmp_path) == {"d": "now a file", "l": "plain", "x": "dir", "x/in": "2"}


def test_hard_links_share_the_inode(tmp_path: Path) -> None:
    apply(tmp_path, {"bin/tool": file("x", 0o755), "bin/alias": hardlink("bin/tool")})
    assert (tmp_path / "bin/alias").stat().st_ino == (tmp_path / "bin/tool").stat().st_ino
    assert stat.S_IMODE((tmp_path / "bin/alias").stat().st_mode) == 0o755


def test_modes_and_sticky_bits_are_kept(tmp_path: Path) -> None:
    apply(tmp_path, {"tmp": directory(0o1777), "run.sh": file("#!/bin/sh", 0o750)})
    assert stat.S_IMODE((tmp_path / "tmp").stat().st_mode) == 0o1777
    assert stat.S_IMODE((tmp_path / "run.sh").stat().st_mode) == 0o750


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"../evil": "x"}, "'../evil' escapes"),
        ({"a/../../evil": "x"}, "escapes"),
        ({"link": symlink("../../etc/passwd")}, "'link' -> '../../etc/passwd' escapes"),
        ({"a/b/link": symlink("../../../x")}, "escapes"),
    ],
)
def test_entries_escaping_the_root_are_refused(
    tmp_path: Path, files: dict[str, object], message: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(UnsafeLayer, match=message):
        apply(root, files)
    assert not (tmp_path / "evil").exists()


def test_writes_through_symlinks_stay_inside_the_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    apply(root, {"abs": symlink(str(outside)), "rel": symlink("./sub/../"), "etc": directory()})
    apply(root, {"abs/planted": "a", "rel/also": "b", "up": symlink("/etc/../../..")})
    apply(root, {"up/deep": "c"})
    assert list(outside.iterdir()) == []
    assert (root / str(outside).lstrip("/") / "planted").read_text() == "a"
    assert (root / "also").read_text() == "b" and (root / "deep").read_text() == "c"


def test_hard_link_to_a_symlink_pointing_outside_links_the_symlink_itself(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host file")
    root = tmp_path / "root"
    root.mkdir()
    apply(root, {"s": symlink(str(secret)), "h": hardlink("s")})
    assert (root / "h").is_symlink()
    assert secret.stat().st_nlink == 1


@pytest.mark.parametrize("compression", ["gzip", "zstd", "none"])
def test_all_compressions_unpack_and_report_the_diff_id(tmp_path: Path, compression: str) -> None:
    layer = compress_layer(layer_tar({"etc/hostname": "pod\n"}), compression)  # type: ignore[arg-type]
    blob = tmp_path / "blob"
    blob.write_bytes(layer.data)
    dest = tmp_path / "root"
    dest.mkdir()
    assert unpack_layer(blob, dest, Whiteouts.APPLY) == layer.diff_id
    assert (dest / "etc/hostname").read_text() == "pod\n"


@pytest.mark.skipif(not is_root, reason="overlay whiteouts are device nodes and trusted xattrs")
def test_overlay_format_writes_kernel_whiteouts(tmp_path: Path) -> None:
    files = {"gone": whiteout(), "dir": opaque(), "dir/new": "1"}
    unpack_stream(io.BytesIO(layer_tar(files)), tmp_path, Whiteouts.OVERLAY)  # type: ignore[arg-type]
    mode = (tmp_path / "gone").lstat()
    assert stat.S_ISCHR(mode.st_mode) and mode.st_rdev == os.makedev(0, 0)
    assert os.getxattr(tmp_path / "dir", "trusted.overlay.opaque") == b"y"
    assert (tmp_path / "dir/new").read_text() == "1"


def test_a_directory_replaced_by_a_symlink_mid_layer_redirects_later_entries(
    tmp_path: Path,
) -> None:
    """Parent directories are resolved once and remembered: an entry that replaces one
    with a symlink must make later entries under it follow the link (chroot semantics)."""
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, kind: bytes, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname, info.mode = kind, len(data), link, 0o755
            tar.addfile(info, io.BytesIO(data))

        add("a", tarfile.DIRTYPE)
        add("a/x", tarfile.REGTYPE, b"first")
        add("b", tarfile.DIRTYPE)
        add("a", tarfile.SYMTYPE, link="/b")
        add("a/y", tarfile.REGTYPE, b"second")
    dest = tmp_path / "root"
    dest.mkdir()
    unpack_stream(io.BytesIO(stream.getvalue()), dest, Whiteouts.OVERLAY)
    assert tree(dest) == {"a": "-> /b", "b": "dir", "b/y": "second"}
