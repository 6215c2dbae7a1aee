"""An SFTP version 3 server (draft-ietf-secsh-filexfer-02) on stdin/stdout, confined to ROOT.

Run by the access server as a child process for a pod's ``sftp`` subsystem::

    python -m gpucloud.agent.sftpserver [--uid N --gid N --groups A,B --cwd DIR --home DIR] ROOT

It imports everything first, then ``chroot(ROOT)`` (a pod's ``/proc/<pid>/root``), drops to
the container's user and serves. Inside the chroot every path — absolute symlinks and
``..`` included — resolves within ROOT, so a symlink in the pod cannot reach the host's
files. It speaks what OpenSSH's ``sftp`` and ``scp`` (9.x, which uses SFTP) send, with the
OpenSSH extensions they use: posix-rename, statvfs/fstatvfs, fsync, hardlink, lsetstat,
limits and expand-path. Like OpenSSH's sftp-server, SYMLINK takes the target first.

Requests are answered in order, one at a time; replies to a batch of requests read at once
are written together, so pipelined transfers (many outstanding WRITEs) stay fast.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

VERSION = 3

INIT, VERSION_REPLY, OPEN, CLOSE, READ, WRITE, LSTAT, FSTAT = 1, 2, 3, 4, 5, 6, 7, 8
SETSTAT, FSETSTAT, OPENDIR, READDIR, REMOVE, MKDIR, RMDIR, REALPATH = 9, 10, 11, 12, 13, 14, 15, 16
STAT, RENAME, READLINK, SYMLINK = 17, 18, 19, 20
STATUS, HANDLE, DATA, NAME, ATTRS = 101, 102, 103, 104, 105
EXTENDED, EXTENDED_REPLY = 200, 201

FX_OK, FX_EOF, FX_NO_SUCH_FILE, FX_PERMISSION_DENIED, FX_FAILURE = 0, 1, 2, 3, 4
FX_BAD_MESSAGE, FX_OP_UNSUPPORTED = 5, 8

ATTR_SIZE, ATTR_UIDGID, ATTR_PERMISSIONS, ATTR_ACMODTIME = 0x1, 0x2, 0x4, 0x8
ATTR_EXTENDED = 0x80000000

FXF_READ, FXF_WRITE, FXF_APPEND, FXF_CREAT, FXF_TRUNC, FXF_EXCL = 1, 2, 4, 8, 0x10, 0x20

MAX_PACKET = 256 * 1024
MAX_DATA = MAX_PACKET - 1024
MAX_HANDLES = 256
READDIR_BATCH = 100
READ_CHUNK = 1 << 18

EXTENSIONS = (
    (b"posix-rename@openssh.com", b"1"),
    (b"statvfs@openssh.com", b"2"),
    (b"fstatvfs@openssh.com", b"2"),
    (b"hardlink@openssh.com", b"1"),
    (b"fsync@openssh.com", b"1"),
    (b"lsetstat@openssh.com", b"1"),
    (b"limits@openssh.com", b"1"),
    (b"expand-path@openssh.com", b"1"),
)

#: errno -> SSH_FX code, as OpenSSH's sftp-server maps them.
ERRNO_STATUS = {
    errno.ENOENT: FX_NO_SUCH_FILE, errno.ENOTDIR: FX_NO_SUCH_FILE,
    errno.EBADF: FX_NO_SUCH_FILE, errno.ELOOP: FX_NO_SUCH_FILE,
    errno.EPERM: FX_PERMISSION_DENIED, errno.EACCES: FX_PERMISSION_DENIED,
    errno.EFAULT: FX_PERMISSION_DENIED, errno.ENAMETOOLONG: FX_BAD_MESSAGE,
    errno.EINVAL: FX_BAD_MESSAGE, errno.ENOSYS: FX_OP_UNSUPPORTED,
    errno.EOPNOTSUPP: FX_OP_UNSUPPORTED,
}
STATUS_MESSAGES = {FX_OK: "Success", FX_EOF: "End of file", FX_NO_SUCH_FILE: "No such file",
                   FX_PERMISSION_DENIED: "Permission denied", FX_FAILURE: "Failure",
                   FX_BAD_MESSAGE: "Bad message", FX_OP_UNSUPPORTED: "Operation unsupported"}


class BadMessage(Exception):
    """A request that does not parse."""


class SftpStatus(Exception):
    """Answer the current request with this status instead of a result."""

    def __init__(self, code: int, message: str | None = None) -> None:
        super().__init__(message or STATUS_MESSAGES[code])
        self.code = code
        self.message = message or STATUS_MESSAGES[code]


# -- wire encoding -----------------------------------------------------------------------

def u32(value: int) -> bytes:
    return struct.pack(">I", value)


def u64(value: int) -> bytes:
    return struct.pack(">Q", value)


def string(value: bytes) -> bytes:
    return u32(len(value)) + value


class Reader:
    """Reads the fields of one request."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def _take(self, size: int) -> bytes:
        end = self.offset + size
        if end > len(self.data):
            raise BadMessage("truncated request")
        chunk = self.data[self.offset:end]
        self.offset = end
        return chunk

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack(">I", self._take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack(">Q", self._take(8))[0])

    def string(self) -> bytes:
        return self._take(self.u32())

    def path(self) -> bytes:
        value = self.string()
        if b"\x00" in value:
            raise BadMessage("NUL in a path")
        return value or b"."

    def attrs(self) -> Attrs:
        flags = self.u32()
        attrs = Attrs()
        if flags & ATTR_SIZE:
            attrs.size = self.u64()
        if flags & ATTR_UIDGID:
            attrs.uid, attrs.gid = self.u32(), self.u32()
        if flags & ATTR_PERMISSIONS:
            attrs.permissions = self.u32()
        if flags & ATTR_ACMODTIME:
            attrs.atime, attrs.mtime = self.u32(), self.u32()
        if flags & ATTR_EXTENDED:
            for _ in range(self.u32()):
                self.string()
                self.string()
        return attrs


@dataclass
class Attrs:
    size: int | None = None
    uid: int | None = None
    gid: int | None = None
    permissions: int | None = None
    atime: int | None = None
    mtime: int | None = None


def _time32(value: float) -> int:
    return min(max(int(value), 0), 0xFFFFFFFF)


def encode_stat(st: os.stat_result) -> bytes:
    flags = ATTR_SIZE | ATTR_UIDGID | ATTR_PERMISSIONS | ATTR_ACMODTIME
    return (u32(flags) + u64(st.st_size) + u32(st.st_uid) + u32(st.st_gid)
            + u32(st.st_mode) + u32(_time32(st.st_atime)) + u32(_time32(st.st_mtime)))


NO_ATTRS = u32(0)


# -- names for `ls -l` -------------------------------------------------------------------

def _id_names(path: str) -> dict[int, bytes]:
    """uid/gid -> name from a passwd/group file in the root (no NSS after a chroot)."""
    names: dict[int, bytes] = {}
    try:
        with open(path, "rb") as file:
            for line in file:
                fields = line.split(b":")
                if len(fields) > 2 and fields[2].strip().isdigit():
                    names.setdefault(int(fields[2]), fields[0])
    except OSError:
        pass
    return names


def long_name(name: bytes, st: os.stat_result, users: dict[int, bytes],
              groups: dict[int, bytes]) -> bytes:
    """One ``ls -l`` line, as OpenSSH's sftp-server writes it."""
    user = users.get(st.st_uid, str(st.st_uid).encode())
    group = groups.get(st.st_gid, str(st.st_gid).encode())
    when = time.localtime(st.st_mtime)
    stamp = time.strftime("%b %d %H:%M" if time.time() - st.st_mtime < 182 * 86400
                          else "%b %d  %Y", when).encode()
    mode = stat.filemode(st.st_mode).encode()
    return b"%s %3d %-8s %-8s %8d %s %s" % (mode, st.st_nlink, user, group, st.st_size,
                                             stamp, name)


# -- handles -----------------------------------------------------------------------------

@dataclass
class OpenFile:
    fd: int
    path: bytes


@dataclass
class OpenDir:
    path: bytes
    entries: Iterator[bytes]


def _dir_entries(path: bytes) -> Iterator[bytes]:
    yield b"."
    yield b".."
    with os.scandir(path) as entries:
        for entry in entries:
            yield entry.name


def open_flags(pflags: int) -> int:
    if pflags & FXF_READ and pflags & FXF_WRITE:
        flags = os.O_RDWR
    elif pflags & FXF_WRITE:
        flags = os.O_WRONLY
    else:
        flags = os.O_RDONLY
    for bit, flag in ((FXF_APPEND, os.O_APPEND), (FXF_CREAT, os.O_CREAT),
                      (FXF_TRUNC, os.O_TRUNC), (FXF_EXCL, os.O_EXCL)):
        if pflags & bit:
            flags |= flag
    return flags | os.O_CLOEXEC


def status_of(error: OSError) -> SftpStatus:
    code = ERRNO_STATUS.get(error.errno or 0, FX_FAILURE)
    return SftpStatus(code, os.strerror(error.errno) if error.errno else str(error))


# -- the server --------------------------------------------------------------------------

Handler = Callable[[Reader], bytes]


class SftpServer:
    """Answers requests; ``handle(packet)`` returns the reply packet (type byte onward)."""

    def __init__(self, home: bytes = b"/") -> None:
        self.home = home
        self.handles: dict[bytes, OpenFile | OpenDir] = {}
        self.next_handle = 0
        self.users = _id_names("/etc/passwd")
        self.groups = _id_names("/etc/group")
        self.handlers: dict[int, Handler] = {
            OPEN: self.open, CLOSE: self.close, READ: self.read, WRITE: self.write,
            LSTAT: self.lstat, FSTAT: self.fstat, STAT: self.stat, SETSTAT: self.setstat,
            FSETSTAT: self.fsetstat, OPENDIR: self.opendir, READDIR: self.readdir,
            REMOVE: self.remove, MKDIR: self.mkdir, RMDIR: self.rmdir,
            REALPATH: self.realpath, RENAME: self.rename, READLINK: self.readlink,
            SYMLINK: self.symlink, EXTENDED: self.extended,
        }
        self.extensions: dict[bytes, Handler] = {
            b"posix-rename@openssh.com": self.posix_rename,
            b"statvfs@openssh.com": self.statvfs, b"fstatvfs@openssh.com": self.fstatvfs,
            b"hardlink@openssh.com": self.hardlink, b"fsync@openssh.com": self.fsync,
            b"lsetstat@openssh.com": self.lsetstat, b"limits@openssh.com": self.limits,
            b"expand-path@openssh.com": self.expand_path,
        }

    def handle(self, packet: bytes) -> bytes | None:
        """The reply to one packet; None for a packet that gets none."""
        reader = Reader(packet)
        try:
            kind = reader.u8()
            if kind == INIT:
                return self.version()
            request_id = reader.u32()
        except BadMessage:
            return None
        reply = self._dispatch(kind, reader)
        return reply[:1] + u32(request_id) + reply[1:]

    def _dispatch(self, kind: int, reader: Reader) -> bytes:
        """The reply without its request id: a result or the status an error maps to."""
        handler = self.handlers.get(kind)
        try:
            if handler is None:
                raise SftpStatus(FX_OP_UNSUPPORTED)
            return handler(reader)
        except SftpStatus as status:
            return status_reply(status.code, status.message)
        except OSError as error:
            mapped = status_of(error)
            return status_reply(mapped.code, mapped.message)
        except NotImplementedError:  # e.g. chmod of a symlink itself (lsetstat) on Linux
            return status_reply(FX_OP_UNSUPPORTED, STATUS_MESSAGES[FX_OP_UNSUPPORTED])
        except (BadMessage, ValueError, OverflowError):
            return status_reply(FX_BAD_MESSAGE, STATUS_MESSAGES[FX_BAD_MESSAGE])

    @staticmethod
    def version() -> bytes:
        return bytes([VERSION_REPLY]) + u32(VERSION) + b"".join(
            string(name) + string(data) for name, data in EXTENSIONS)

    def close_all(self) -> None:
        for entry in self.handles.values():
            if isinstance(entry, OpenFile):
                os.close(entry.fd)
        self.handles.clear()

    # -- replies ---------------------------------------------------------------------

    @staticmethod
    def ok() -> bytes:
        return status_reply(FX_OK, STATUS_MESSAGES[FX_OK])

    def _new_handle(self, entry: OpenFile | OpenDir) -> bytes:
        self.next_handle += 1
        handle = str(self.next_handle).encode()
        self.handles[handle] = entry
        return bytes([HANDLE]) + string(handle)

    def _entry(self, reader: Reader) -> OpenFile | OpenDir:
        entry = self.handles.get(reader.string())
        if entry is None:
            raise SftpStatus(FX_FAILURE, "Invalid handle")
        return entry

    def _file(self, reader: Reader) -> OpenFile:
        entry = self._entry(reader)
        if not isinstance(entry, OpenFile):
            raise SftpStatus(FX_FAILURE, "Not a file handle")
        return entry

    def _names(self, names: list[tuple[bytes, bytes, bytes]]) -> bytes:
        return bytes([NAME]) + u32(len(names)) + b"".join(
            string(name) + string(longname) + attrs for name, longname, attrs in names)

    def _one_name(self, name: bytes) -> bytes:
        return self._names([(name, name, NO_ATTRS)])

    def _check_room(self) -> None:
        if len(self.handles) >= MAX_HANDLES:
            raise SftpStatus(FX_FAILURE, "Too many open handles")

    # -- files -----------------------------------------------------------------------

    def open(self, reader: Reader) -> bytes:
        path, pflags, attrs = reader.path(), reader.u32(), reader.attrs()
        self._check_room()
        mode = attrs.permissions & 0o7777 if attrs.permissions is not None else 0o666
        fd = os.open(path, open_flags(pflags), mode)
        return self._new_handle(OpenFile(fd, path))

    def close(self, reader: Reader) -> bytes:
        handle = reader.string()
        entry = self.handles.pop(handle, None)
        if entry is None:
            raise SftpStatus(FX_FAILURE, "Invalid handle")
        if isinstance(entry, OpenFile):
            os.close(entry.fd)
        return self.ok()

    def read(self, reader: Reader) -> bytes:
        file, offset, length = self._file(reader), reader.u64(), reader.u32()
        data = os.pread(file.fd, min(length, MAX_DATA), offset)
        if not data:
            raise SftpStatus(FX_EOF)
        return bytes([DATA]) + string(data)

    def write(self, reader: Reader) -> bytes:
        file, offset, data = self._file(reader), reader.u64(), reader.string()
        view = memoryview(data)
        while view:
            written = os.pwrite(file.fd, view, offset)
            view, offset = view[written:], offset + written
        return self.ok()

    def fsync(self, reader: Reader) -> bytes:
        os.fsync(self._file(reader).fd)
        return self.ok()

    # -- attributes ------------------------------------------------------------------

    def stat(self, reader: Reader) -> bytes:
        return bytes([ATTRS]) + encode_stat(os.stat(reader.path()))

    def lstat(self, reader: Reader) -> bytes:
        return bytes([ATTRS]) + encode_stat(os.lstat(reader.path()))

    def fstat(self, reader: Reader) -> bytes:
        entry = self._entry(reader)
        st = os.fstat(entry.fd) if isinstance(entry, OpenFile) else os.stat(entry.path)
        return bytes([ATTRS]) + encode_stat(st)

    def setstat(self, reader: Reader) -> bytes:
        path, attrs = reader.path(), reader.attrs()
        apply_attrs(path, attrs, follow=True)
        return self.ok()

    def lsetstat(self, reader: Reader) -> bytes:
        path, attrs = reader.path(), reader.attrs()
        apply_attrs(path, attrs, follow=False)
        return self.ok()

    def fsetstat(self, reader: Reader) -> bytes:
        entry, attrs = self._entry(reader), reader.attrs()
        apply_attrs(entry.fd if isinstance(entry, OpenFile) else entry.path, attrs, follow=True)
        return self.ok()

    # -- directories -----------------------------------------------------------------

    def opendir(self, reader: Reader) -> bytes:
        path = reader.path()
        self._check_room()
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise SftpStatus(FX_NO_SUCH_FILE, os.strerror(errno.ENOTDIR))
        os.listdir(path)  # refuse an unreadable directory now, as opendir(3) would
        return self._new_handle(OpenDir(path, _dir_entries(path)))

    def readdir(self, reader: Reader) -> bytes:
        entry = self._entry(reader)
        if not isinstance(entry, OpenDir):
            raise SftpStatus(FX_FAILURE, "Not a directory handle")
        names: list[tuple[bytes, bytes, bytes]] = []
        for name in entry.entries:
            try:
                st = os.lstat(os.path.join(entry.path, name))
            except OSError:
                continue  # gone since the listing began
            names.append((name, long_name(name, st, self.users, self.groups),
                          encode_stat(st)))
            if len(names) >= READDIR_BATCH:
                break
        if not names:
            raise SftpStatus(FX_EOF)
        return self._names(names)

    def mkdir(self, reader: Reader) -> bytes:
        path, attrs = reader.path(), reader.attrs()
        os.mkdir(path, attrs.permissions & 0o7777 if attrs.permissions is not None else 0o777)
        return self.ok()

    def rmdir(self, reader: Reader) -> bytes:
        os.rmdir(reader.path())
        return self.ok()

    # -- names -----------------------------------------------------------------------

    def realpath(self, reader: Reader) -> bytes:
        return self._one_name(os.path.realpath(reader.path()))

    def expand_path(self, reader: Reader) -> bytes:
        path = reader.path()
        if path == b"~" or path.startswith(b"~/"):
            path = self.home + path[1:]
        elif path.startswith(b"~"):
            raise SftpStatus(FX_NO_SUCH_FILE, "No such user")
        return self._one_name(os.path.realpath(path))

    def readlink(self, reader: Reader) -> bytes:
        return self._one_name(os.readlink(reader.path()))

    def symlink(self, reader: Reader) -> bytes:
        # OpenSSH sends the target first, then the new link (the draft has them reversed).
        target, link = reader.string(), reader.path()
        os.symlink(target, link)
        return self.ok()

    def remove(self, reader: Reader) -> bytes:
        os.unlink(reader.path())
        return self.ok()

    def rename(self, reader: Reader) -> bytes:
        old, new = reader.path(), reader.path()
        if os.path.lexists(new):
            raise SftpStatus(FX_FAILURE, "Target exists")
        os.rename(old, new)
        return self.ok()

    def posix_rename(self, reader: Reader) -> bytes:
        old, new = reader.path(), reader.path()
        os.rename(old, new)
        return self.ok()

    def hardlink(self, reader: Reader) -> bytes:
        old, new = reader.path(), reader.path()
        os.link(old, new)
        return self.ok()

    # -- extensions ------------------------------------------------------------------

    def extended(self, reader: Reader) -> bytes:
        handler = self.extensions.get(reader.string())
        if handler is None:
            raise SftpStatus(FX_OP_UNSUPPORTED)
        return handler(reader)

    def statvfs(self, reader: Reader) -> bytes:
        return encode_statvfs(os.statvfs(reader.path()))

    def fstatvfs(self, reader: Reader) -> bytes:
        entry = self._entry(reader)
        st = os.fstatvfs(entry.fd) if isinstance(entry, OpenFile) else os.statvfs(entry.path)
        return encode_statvfs(st)

    def limits(self, reader: Reader) -> bytes:
        del reader
        return bytes([EXTENDED_REPLY]) + u64(MAX_PACKET) + u64(MAX_DATA) + u64(MAX_DATA) \
            + u64(MAX_HANDLES)


def status_reply(code: int, message: str) -> bytes:
    return bytes([STATUS]) + u32(code) + string(message.encode()) + string(b"")


def encode_statvfs(st: os.statvfs_result) -> bytes:
    flag = (1 if st.f_flag & os.ST_RDONLY else 0) | (2 if st.f_flag & os.ST_NOSUID else 0)
    fields = (st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail, st.f_files,
              st.f_ffree, st.f_favail, st.f_fsid, flag, st.f_namemax)
    return bytes([EXTENDED_REPLY]) + b"".join(u64(value) for value in fields)


def apply_attrs(target: bytes | int, attrs: Attrs, *, follow: bool) -> None:
    """SETSTAT/FSETSTAT/lsetstat: size, owner, mode, times, in the order sftp-server uses."""
    if attrs.size is not None:
        if isinstance(target, int):
            os.ftruncate(target, attrs.size)
        else:
            os.truncate(target, attrs.size)
    if attrs.permissions is not None:
        os.chmod(target, attrs.permissions & 0o7777, follow_symlinks=follow)
    if attrs.atime is not None and attrs.mtime is not None:
        os.utime(target, (attrs.atime, attrs.mtime), follow_symlinks=follow)
    if attrs.uid is not None and attrs.gid is not None:
        os.chown(target, attrs.uid, attrs.gid, follow_symlinks=follow)


# -- the process -------------------------------------------------------------------------

def _frames(buffer: bytearray) -> Iterator[bytes]:
    """Complete packets at the front of ``buffer`` (removed from it)."""
    offset = 0
    while len(buffer) - offset >= 4:
        length = int.from_bytes(buffer[offset:offset + 4], "big")
        if length > MAX_PACKET + 1024:
            raise BadMessage(f"packet of {length} bytes")
        if len(buffer) - offset - 4 < length:
            break
        yield bytes(buffer[offset + 4:offset + 4 + length])
        offset += 4 + length
    del buffer[:offset]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve(server: SftpServer, fd_in: int = 0, fd_out: int = 1) -> None:
    """Answer requests until the client closes its end."""
    buffer = bytearray()
    try:
        while chunk := os.read(fd_in, READ_CHUNK):
            buffer += chunk
            replies = [reply for packet in _frames(buffer)
                       if (reply := server.handle(packet)) is not None]
            if replies:
                _write_all(fd_out, b"".join(u32(len(r)) + r for r in replies))
    except BrokenPipeError:
        pass
    finally:
        server.close_all()


@dataclass(frozen=True)
class Confinement:
    root: str
    uid: int | None = None
    gid: int | None = None
    groups: tuple[int, ...] = ()
    cwd: str = "/"
    home: str = "/"


def confine(how: Confinement) -> None:
    """chroot into the root, become the container's user, start in its working directory."""
    os.chroot(how.root)
    os.chdir("/")
    if how.gid is not None:
        os.setgroups(list(how.groups))
        os.setgid(how.gid)
    if how.uid is not None:
        os.setuid(how.uid)
    try:
        os.chdir(how.cwd)
    except OSError:
        os.chdir("/")


def parse_args(argv: list[str]) -> Confinement:
    parser = argparse.ArgumentParser(prog="python -m gpucloud.agent.sftpserver",
                                     description="An SFTP v3 server on stdin/stdout in ROOT.")
    parser.add_argument("root")
    parser.add_argument("--uid", type=int)
    parser.add_argument("--gid", type=int)
    parser.add_argument("--groups", default="", help="supplementary group ids, comma-separated")
    parser.add_argument("--cwd", default="/")
    parser.add_argument("--home", default="/")
    args = parser.parse_args(argv)
    groups = tuple(int(g) for g in args.groups.split(",") if g.strip())
    return Confinement(args.root, args.uid, args.gid, groups, args.cwd, args.home)


def main(argv: list[str]) -> int:
    how = parse_args(argv)
    try:
        confine(how)
    except OSError as error:
        print(f"sftpserver: cannot enter {how.root}: {error.strerror}", file=sys.stderr)
        return 1
    os.umask(0o022)
    serve(SftpServer(home=how.home.encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
