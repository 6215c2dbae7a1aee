"""The SFTP server with OpenSSH's real ``sftp`` client (``sftp -D`` runs it directly, no SSH),
plus its answers to malformed and unusual requests."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpucloud.agent import sftpserver as sftp_server
from gpucloud.agent.sftpserver import (
    FX_BAD_MESSAGE,
    FX_FAILURE,
    FX_NO_SUCH_FILE,
    FX_OK,
    FX_OP_UNSUPPORTED,
    OPEN,
    RENAME,
    STATUS,
    SftpServer,
    string,
    u32,
)

root_only = pytest.mark.root  # the server chroots


def make_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for directory in ("etc", "home/app", "data"):
        (root / directory).mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:\n")
    (root / "etc" / "group").write_text("root:x:0:\napp:x:1000:\n")
    os.chown(root / "home" / "app", 1000, 1000)
    return root


def sftp(root: Path, batch: str, *options: str) -> subprocess.CompletedProcess[str]:
    server = f"{sys.executable} -m gpucloud.agent.sftpserver {' '.join(options)} {root}"
    return subprocess.run(["sftp", "-D", server, "-b", "-"], input=batch, text=True,
                          capture_output=True, timeout=60, check=False, cwd="/")


@root_only
def test_put_get_many_megabytes_and_directory_operations(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(8 * 1024 * 1024 + 7))
    back = tmp_path / "back.bin"
    result = sftp(root, f"""
put -p {payload} /data/p.bin
mkdir /data/sub
rename /data/p.bin /data/sub/q.bin
ls -l /data/sub
get /data/sub/q.bin {back}
chmod 640 /data/sub/q.bin
symlink /data/sub/q.bin /data/link
df /data
""")
    assert result.returncode == 0, result.stderr
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(
        payload.read_bytes()).digest()
    stored = root / "data" / "sub" / "q.bin"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o640
    assert int(stored.stat().st_mtime) == int(payload.stat().st_mtime)  # put -p
    assert os.readlink(root / "data" / "link") == "/data/sub/q.bin"
    assert "q.bin" in result.stdout and "root" in result.stdout  # ls -l long name


@root_only
def test_paths_stay_inside_the_root(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    os.symlink("/etc/passwd", root / "data" / "escape")
    out = tmp_path / "out"
    out.mkdir()
    result = sftp(root, f"get /data/escape {out}/a\nget /../../../etc/passwd {out}/b\n"
                        "cd /..\npwd\n")
    assert result.returncode == 0, result.stderr
    inside = (root / "etc" / "passwd").read_text()
    assert (out / "a").read_text() == inside
    assert (out / "b").read_text() == inside
    assert "Remote working directory: /\n" in result.stdout


@root_only
def test_runs_as_the_given_user_in_its_directory(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    source = tmp_path / "f.txt"
    source.write_text("hello")
    result = sftp(root, f"pwd\nput {source} mine.txt\n-put {source} /etc/theirs.txt\n"
                        "-get /nothing-here\n",
                  "--uid", "1000", "--gid", "1000", "--cwd", "/home/app", "--home", "/home/app")
    assert result.returncode == 0, result.stderr
    assert "Remote working directory: /home/app" in result.stdout
    owned = (root / "home" / "app" / "mine.txt").stat()
    assert (owned.st_uid, owned.st_gid) == (1000, 1000)
    assert not (root / "etc" / "theirs.txt").exists()
    assert "Permission denied" in result.stderr
    assert "No such file" in result.stderr or "not found" in result.stderr


def test_a_root_that_cannot_be_entered_is_one_line_and_exit_1(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gpucloud.agent.sftpserver",
                             str(tmp_path / "missing")], capture_output=True, text=True,
                            check=False, cwd="/", stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert result.stderr.startswith("sftpserver: cannot enter")
    assert len(result.stderr.splitlines()) == 1


# -- requests straight to the server object (no chroot: paths under tmp_path) -------------

def status_code(reply: bytes | None, request_id: int) -> int:
    assert reply is not None and reply[0] == STATUS
    assert int.from_bytes(reply[1:5], "big") == request_id
    return int.from_bytes(reply[5:9], "big")


def test_unknown_truncated_and_odd_requests_get_statuses(tmp_path: Path) -> None:
    server = SftpServer()
    assert status_code(server.handle(bytes([99]) + u32(7)), 7) == FX_OP_UNSUPPORTED
    assert status_code(server.handle(bytes([OPEN]) + u32(8) + u32(200)), 8) == FX_BAD_MESSAGE
    missing = str(tmp_path / "missing").encode()
    opened = server.handle(bytes([OPEN]) + u32(9) + string(missing) + u32(1) + u32(0))
    assert status_code(opened, 9) == FX_NO_SUCH_FILE
    nul = bytes([OPEN]) + u32(10) + string(b"a\x00b") + u32(1) + u32(0)
    assert status_code(server.handle(nul), 10) == FX_BAD_MESSAGE
    assert server.handle(b"") is None  # no id to answer to


def test_plain_rename_refuses_to_replace_posix_rename_replaces(tmp_path: Path) -> None:
    server = SftpServer()
    old, new = tmp_path / "old", tmp_path / "new"
    old.write_text("old")
    new.write_text("new")
    request = bytes([RENAME]) + u32(1) + string(bytes(old)) + string(bytes(new))
    assert status_code(server.handle(request), 1) == FX_FAILURE
    extended = (bytes([sftp_server.EXTENDED]) + u32(2) + string(b"posix-rename@openssh.com")
                + string(bytes(old)) + string(bytes(new)))
    assert status_code(server.handle(extended), 2) == FX_OK
    assert new.read_text() == "old" and not old.exists()
