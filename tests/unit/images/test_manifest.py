"""Manifest parsing and platform selection."""

from __future__ import annotations

import json
import platform

import pytest

from gpucloud.images import manifest as m
from gpucloud.images.errors import InvalidImage, NoMatchingPlatform

D1, D2, D3 = ("sha256:" + c * 64 for c in "123")


def index_of(*platforms: dict[str, str]) -> m.Index:
    entries = [
        {"mediaType": m.OCI_MANIFEST, "digest": d, "size": 1, "platform": p}
        for d, p in zip((D1, D2, D3), platforms, strict=False)
    ]
    parsed = m.parse_manifest_or_index(json.dumps({"manifests": entries}).encode())
    assert isinstance(parsed, m.Index)
    return parsed


def test_selects_the_hosts_platform_from_an_index() -> None:
    index = index_of(
        {"os": "linux", "architecture": "arm", "variant": "v7"},
        {"os": "linux", "architecture": "arm64", "variant": "v8"},
        {"os": "linux", "architecture": "amd64"},
    )
    assert m.select_platform(index, "img", m.Platform("linux", "amd64")).digest == D3
    assert m.select_platform(index, "img", m.Platform("linux", "arm64")).digest == D2


def test_no_matching_platform_names_the_available_ones() -> None:
    index = index_of(
        {"os": "linux", "architecture": "arm64"},
        {"os": "unknown", "architecture": "unknown"},
        {"os": "windows", "architecture": "amd64"},
    )
    with pytest.raises(NoMatchingPlatform) as caught:
        m.select_platform(index, "ghcr.io/x/y:1", m.Platform("linux", "amd64"))
    assert str(caught.value) == (
        "image ghcr.io/x/y:1 has no variant for linux/amd64 "
        "(available platforms: linux/arm64, windows/amd64)"
    )


def test_config_built_for_another_architecture_is_refused() -> None:
    config = m.parse_config(json.dumps({"os": "linux", "architecture": "arm64"}).encode())
    with pytest.raises(NoMatchingPlatform, match="available platforms: linux/arm64"):
        m.check_config_platform(config, "img", m.Platform("linux", "amd64"))
    m.check_config_platform(config, "img", m.Platform("linux", "arm64"))


@pytest.mark.parametrize(
    ("machine", "expected"),
    [("x86_64", "linux/amd64"), ("aarch64", "linux/arm64"), ("armv7l", "linux/arm/v7")],
)
def test_host_platform_from_machine(
    monkeypatch: pytest.MonkeyPatch, machine: str, expected: str
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert str(m.host_platform()) == expected


def test_docker_and_oci_manifests_parse_alike() -> None:
    for media_type, layer_type in (
        (m.DOCKER_MANIFEST, m.DOCKER_LAYER_GZIP),
        (m.OCI_MANIFEST, m.OCI_LAYER),
    ):
        body = {
            "schemaVersion": 2,
            "mediaType": media_type,
            "config": {"mediaType": "x", "digest": D1, "size": 3},
            "layers": [{"mediaType": layer_type, "digest": D2, "size": 10}],
        }
        parsed = m.parse_manifest_or_index(json.dumps(body).encode())
        assert isinstance(parsed, m.Manifest)
        assert parsed.config.digest == D1 and [layer.digest for layer in parsed.layers] == [D2]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"schemaVersion": 1, "fsLayers": []}, "schema 1"),
        ({"layers": [{"mediaType": "x", "digest": "md5:1", "size": 1}], "config": {}}, "digest"),
        (
            {
                "config": {"digest": D1, "size": 1},
                "layers": [{"mediaType": "foo/bar", "digest": D2, "size": 1}],
            },
            "unsupported type",
        ),
    ],
)
def test_malformed_or_unsupported_manifests_are_refused(
    body: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidImage, match=message):
        m.parse_manifest_or_index(json.dumps(body).encode())


def test_config_fields_for_the_runtime() -> None:
    config = m.parse_config(
        json.dumps(
            {
                "os": "linux",
                "architecture": "amd64",
                "config": {
                    "Entrypoint": ["/bin/sh", "-c"],
                    "Cmd": "echo hi",
                    "Env": ["A=1"],
                    "WorkingDir": "/w",
                    "User": "1000",
                },
                "rootfs": {"type": "layers", "diff_ids": [D1]},
            }
        ).encode()
    )
    assert config.entrypoint == ("/bin/sh", "-c") and config.cmd == ("echo hi",)
    assert config.env == ("A=1",) and config.working_dir == "/w" and config.user == "1000"
    assert config.diff_ids == (D1,)
