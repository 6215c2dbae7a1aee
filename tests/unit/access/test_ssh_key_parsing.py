"""OpenSSH public key lines: every accepted format (fingerprints checked against the real
``ssh-keygen -l``), weak RSA and everything else refused naming ``public_key``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import asyncssh
import pytest

from gpucloud.core.errors import InvalidInput
from gpucloud.services.ssh_keys import parse_public_key


def _keygen(tmp_path: Path, kind: str, bits: int | None = None) -> str:
    path = tmp_path / f"key-{kind}-{bits}"
    args = ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", f"me@{kind}", "-f", str(path)]
    if bits:
        args += ["-b", str(bits)]
    subprocess.run(args, check=True)
    return Path(f"{path}.pub").read_text()


def _openssh_fingerprint(tmp_path: Path, line: str) -> str:
    path = tmp_path / "check.pub"
    path.write_text(line)
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return out.split()[1]


@pytest.mark.parametrize(("kind", "bits", "key_type"), [
    ("ed25519", None, "ssh-ed25519"),
    ("ecdsa", 256, "ecdsa-sha2-nistp256"),
    ("ecdsa", 384, "ecdsa-sha2-nistp384"),
    ("ecdsa", 521, "ecdsa-sha2-nistp521"),
    ("rsa", 2048, "ssh-rsa"),
    ("rsa", 3072, "ssh-rsa"),
])
def test_openssh_keys_parse_with_openssh_fingerprints(tmp_path: Path, kind: str,
                                                      bits: int | None, key_type: str) -> None:
    line = _keygen(tmp_path, kind, bits)
    parsed = parse_public_key(line)
    assert parsed.key_type == key_type
    assert parsed.comment == f"me@{kind}"
    assert parsed.fingerprint == _openssh_fingerprint(tmp_path, line)
    assert parsed.line == " ".join(line.split()[:2])


def test_rsa_below_2048_bits_is_refused(tmp_path: Path) -> None:
    line = _keygen(tmp_path, "rsa", 1024)
    with pytest.raises(InvalidInput) as caught:
        parse_public_key(line)
    assert caught.value.field == "public_key" and "2048" in caught.value.message


@pytest.mark.parametrize("text", [
    "",
    "garbage",
    "ssh-ed25519",
    "ssh-ed25519 not-base64!!",
    "ssh-ed25519 AAAAB3NzaC1yc2EAAAADAQABAAAAgQCz",  # truncated and of another type
    "ssh-dss AAAAB3NzaC1kc3MAAACBAP",
    "ssh-ed25519-cert-v01@openssh.com AAAAIHNzaC1lZDI1NTE5LWNlcnQtdjAxQG9wZW5zc2guY29t",
    "-----BEGIN OPENSSH PRIVATE KEY-----",
])
def test_anything_else_is_refused_naming_public_key(text: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_public_key(text)
    assert caught.value.field == "public_key"


def test_a_key_with_a_mismatched_type_name_is_refused() -> None:
    ed = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().split()[1]
    with pytest.raises(InvalidInput, match="public_key"):
        parse_public_key(f"ssh-rsa {ed}")


def test_two_keys_at_once_are_refused(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    first, second = _keygen(tmp_path, "ed25519"), _keygen(tmp_path / "b", "ed25519")
    with pytest.raises(InvalidInput, match="exactly one"):
        parse_public_key(first + second)
