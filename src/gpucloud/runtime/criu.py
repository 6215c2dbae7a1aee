"""Can this node take transparent checkpoints? A real dump-and-restore canary decides.

``criu check`` passing is not enough (CRIU issue #1374: "Looks good", then dumps failed),
and Debian's CRIU fails outright on some kernels (3.17 on 6.x: "vdso: Unexpected rt vDSO
area bounds"). So at agent start ``probe`` runs, in order, and stops at the first failure,
whose message becomes the capability's ``criu_reason``:

1. ``criu`` on the PATH, and its version;
2. ``criu check``;
3. a tiny busybox container (the host's static ``/bin/busybox``) counting in a file, run
   with ``runc run -d``, dumped with ``runc checkpoint --image-path``, restored with
   ``runc restore -d`` from that image, and seen counting on from where it was dumped.

``checkpoint`` and ``restore`` are the two runc steps, shared with the agent's use.
Everything the canary makes lives under its own runc root and directory, removed after.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from gpucloud.core.capabilities import NodeCapabilities

BUSYBOX = Path("/bin/busybox")
STEP_TIMEOUT_SECONDS = 30.0
COUNT_WAIT_SECONDS = 5.0
CANARY_ID = "gpucloud-criu-canary"
_COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /count.tmp; mv /count.tmp /count; " \
           "sleep 0.05; done"
_ERROR_LINE = re.compile(r"(^|\) )Error \(")


class CanaryFailed(Exception):
    """A step failed; ``str()`` is the reason reported as ``criu_reason``."""


def probe(work_dir: Path, *, runc: str = "/usr/bin/runc", criu: str | None = None,
          busybox: Path = BUSYBOX) -> NodeCapabilities:
    """The node's CRIU capability, decided by the canary (see the module docstring)."""
    binary = criu or shutil.which("criu")
    cuda = shutil.which("cuda-checkpoint") is not None
    if binary is None:
        return NodeCapabilities(criu=False, criu_reason="criu is not installed",
                                cuda_checkpoint=cuda)
    version = None
    try:
        version = _criu_version(binary)
        _criu_check(binary)
        Canary(work_dir, runc, busybox).run()
    except CanaryFailed as failure:
        return NodeCapabilities(criu=False, criu_reason=str(failure)[:2000],
                                criu_version=version, cuda_checkpoint=cuda)
    return NodeCapabilities(criu=True, criu_version=version, cuda_checkpoint=cuda)


def _run(command: list[str], what: str,
         output: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run one step. A detached container (``run -d``, ``restore -d``) keeps runc's stdio,
    so those steps write to ``output`` (a file) instead of pipes that would never close."""
    try:
        if output is None:
            return subprocess.run(command, capture_output=True, text=True, check=False,
                                  stdin=subprocess.DEVNULL, timeout=STEP_TIMEOUT_SECONDS)
        with output.open("w") as handle:
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT,
                                    check=False, stdin=subprocess.DEVNULL,
                                    timeout=STEP_TIMEOUT_SECONDS)
        return subprocess.CompletedProcess(command, result.returncode,
                                           output.read_text(errors="replace"), "")
    except subprocess.TimeoutExpired:
        raise CanaryFailed(f"{what} did not finish in {STEP_TIMEOUT_SECONDS:.0f} s") from None
    except OSError as error:
        raise CanaryFailed(f"{what}: {error}") from None


def _criu_version(binary: str) -> str:
    result = _run([binary, "--version"], "criu --version")
    if result.returncode != 0:
        raise CanaryFailed(f"criu --version failed: {_last_error(result)}")
    return result.stdout.strip().splitlines()[0].removeprefix("Version: ").strip()


def _criu_check(binary: str) -> None:
    result = _run([binary, "check"], "criu check")
    if result.returncode != 0:
        raise CanaryFailed(f"criu check failed: {_last_error(result)}")


def _last_error(result: subprocess.CompletedProcess[str]) -> str:
    """CRIU's first error line (the cause; later ones are consequences), else the tail."""
    lines = [line.strip() for line in (result.stderr + result.stdout).splitlines()
             if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return (errors[0] if errors else lines[-1] if lines else
            f"exit status {result.returncode}")


class Canary:
    """One busybox container dumped and restored under a private runc root."""

    def __init__(self, work_dir: Path, runc: str, busybox: Path) -> None:
        self.dir = work_dir / "criu-canary"
        self.bundle = self.dir / "bundle"
        self.images = self.dir / "image"
        self.runc = [runc, "--root", str(self.dir / "runc")]
        self.busybox = busybox

    def run(self) -> None:
        self._reset()
        try:
            self._prepare()
            self._step(["run", "-d", "--bundle", str(self.bundle), CANARY_ID], "runc run",
                       output=self.dir / "run.out")
            before = self._wait_count(0)
            checkpoint(self.runc, CANARY_ID, self.images, self.dir / "dump-work")
            restore(self.runc, CANARY_ID, self.bundle, self.images, self.dir / "restore-work")
            self._wait_count(before)
        finally:
            self._step(["delete", "--force", CANARY_ID], "runc delete", check=False)
            shutil.rmtree(self.dir, ignore_errors=True)

    def _reset(self) -> None:
        if (self.dir / "runc").exists():
            self._step(["delete", "--force", CANARY_ID], "runc delete", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _prepare(self) -> None:
        """A rootfs of busybox alone and runc's default spec running the counter."""
        if not self.busybox.is_file():
            raise CanaryFailed(f"{self.busybox} (busybox-static) is missing for the canary")
        rootfs = self.bundle / "rootfs"
        (rootfs / "bin").mkdir(parents=True)
        for name in ("proc", "sys", "dev", "tmp"):
            (rootfs / name).mkdir()
        shutil.copy2(self.busybox, rootfs / "bin" / "busybox")
        for tool in ("sh", "sleep", "mv"):
            (rootfs / "bin" / tool).symlink_to("busybox")
        self._step(["spec", "--bundle", str(self.bundle)], "runc spec")
        config_path = self.bundle / "config.json"
        config = json.loads(config_path.read_text())
        config["process"].update(terminal=False, args=["/bin/sh", "-c", _COUNTER])
        config["root"]["readonly"] = False
        config["linux"]["cgroupsPath"] = f"/gpucloud-criu-canary/{CANARY_ID}"
        config_path.write_text(json.dumps(config))

    def _wait_count(self, above: int) -> int:
        """The counter's value once it is past ``above`` (the process runs on)."""
        deadline = time.monotonic() + COUNT_WAIT_SECONDS
        path = self.bundle / "rootfs" / "count"
        while time.monotonic() < deadline:
            try:
                value = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                value = 0
            if value > above:
                return value
            time.sleep(0.05)
        what = "after restore" if above else "before the dump"
        raise CanaryFailed(f"the canary container did not count on {what} (stuck at {above})")

    def _step(self, args: list[str], what: str, check: bool = True,
              output: Path | None = None) -> None:
        result = _run([*self.runc, *args], what, output)
        if check and result.returncode != 0:
            raise CanaryFailed(f"{what} failed: {_last_error(result)}")


def checkpoint(runc: list[str], container_id: str, image_dir: Path, work_dir: Path, *,
               leave_running: bool = False) -> None:
    """``runc checkpoint``: dump the container's processes into ``image_dir`` (it stops,
    unless ``leave_running``)."""
    image_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    result = _run([*runc, "checkpoint", "--image-path", str(image_dir),
                   "--work-path", str(work_dir),
                   *(["--leave-running"] if leave_running else []), container_id],
                  "runc checkpoint")
    if result.returncode != 0:
        raise CanaryFailed(f"runc checkpoint failed: {_dump_error(result, work_dir)}")


def restore(runc: list[str], container_id: str, bundle: Path, image_dir: Path,
            work_dir: Path) -> None:
    """``runc restore -d``: the container again, from ``image_dir``, detached."""
    work_dir.mkdir(parents=True, exist_ok=True)
    result = _run([*runc, "restore", "-d", "--image-path", str(image_dir),
                   "--work-path", str(work_dir), "--bundle", str(bundle), container_id],
                  "runc restore", output=work_dir / "restore.out")
    if result.returncode != 0:
        raise CanaryFailed(f"runc restore failed: {_dump_error(result, work_dir)}")


def _dump_error(result: subprocess.CompletedProcess[str], work_dir: Path) -> str:
    """runc's message, with CRIU's first error from its log in the work dir."""
    for log in sorted(work_dir.glob("*.log")):
        errors = [line for line in log.read_text(errors="replace").splitlines()
                  if _ERROR_LINE.search(line.strip())]
        if errors:
            return f"{_last_error(result)}; criu: {errors[0].strip()}"
    return _last_error(result)
