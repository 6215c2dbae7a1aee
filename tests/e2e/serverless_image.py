"""A RunPod serverless worker image built from this host, with no image hub: the host's
Python interpreter, the ``runpod`` package installed in this venv (and what it imports),
and a tiny handler (``HANDLER``), as ``runpod.serverless.start`` runs it on RunPod.

What goes in is what a probe process actually loads: it imports ``runpod.serverless``
and reports its modules and the shared objects mapped into it (``/proc/self/maps``). The
image mirrors their host paths (the interpreter finds its library by an absolute
RUNPATH), takes whole top-level packages (for lazy imports inside them), every top-level
module of the standard library and ``lib-dynload``. Modules ship as their compiled
``.pyc`` in place of the source where one exists (sourceless imports: the tar's fixed
mtimes would make every cached ``.pyc`` stale, and compiling at each cold start costs
seconds). Used by ``tests/e2e/test_serverless.py`` and ``bench/serverless.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

from gpucloud.images.testing import (
    BuiltImage,
    Entry,
    build_image,
    busybox_files,
    file,
    make_layer,
    symlink,
)

HANDLER = '''\
"""An echo worker: sleeps ``input.sleep`` seconds, returns the input and its pod."""
import os
import time

import runpod


def handler(job):
    value = job["input"]
    time.sleep(float(value.get("sleep", 0)))
    return {"echo": value.get("value"), "pod": os.environ.get("RUNPOD_POD_ID")}


def streamer(job):
    for n in range(int(job["input"].get("chunks", 3))):
        yield {"chunk": n}


# The SDK fetches the next job only below its concurrency, and re-checks once a second:
# it counts a job just taken twice (queued, in progress): from 3 on a job-take long poll
# is always waiting while one job runs.
CONCURRENCY = int(os.environ.get("WORKER_CONCURRENCY", "1"))
config = {"handler": handler, "concurrency_modifier": lambda current: CONCURRENCY}
if os.environ.get("WORKER_MODE") == "stream":
    config = {"handler": streamer, "return_aggregate_stream": True}
runpod.serverless.start(config)
'''
#: The interpreter, at its host path in the image too.
PYTHON = str(Path(sys.executable).resolve())
_PROBE = """
import json, sys
import runpod, runpod.serverless
from runpod.serverless import worker
from runpod.serverless.modules import rp_job, rp_http, rp_ping, rp_scale, worker_state
import asyncio, concurrent.futures, encodings.idna, http.cookies, uuid
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line.split()[-1]}
files = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
print(json.dumps({"modules": [f for f in files if f], "maps": sorted(maps)}))
"""
_SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
                "site-packages", "pydoc_data"}


def _probe() -> tuple[list[Path], list[Path]]:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    found = json.loads(out.stdout)
    return [Path(p) for p in found["modules"]], [Path(p) for p in found["maps"]]


def _roots() -> tuple[Path, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sites = [Path(p) for p in sys.path if p.endswith("site-packages")]
    return stdlib, sites


def _top_level(path: Path, roots: list[Path]) -> Path | None:
    """The top-level package directory (or single module) of ``path`` under a root."""
    for root in roots:
        if path.is_relative_to(root):
            first = path.relative_to(root).parts[0]
            return root / first
    return None


def _python_files(target: Path, out: dict[str, bytes | str | Entry]) -> None:
    """A module or a package tree, ``.py`` as their cached ``.pyc`` where there is one."""
    paths = [target] if target.is_file() else sorted(target.rglob("*"))
    for path in paths:
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        name = str(path).lstrip("/")
        if path.suffix == ".py":
            cached = path.parent / "__pycache__" / f"{path.stem}.{sys.implementation.cache_tag}.pyc"
            if cached.is_file():
                out[name[:-3] + ".pyc"] = file(cached.read_bytes())
                continue
        out[name] = file(path.read_bytes(), 0o755 if path.stat().st_mode & 0o111 else 0o644)


def worker_files() -> dict[str, bytes | str | Entry]:
    """Every file of the worker's Python, at its host path."""
    modules, maps = _probe()
    stdlib, sites = _roots()
    out: dict[str, bytes | str | Entry] = {}
    tops = {top for m in modules if (top := _top_level(m, [*sites, stdlib])) is not None}
    tops |= {p for p in stdlib.iterdir() if p.suffix == ".py"}
    tops |= {stdlib / "lib-dynload"}
    for top in sorted(tops):
        if top.name not in _SKIP_STDLIB and top.exists():
            _python_files(top, out)
    for site in sites:
        for meta in site.glob("*.dist-info/METADATA"):  # importlib.metadata.version()
            out[str(meta).lstrip("/")] = file(meta.read_bytes())
    _shared_objects(maps, out)
    for loader in [*Path("/lib64").glob("ld-linux*.so*"), *Path("/lib").glob("ld-linux*.so*")]:
        out[str(loader).lstrip("/")] = file(loader.read_bytes(), 0o755)  # PT_INTERP's path
    out[PYTHON.lstrip("/")] = file(Path(PYTHON).read_bytes(), 0o755)
    out["app/handler.py"] = file(HANDLER)
    return out


def _shared_objects(maps: list[Path], out: dict[str, bytes | str | Entry]) -> None:
    """The mapped libraries, and the links by which the loader finds them (their SONAME,
    ``liblzma.so.5`` → ``liblzma.so.5.4.1``)."""
    mapped = {p for p in maps if p.is_file()}
    for shared in mapped:
        out[str(shared).lstrip("/")] = file(shared.read_bytes(), 0o755)
    for folder in {p.parent for p in mapped}:
        for entry in folder.iterdir():
            if entry.is_symlink() and entry.resolve() in mapped:
                out[str(entry).lstrip("/")] = symlink(os.readlink(entry))


def _library_path() -> str:
    return ":".join(sorted({str(p.parent) for p in _probe()[1] if ".so" in p.name}))


@cache
def worker_image() -> BuiltImage:
    """The image (two uncompressed layers: busybox, the worker's Python); built once."""
    site = ":".join(str(p) for p in _roots()[1])
    layers = [make_layer(busybox_files(), "none"), make_layer(worker_files(), "none")]
    return build_image(layers, cmd=[PYTHON, "-u", "/app/handler.py"],
                       env={"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": site,
                            "LD_LIBRARY_PATH": _library_path(),
                            "PYTHONDONTWRITEBYTECODE": "1"})
