"""Image references are normalized the way `docker pull` normalizes them."""

from __future__ import annotations

import pytest

from gpucloud.core.errors import InvalidInput
from gpucloud.images.reference import ImageReference, parse_reference

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("busybox", ImageReference("docker.io", "library/busybox", "latest")),
        ("busybox:1.36", ImageReference("docker.io", "library/busybox", "1.36")),
        ("library/x:tag", ImageReference("docker.io", "library/x", "tag")),
        ("user/app", ImageReference("docker.io", "user/app", "latest")),
        ("index.docker.io/user/app", ImageReference("docker.io", "user/app", "latest")),
        ("ghcr.io/org/app:v1", ImageReference("ghcr.io", "org/app", "v1")),
        ("localhost/app", ImageReference("localhost", "app", "latest")),
        ("localhost:5000/a/b:c", ImageReference("localhost:5000", "a/b", "c")),
        (f"127.0.0.1:5000/a/b@{DIGEST}", ImageReference("127.0.0.1:5000", "a/b", None, DIGEST)),
        (f"app:v2@{DIGEST}", ImageReference("docker.io", "library/app", "v2", DIGEST)),
        ("[::1]:5000/app", ImageReference("[::1]:5000", "app", "latest")),
        ("a/b.c__d-e/f", ImageReference("docker.io", "a/b.c__d-e/f", "latest")),
    ],
)
def test_parses_like_docker(text: str, expected: ImageReference) -> None:
    assert parse_reference(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        " busybox",
        "Busybox",
        "user/App",
        "busybox:",
        "busybox:-bad",
        "a//b",
        "a/-b",
        "busybox@sha256:short",
        "busybox@md5:" + "ab" * 16,
        "ab" * 32,
        "host:port/x",
        "x" * 300,
    ],
)
def test_refuses_malformed_references_naming_the_field(text: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_reference(text)
    assert caught.value.field == "image"


def test_str_round_trips_and_docker_hub_has_its_api_host() -> None:
    ref = parse_reference("busybox")
    assert str(ref) == "docker.io/library/busybox:latest"
    assert parse_reference(str(ref)) == ref
    assert ref.api_registry == "registry-1.docker.io"
    pinned = parse_reference(f"127.0.0.1:5000/a@{DIGEST}")
    assert pinned.reference == DIGEST and pinned.api_registry == "127.0.0.1:5000"
