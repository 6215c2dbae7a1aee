"""Docker's default seccomp profile, as the OCI ``linux.seccomp`` of every pod.

``seccomp_default.json`` is moby's ``profiles/seccomp/default.json`` (github.com/moby/
profiles/seccomp v0.2.3, Apache-2.0, the profile ``docker run`` applies), shipped as data
unchanged: a default of ``SCMP_ACT_ERRNO`` (EPERM) and an allowlist of syscalls. Some of
its rules are conditional — on the container's capabilities, the CPU architecture or the
kernel version — and Docker resolves those when it writes the container's config; so does
:func:`profile`, for the capability set a pod really gets (``oci.DEFAULT_CAPABILITIES``).
The result: ``mount``, ``unshare``, ``setns``, ``keyctl``, ``init_module``, ``bpf``,
``ptrace`` of other kernels' versions … fail with EPERM, ``clone3`` with ENOSYS (so libcs
fall back to ``clone``, whose namespace flags are refused), and everything an ordinary
program, a shell, sshd-style exec or an SFTP server needs is allowed.
"""

from __future__ import annotations

import json
import os
import platform
import re
from collections.abc import Collection, Mapping
from functools import cache
from importlib import resources
from typing import Any

PROFILE_RESOURCE = "seccomp_default.json"

#: ``platform.machine()`` → the Go architecture names the profile's conditions use.
_GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
            "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64", "i686": "386"}
#: The Go architecture → its libseccomp name (the profile's ``archMap`` keys).
_SCMP_ARCH = {"amd64": "SCMP_ARCH_X86_64", "arm64": "SCMP_ARCH_AARCH64",
              "arm": "SCMP_ARCH_ARM", "ppc64le": "SCMP_ARCH_PPC64LE",
              "s390x": "SCMP_ARCH_S390X", "riscv64": "SCMP_ARCH_RISCV64",
              "386": "SCMP_ARCH_X86"}


@cache
def docker_profile() -> dict[str, Any]:
    """The shipped profile, exactly as Docker publishes it."""
    text = resources.files("gpucloud.runtime").joinpath(PROFILE_RESOURCE).read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def host_arch() -> str:
    return _GO_ARCH.get(platform.machine(), platform.machine())


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """``6.1.0-18-amd64`` → (6, 1); (0, 0) when it cannot be read."""
    found = re.match(r"(\d+)\.(\d+)", release if release is not None else os.uname().release)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def _applies(rule: Mapping[str, Any], caps: Collection[str], arch: str,
             kernel: tuple[int, int]) -> bool:
    """Docker's reading of ``includes`` (all must hold) and ``excludes`` (none may)."""
    includes, excludes = rule.get("includes") or {}, rule.get("excludes") or {}
    if includes.get("arches") and arch not in includes["arches"]:
        return False
    if any(cap not in caps for cap in includes.get("caps") or ()):
        return False
    if includes.get("minKernel") and kernel < _version(includes["minKernel"]):
        return False
    if arch in (excludes.get("arches") or ()):
        return False
    return not any(cap in caps for cap in excludes.get("caps") or ())


def _architectures(profile: Mapping[str, Any], arch: str) -> list[str]:
    native = _SCMP_ARCH.get(arch)
    for entry in profile.get("archMap", []):
        if entry["architecture"] == native:
            return [native, *entry.get("subArchitectures", [])]
    return [native] if native else []


def _oci_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"names": list(rule["names"]), "action": rule["action"]}
    if rule.get("args"):
        out["args"] = [dict(arg) for arg in rule["args"]]
    if rule.get("errnoRet") is not None:
        out["errnoRet"] = rule["errnoRet"]
    return out


def profile(caps: Collection[str], arch: str | None = None,
            kernel: tuple[int, int] | None = None) -> dict[str, Any]:
    """The OCI ``linux.seccomp`` for a container holding ``caps``."""
    source = docker_profile()
    arch = arch or host_arch()
    kernel = kernel or kernel_version()
    rules = [_oci_rule(rule) for rule in source["syscalls"]
             if _applies(rule, caps, arch, kernel)]
    return {
        "defaultAction": source["defaultAction"],
        "defaultErrnoRet": source.get("defaultErrnoRet", 1),
        "architectures": _architectures(source, arch),
        "syscalls": rules,
    }


def allowed_syscalls(seccomp: Mapping[str, Any]) -> set[str]:
    """Names some rule of ``seccomp`` allows (perhaps only for some arguments)."""
    return {name for rule in seccomp["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW"
            for name in rule["names"]}
