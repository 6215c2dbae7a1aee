from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.runtime.errors import BundleError
from gpucloud.runtime.rootfs import User, find_executable, resolve_in_root, resolve_user


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "opt" / "app").mkdir(parents=True)
    (root / "etc").mkdir()
    tool = root / "bin" / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    (root / "bin" / "data").write_text("not executable")
    (root / "bin" / "link").symlink_to("/bin/tool")  # absolute: must stay in the root
    (root / "bin" / "escape").symlink_to("../../../../../etc/passwd")
    (root / "usr").mkdir()
    (root / "usr" / "bin").symlink_to("../bin")
    (root / "opt" / "app" / "run").symlink_to("../../bin/tool")
    (root / "loop").symlink_to("loop")
    return root


def test_symlinks_resolve_inside_the_root(root: Path) -> None:
    assert resolve_in_root(root, "/bin/link") == root / "bin" / "tool"
    assert resolve_in_root(root, "/usr/bin/link") == root / "bin" / "tool"
    assert resolve_in_root(root, "/../../bin/tool") == root / "bin" / "tool"
    # A link pointing far above the root lands at the root's /etc, never the host's.
    assert resolve_in_root(root, "/bin/escape") == root / "etc" / "passwd"
    with pytest.raises(BundleError, match="too many levels"):
        resolve_in_root(root, "/loop")


def test_find_executable_searches_the_container_path(root: Path) -> None:
    assert find_executable(root, "tool", "/usr/local/bin:/usr/bin") == "/usr/bin/tool"
    assert find_executable(root, "link", "/bin") == "/bin/link"
    assert find_executable(root, "data", "/bin") is None
    assert find_executable(root, "tool", "/opt") is None
    assert find_executable(root, "/opt/app/run", "") == "/opt/app/run"
    assert find_executable(root, "./run", "/bin", cwd="/opt/app") == "/opt/app/run"
    assert find_executable(root, "./run", "/bin", cwd="/") is None
    assert find_executable(root, "escape", "/bin") is None  # host's /etc/passwd is not ours


def test_resolve_user(root: Path) -> None:
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nml:x:1001:1001::/home/ml:/bin/sh\n")
    (root / "etc" / "group").write_text("ml:x:1001:\nvideo:x:44:ml,other\nrender:x:105:ml\n")
    assert resolve_user(root, "") == User(0, 0, (), "/root")
    assert resolve_user(root, "ml") == User(1001, 1001, (44, 105), "/home/ml")
    assert resolve_user(root, "1001") == User(1001, 1001, (44, 105), "/home/ml")
    assert resolve_user(root, "ml:video") == User(1001, 44, (), "/home/ml")
    assert resolve_user(root, "4242:4243") == User(4242, 4243, (), "/")
    with pytest.raises(BundleError, match="unable to find user nobody"):
        resolve_user(root, "nobody")
    with pytest.raises(BundleError, match="unable to find group wheel"):
        resolve_user(root, "ml:wheel")


def test_resolve_user_without_passwd(tmp_path: Path) -> None:
    assert resolve_user(tmp_path, "0") == User(0, 0, (), "/root")
    with pytest.raises(BundleError):
        resolve_user(tmp_path, "root")
