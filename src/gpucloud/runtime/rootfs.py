"""Looking things up inside a container's root filesystem from the host.

Paths are resolved the way the container will see them: absolute symlinks point at the
rootfs, ``..`` stops at its top, so a hostile image cannot make the agent read host files.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpucloud.runtime.errors import BundleError

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MAX_SYMLINKS = 40


def _components(path: str) -> list[str]:
    """``path``'s names, as ``PurePosixPath(path).parts`` less the root and ``.``."""
    return [part for part in path.split("/") if part not in ("", ".")]


def resolve_in_root(root: Path, path: str) -> Path:
    """The host path of container path ``path`` (absolute), with symlinks kept inside root.

    Components that do not exist are appended as they are; the result is always under root.
    Strings and ``os.lstat``, not ``pathlib``: a pod's start resolves ~6 paths here (its
    user tables, its command along ``PATH``), and ``Path`` objects built per component were
    a third of the bundle's build (s45).
    """
    pending = _components(path)
    pending.reverse()  # popped from the end: the next component last
    resolved: list[str] = []
    base = os.fspath(root)
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(base, *resolved, part)
        if not _is_symlink(candidate):
            resolved.append(part)
            continue
        links += 1
        if links > _MAX_SYMLINKS:
            raise BundleError(f"too many levels of symbolic links in {path}")
        target = os.readlink(candidate)
        if target.startswith("/"):
            resolved = []
        pending.extend(reversed(_components(target)))
    return root.joinpath(*resolved)


def _is_symlink(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except (OSError, ValueError):  # as ``Path.is_symlink``: missing, or not a valid path
        return False


def _is_executable(path: Path) -> bool:
    try:
        info = path.stat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and bool(info.st_mode & 0o111)


def find_executable(root: Path, command: str, search_path: str, cwd: str = "/") -> str | None:
    """The container path that ``command`` runs, or None when it is not in the image.

    Like execvp: a name with a slash is taken as a path (relative to ``cwd``); a bare name
    is searched in the ``PATH`` the container will have.
    """
    if "/" in command:
        container_path = str(PurePosixPath(cwd) / command)
        return container_path if _is_executable(resolve_in_root(root, container_path)) else None
    for directory in (search_path or DEFAULT_PATH).split(":"):
        container_path = str(PurePosixPath(directory or cwd) / command)
        if directory and _is_executable(resolve_in_root(root, container_path)):
            return container_path
    return None


@dataclass(frozen=True)
class User:
    uid: int
    gid: int
    additional_gids: tuple[int, ...] = ()
    home: str = "/"


def _read_table(root: Path, path: str) -> list[list[str]]:
    try:
        text = resolve_in_root(root, path).read_text(errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _passwd_entry(root: Path, name_or_uid: str) -> list[str] | None:
    for fields in _read_table(root, "/etc/passwd"):
        if len(fields) >= 6 and name_or_uid in (fields[0], fields[2]):
            return fields
    return None


def _group_id(root: Path, name: str) -> int:
    if name.isdigit():
        return int(name)
    for fields in _read_table(root, "/etc/group"):
        if len(fields) >= 3 and fields[0] == name:
            return int(fields[2])
    raise BundleError(f"unable to find group {name} in the image")


def _supplementary_groups(root: Path, user_name: str, primary: int) -> tuple[int, ...]:
    gids = []
    for fields in _read_table(root, "/etc/group"):
        if len(fields) >= 4 and user_name in fields[3].split(",") and fields[2].isdigit():
            gid = int(fields[2])
            if gid != primary and gid not in gids:
                gids.append(gid)
    return tuple(gids)


def resolve_user(root: Path, spec: str) -> User:
    """The uid, gid and groups for an image's ``User`` (``name``, ``uid``, ``user:group``)."""
    user_part, _, group_part = (spec or "0").partition(":")
    entry = _passwd_entry(root, user_part)
    if entry is None and not user_part.isdigit():
        raise BundleError(f"unable to find user {user_part} in the image")
    uid = int(entry[2]) if entry else int(user_part)
    default_home = "/root" if uid == 0 else "/"
    gid = int(entry[3]) if entry else 0
    if group_part:
        gid = _group_id(root, group_part)
    extra = _supplementary_groups(root, entry[0], gid) if entry and not group_part else ()
    return User(uid, gid, extra, entry[5] if entry else default_home)
