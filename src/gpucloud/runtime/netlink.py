"""The two kernel calls a claimed spare namespace needs (runtime/network), without ``ip``.

A pod's start claims a network namespace made ahead (``BridgeNetwork.claim``): its host
veth gets the container's name and joins the bridge, and the namespace's file takes the
container's name. Run as ``ip`` commands that would be two processes again (the cost the
spares exist to avoid), so here they are one rtnetlink request and three syscalls:

* ``set_link``: ``RTM_NEWLINK`` on an interface by index: a new name (the kernel renames
  only an interface that is down, hence spares keep their host end down), a master and
  the up flag, in one message (the kernel renames first, then sets the flags, then the
  master), acknowledged before it returns;
* ``rename_netns``: a named namespace is an ``nsfs`` bind mount at ``/run/netns/NAME``
  (how ``ip netns add`` names one); a mount point cannot be renamed, so the namespace is
  bound at the new name and the old mount detached and its file removed.

Only the standard library is imported here.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from pathlib import Path

RTM_NEWLINK = 16
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
IFLA_IFNAME, IFLA_MASTER = 3, 10
IFF_UP = 0x1
MS_BIND = 0x1000
MNT_DETACH = 2
_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")
_RTATTR = struct.Struct("=HH")
_libc = ctypes.CDLL(None, use_errno=True)


def _attribute(kind: int, payload: bytes) -> bytes:
    length = _RTATTR.size + len(payload)
    return _RTATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


def set_link(name: str, *, new_name: str | None = None, master: str | None = None,
             up: bool = False) -> None:
    """Rename interface ``name`` (it must be down), enslave it to ``master`` and set it
    up, as one request; OSError with the kernel's errno when it is refused."""
    index = socket.if_nametoindex(name)
    attributes = b""
    if new_name is not None:
        attributes += _attribute(IFLA_IFNAME, new_name.encode() + b"\0")
    if master is not None:
        attributes += _attribute(IFLA_MASTER, struct.pack("=I", socket.if_nametoindex(master)))
    flags = IFF_UP if up else 0
    body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, index, flags, IFF_UP if up else 0) + attributes
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), RTM_NEWLINK,
                            NLM_F_REQUEST | NLM_F_ACK, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.sendto(header + body, (0, 0))
        _await_ack(sock, name)


def _await_ack(sock: socket.socket, name: str) -> None:
    """The request's acknowledgement (an ``NLMSG_ERROR`` whose error is 0)."""
    while True:
        reply = sock.recv(65536)
        offset = 0
        while offset + _NLMSGHDR.size <= len(reply):
            length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(reply, offset)
            if kind == NLMSG_ERROR:
                (error,) = struct.unpack_from("=i", reply, offset + _NLMSGHDR.size)
                if error:
                    raise OSError(-error, f"setting link {name}: {os.strerror(-error)}")
                return
            offset += max(length, _NLMSGHDR.size)


def rename_netns(old: Path, new: Path) -> None:
    """Give the named namespace at ``old`` the name ``new`` (which must not exist)."""
    fd = os.open(new, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0)
    os.close(fd)
    if _libc.mount(os.fsencode(old), os.fsencode(new), None, MS_BIND, None) != 0:
        error = ctypes.get_errno()
        new.unlink(missing_ok=True)
        raise OSError(error, f"binding namespace {old.name}: {os.strerror(error)}", str(new))
    if _libc.umount2(os.fsencode(old), MNT_DETACH) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unmounting namespace {old.name}: {os.strerror(error)}",
                      str(old))
    old.unlink()
