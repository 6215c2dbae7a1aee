from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpucloud.gpu.cdi import ContainerEdits
from gpucloud.gpu.profiles import simulate
from gpucloud.runtime import oci
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig, build_bundle, config_text
from gpucloud.runtime.errors import BundleError, CommandNotFound
from gpucloud.runtime.layout import ContainerPaths


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    for name in ("bin/sh", "usr/bin/python3", "app/serve"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        path.chmod(0o755)
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(
        "root:x:0:0::/root:/bin/sh\nml:x:1000:1000::/home/ml:/bin/sh\n"
    )
    return root


def _build(tmp_path: Path, rootfs: Path, image: ImageConfig | None = None,
           edits: tuple[ContainerEdits, ...] = (), **fields: Any) -> dict[str, Any]:
    spec = ContainerSpec("c1", "pod-1", **fields)
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.53\n")
    bundle = build_bundle(
        ContainerPaths(tmp_path / "bundle"), rootfs, image or ImageConfig(cmd=("sh",)), spec,
        cgroup_path="/gpucloud/test/c1", cdi_edits=edits, resolv_conf=resolv,
    )
    on_disk: dict[str, Any] = json.loads(bundle.paths.config.read_text())
    assert on_disk == bundle.config
    return on_disk


def _env(config: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in config["process"]["env"])


@pytest.mark.parametrize(
    ("entrypoint", "cmd", "command", "argv"),
    [
        ((), ("python3", "-V"), None, ["python3", "-V"]),
        (("python3",), ("-V",), None, ["python3", "-V"]),
        (("python3",), ("-V",), ("train.py", "--fast"), ["python3", "train.py", "--fast"]),
        ((), ("python3",), ("sh", "-c", "exit 1"), ["sh", "-c", "exit 1"]),
        (("python3",), ("-V",), (), ["python3"]),  # an empty pod command clears Cmd
    ],
)
def test_argv_follows_docker(tmp_path: Path, rootfs: Path, entrypoint: tuple[str, ...],
                             cmd: tuple[str, ...], command: tuple[str, ...] | None,
                             argv: list[str]) -> None:
    config = _build(tmp_path, rootfs, ImageConfig(entrypoint=entrypoint, cmd=cmd), command=command)
    assert config["process"]["args"] == argv


def test_image_config_from_a_whole_image_config() -> None:
    image = ImageConfig.from_dict({"architecture": "amd64", "config": {
        "Entrypoint": ["/app/serve"], "Cmd": None, "Env": ["A=1"], "WorkingDir": "/app",
        "User": "ml"}})
    assert image == ImageConfig(("/app/serve",), (), ("A=1",), "/app", "ml")
    assert ImageConfig.from_dict(None) == ImageConfig()


def test_environment_order_and_gpu_variables(tmp_path: Path, rootfs: Path) -> None:
    gpus = simulate("dgx-h100", "n").gpus[:2]
    image = ImageConfig(cmd=("sh",), env=("PATH=/usr/bin:/bin", "A=image", "B=image",
                                          "CUDA_VISIBLE_DEVICES=0"))
    cdi = ContainerEdits(env=("B=cdi", "NVIDIA_VISIBLE_DEVICES=void"))
    config = _build(tmp_path, rootfs, image, (cdi,), env={"A": "pod", "B": "pod"}, gpus=gpus)
    env = _env(config)
    uuids = f"{gpus[0].uuid},{gpus[1].uuid}"
    assert env["A"] == "pod" and env["B"] == "cdi"
    assert env["NVIDIA_VISIBLE_DEVICES"] == uuids and env["CUDA_VISIBLE_DEVICES"] == uuids
    assert env["PATH"] == "/usr/bin:/bin" and env["HOME"] == "/root" and env["HOSTNAME"] == "pod-1"


def test_no_gpus(tmp_path: Path, rootfs: Path) -> None:
    config = _build(tmp_path, rootfs)
    env = _env(config)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    document = json.loads((tmp_path / "bundle" / "run" / "gpus.json").read_text())
    assert document["gpus"] == [] and document["count"] == 0


def test_isolation_limits_and_mounts(tmp_path: Path, rootfs: Path) -> None:
    config = _build(tmp_path, rootfs, cpu_milli=2500, memory_bytes=8 * 1024**3, pids_limit=4096)
    linux = config["linux"]
    assert [ns["type"] for ns in linux["namespaces"]] == ["pid", "ipc", "uts", "mount", "network"]
    assert linux["cgroupsPath"] == "/gpucloud/test/c1"
    assert linux["resources"]["cpu"] == {"shares": 2560, "quota": 250_000, "period": 100_000}
    assert linux["resources"]["memory"] == {"limit": 8 * 1024**3, "swap": 8 * 1024**3}
    assert linux["resources"]["pids"] == {"limit": 4096}
    assert linux["resources"]["devices"] == [{"allow": False, "access": "rwm"}]
    assert "/proc/kcore" in linux["maskedPaths"] and "/proc/sys" in linux["readonlyPaths"]
    process = config["process"]
    assert process["noNewPrivileges"] is True and process["terminal"] is False
    assert process["capabilities"]["bounding"] == list(oci.DEFAULT_CAPABILITIES)
    assert "CAP_SYS_ADMIN" not in process["capabilities"]["effective"]
    assert {limit["type"] for limit in process["rlimits"]} == {"RLIMIT_NOFILE", "RLIMIT_MEMLOCK"}
    mounts = {mount["destination"]: mount for mount in config["mounts"]}
    assert {"/proc", "/dev", "/dev/pts", "/dev/shm", "/sys", "/etc/resolv.conf", "/etc/hosts",
            "/etc/hostname", "/run/gpucloud"} <= set(mounts)
    assert f"size={8 * 1024**3}" in mounts["/dev/shm"]["options"]
    assert "ro" in mounts["/run/gpucloud"]["options"]
    assert mounts["/run/gpucloud"]["source"] == str(tmp_path / "bundle" / "run")
    etc = tmp_path / "bundle" / "etc"
    assert (etc / "resolv.conf").read_text() == "nameserver 127.0.0.53\n"
    assert "127.0.1.1\tpod-1" in (etc / "hosts").read_text()
    assert config["hostname"] == "pod-1" and config["ociVersion"] == "1.0.2"


def test_host_network_and_unlimited_resources(tmp_path: Path, rootfs: Path) -> None:
    config = _build(tmp_path, rootfs, host_network=True)
    assert "network" not in [ns["type"] for ns in config["linux"]["namespaces"]]
    assert set(config["linux"]["resources"]) == {"devices"}


def test_user_and_working_dir(tmp_path: Path, rootfs: Path) -> None:
    image = ImageConfig(entrypoint=("./serve",), working_dir="/app", user="ml")
    config = _build(tmp_path, rootfs, image)
    assert config["process"]["cwd"] == "/app"
    assert config["process"]["user"] == {"uid": 1000, "gid": 1000}
    assert _env(config)["HOME"] == "/home/ml"
    with pytest.raises(BundleError, match="not an absolute path"):
        _build(tmp_path, rootfs, image, working_dir="app")


def test_command_not_found_uses_the_container_path(tmp_path: Path, rootfs: Path) -> None:
    with pytest.raises(CommandNotFound, match="^command not found: serve$"):
        _build(tmp_path, rootfs, command=("serve",))
    config = _build(tmp_path, rootfs, command=("serve",), env={"PATH": "/app"})
    assert config["process"]["args"] == ["serve"]


def test_missing_command_and_rootfs(tmp_path: Path, rootfs: Path) -> None:
    with pytest.raises(BundleError, match="no command"):
        _build(tmp_path, rootfs, ImageConfig())
    with pytest.raises(BundleError, match="does not exist"):
        _build(tmp_path, tmp_path / "missing")


@pytest.mark.parametrize(
    ("milli", "expected"),
    [(0, {}), (1, {"shares": 2, "quota": 1000, "period": 100_000}),
     (500, {"shares": 512, "quota": 50_000, "period": 100_000})],
)
def test_cpu_resources(milli: int, expected: dict[str, int]) -> None:
    assert oci.cpu_resources(milli) == expected


def test_nofile_limit_respects_the_kernel_ceiling(tmp_path: Path) -> None:
    nr_open = tmp_path / "nr_open"
    nr_open.write_text("1024\n")
    assert oci.nofile_limit(nr_open) == 1024


def test_config_json_holds_the_seccomp_profile_spliced_in_as_text(
        tmp_path: Path, rootfs: Path) -> None:
    """The profile is written from the process's cached text (s46), and the rest of the
    file is the config, whatever the pod's own strings look like and whatever the CDI
    edits add after ``linux``."""
    hook = {"hookName": "createRuntime", "path": "/usr/bin/hook", "args": ["hook", "x"]}
    tricky = '"}, "seccomp": {}, "x": "{'
    config = _build(tmp_path, rootfs, edits=(ContainerEdits.model_validate({"hooks": [hook]}),),
                    env={"TRICKY": tricky}, labels={"note": tricky})
    assert config["linux"]["seccomp"] == oci.seccomp_profile()
    assert config["hooks"]["createRuntime"] == [{"path": "/usr/bin/hook",
                                                 "args": ["hook", "x"]}]
    assert _env(config)["TRICKY"] == tricky
    assert config["annotations"] == {"gpucloud.note": tricky}


def test_a_config_whose_profile_was_replaced_is_written_as_it_is() -> None:
    profile = oci.seccomp_profile()
    profile["defaultAction"] = "SCMP_ACT_KILL"
    config = {"ociVersion": oci.OCI_VERSION, "linux": {"seccomp": profile}}
    assert json.loads(config_text(config)) == config
    assert json.loads(config_text({"ociVersion": "1", "linux": {}})) == {
        "ociVersion": "1", "linux": {}}
    shared = {"linux": {"seccomp": oci.shared_seccomp_profile()}}
    assert json.loads(config_text(shared)) == shared
