"""Benchmark: a pod's start from an image pulled in full vs lazily (eStargz), on a slow link.

The image (≥ 1 GiB; ``--quick``: about 200 MB) has three layers:

* busybox (the shell that runs the start script);
* a Python-like tree: the files of real installed wheels (this venv's site-packages, whole
  packages in name order up to the tree size), plus ``/app/start.sh`` and its read list;
* ``/models/weights.bin``: incompressible random bytes.

The start reads about 5 % of the image's bytes: every file of the first packages of the
tree up to 2 % of the image (an ``import`` of a few packages: many small files), then the
weights file's first 64 KiB (a header) and one contiguous slice of 3 % of the image from its
middle (one shard loaded), then prints ``READY``.

Both forms are pushed to Debian's ``docker-registry``, which runs in a network namespace
this benchmark creates, behind a veth whose two ends are shaped to 1 Gbit/s by ``tbf``.
The kernel here has no ``sch_netem`` (not built, no modules to load), so the round-trip
delay is added by a relay on 127.0.0.1 in front of the registry (``relay``): every chunk it
forwards is delivered RTT/2 after it arrived, in each direction, pipelined (the delay does
not cap the rate). The relay's throughput is measured first and reported
(``link.relay_mb_per_s``), and it counts the bytes it forwards from the registry.

Each run is a cold node: a new agent with an empty state directory (so an empty chunk
cache), its lazyfs daemon started (once per node boot on a real node: supervised by the
agent, it outlives pods; its start is timed and reported on its own,
``lazyfs_daemon_start_seconds_p50``), the page cache dropped
(``/proc/sys/vm/drop_caches``), then pod create → ``READY`` served by the pod-logs API
(waiting reads, as ``gpucloud pod logs -f`` and bench/pod_start.py follow a log;
``--short-poll``: a read every 10 ms, the series' way until 2026-12-07). After each run
the node's daemon is stopped: it outlives its agent by design, and a finished run's daemon
would otherwise go on prefetching into the next run's link, CPU and byte counts. Reported
per form and RTT: p50/p95 over the runs, the CPU seconds of the node's processes (the
agent and its descendants, and any process naming the node's state directory: the lazyfs
daemon), and the registry bytes the relay forwarded before ``READY``. Then, on the last 2
ms run of each form, the files are read once whole (fully cached: local disk, or the lazy
chunk cache, after the daemon's bulk prefetch is done) and, page cache dropped before
each, read again from the host through the pod's root filesystem: sequential (1 MiB
reads), 4 KiB random reads, and a stat/readdir walk of the tree.

The lazy form is ``gpucloud.images.lazy.optimize`` of the ordinary image, the read files
prioritized (level 1: incompressible weights gain nothing from more), large files in 1 MiB
chunks (``--chunk-mib``; a chunk is the smallest verifiable fetch unit, so it bounds what a
partial read of the weights file fetches; the converter's default is eStargz's 4 MiB).
Whether a node really mounted it lazily is checked (FUSE mounts under its state
directory); when not, the lazy figures are reported as not measured, with the reason,
never as a result.

Building both forms (random weights, gzip, the conversion) takes minutes at full size, so
they are kept as OCI layouts in an image cache (``--image-cache``, default
``/var/tmp/gpucloud-lazybench-images``), one directory per recipe key: a digest of the
sizes, the file mix's names and contents, the weights' seed, the converter's options and
source, Python's and zlib's versions and ``RECIPE_VERSION``. ``--prepare-only`` builds the
entry (if it is not there) and exits; a measured run reuses a matching entry (or builds it
first), then pushes both layouts into the fresh registry it starts, so what is measured is
unchanged: a cold registry, a cold node, an empty chunk cache. Whether the image came from
the cache, and its key, are printed and written (``image_source``).

    .venv/bin/python bench/lazy_pull.py [--quick] --prepare-only
    .venv/bin/python bench/lazy_pull.py [--quick] [--runs 5] [--rtt-ms 2 20]

Needs root, runc, busybox-static, docker-registry, iproute2 with ``tbf``. Writes
bench/results/lazy_pull.json (``speedup``: full p50 / lazy p50 at 1 Gbit/s and 2 ms;
``fetched_over_read``: registry bytes before READY / bytes the start read).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.cluster import Cloud, clean_node, running_cloud  # noqa: E402

from gpucloud.images.client import RegistryClient  # noqa: E402
from gpucloud.images.lazy import trace  # noqa: E402
from gpucloud.images.lazy.client import LazyfsClient  # noqa: E402
from gpucloud.images.lazy.optimize import OptimizeOptions, optimize  # noqa: E402
from gpucloud.images.testing import (  # noqa: E402
    Entry,
    build_image,
    busybox_files,
    make_layer,
)

RESULTS = ROOT / "bench" / "results" / "lazy_pull.json"
PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE_PACKAGES = ROOT / ".venv" / "lib" / PYTHON / "site-packages"
TREE_ROOT = "app/lib/python3/site-packages"
WEIGHTS = "models/weights.bin"
READY = "READY"
MiB = 1 << 20
NETNS = "gpucloud-lazybench"
HOST_VETH, NS_VETH = "lzb-host", "lzb-ns"
HOST_IP, NS_IP, REGISTRY_PORT = "10.231.77.1", "10.231.77.2", 5000
RATE = "1gbit"
RELAY_CHUNK = 256 * 1024
RELAY_QUEUE_BYTES = 32 * MiB
CMD = ("sh", "/app/start.sh")
WEIGHTS_SEED = 7
CONVERT_LEVEL = 1
IMAGE_CACHE = Path("/var/tmp/gpucloud-lazybench-images")
#: Bump when the bench changes the image in a way ``image_recipe`` does not see.
RECIPE_VERSION = 1
#: The project's code that shapes the image's bytes (layer writer, converter).
IMAGE_CODE = ("gpucloud/images/testing.py", "gpucloud/images/lazy/optimize.py",
              "gpucloud/images/lazy/estargz.py", "gpucloud/images/lazy/toc.py",
              "gpucloud/images/lazy/footer.py")


# -- the image ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    tree: dict[str, bytes]
    weights_bytes: int
    read_files: list[str]
    slice_skip_mib: int
    slice_mib: int

    @property
    def total_bytes(self) -> int:
        return sum(len(data) for data in self.tree.values()) + self.weights_bytes

    @property
    def read_bytes(self) -> int:
        files = sum(len(self.tree[name.lstrip("/")]) for name in self.read_files)
        return files + 64 * 1024 + self.slice_mib * MiB


def python_tree(limit: int) -> dict[str, bytes]:
    """Whole packages (directories) of this venv's site-packages in name order, each that
    still fits, up to ``limit`` bytes."""
    tree: dict[str, bytes] = {}
    size = 0
    for top in sorted(p for p in SITE_PACKAGES.iterdir() if p.is_dir() and not p.is_symlink()):
        paths = sorted(p for p in top.rglob("*") if p.is_file() and not p.is_symlink())
        package = sum(p.stat().st_size for p in paths)
        if size + package > limit:
            continue
        for path in paths:
            tree[f"{TREE_ROOT}/{path.relative_to(SITE_PACKAGES)}"] = path.read_bytes()
        size += package
    return tree


def workload(total_bytes: int) -> Workload:
    tree = python_tree(int(total_bytes * 0.3))
    weights = (total_bytes - sum(len(d) for d in tree.values())) // MiB * MiB
    budget, read, used = int(total_bytes * 0.02), [], 0
    for name, data in tree.items():  # name order: whole packages first to last
        if used >= budget:
            break
        if not any(c.isspace() for c in name):
            read.append("/" + name)
            used += len(data)
    slice_mib = max(1, int(total_bytes * 0.03) // MiB)
    return Workload(tree, weights, read, (weights // MiB - slice_mib) // 2, slice_mib)


def start_script(work: Workload) -> str:
    return (
        "#!/bin/sh\n"
        "xargs cat < /app/startup.list > /dev/null\n"
        f"dd if=/{WEIGHTS} of=/dev/null bs=65536 count=1 2>/dev/null\n"
        f"dd if=/{WEIGHTS} of=/dev/null bs=1048576 skip={work.slice_skip_mib} "
        f"count={work.slice_mib} 2>/dev/null\n"
        f"echo {READY}\n"
        "exec sleep 3600\n"
    )


def app_files(work: Workload) -> dict[str, bytes | str]:
    """The tree layer: the tree, the start script and its read list."""
    app: dict[str, bytes | str] = dict(work.tree)
    app["app/start.sh"] = start_script(work)
    app["app/startup.list"] = "".join(f"{name}\n" for name in work.read_files)
    return app


def prefetch_list(work: Workload) -> tuple[str, ...]:
    """The files the start reads whole, in the order a recording (`image optimize
    --record`, which sees exec'd binaries too) lists them: the shell that runs the script,
    the script and its list, the imports. The weights file, read in part, is left to
    on-demand reads (a recording would place it whole)."""
    return ("/bin/busybox", "/app/start.sh", "/app/startup.list", *work.read_files)


def _random_bytes(size: int, seed: int = WEIGHTS_SEED) -> bytes:
    """``size`` incompressible bytes, made in 64 MiB pieces (``randbytes`` of more than
    256 MiB overflows: it asks ``getrandbits`` for over 2**31 bits)."""
    rng = random.Random(seed)
    piece = 64 * MiB
    return b"".join(rng.randbytes(min(piece, size - at)) for at in range(0, size, piece))


# -- the image cache: both forms as OCI layouts, keyed by their recipe -------------------


def _files_digest(files: Mapping[str, bytes | str | Entry]) -> str:
    """sha256 over names and contents (an ``Entry``: its repr, data included)."""
    digest = hashlib.sha256()
    for name in sorted(files):
        value = files[name]
        data = value.encode() if isinstance(value, str) else (
            value if isinstance(value, bytes) else repr(value).encode())
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def image_recipe(work: Workload, chunk_size: int) -> dict[str, Any]:
    """Everything the two forms' bytes follow from: sizes, the file mix (contents hashed),
    the weights' seed, the converter's options and code, and the bench's recipe version."""
    code = hashlib.sha256()
    for module in IMAGE_CODE:
        code.update((ROOT / "src" / module).read_bytes())
    return {"version": RECIPE_VERSION, "total_bytes": work.total_bytes,
            "base_digest": _files_digest(busybox_files()),
            "app_files": len(work.tree) + 2, "app_digest": _files_digest(app_files(work)),
            "weights_bytes": work.weights_bytes, "weights_seed": WEIGHTS_SEED,
            "cmd": list(CMD), "prefetch_digest": _files_digest(
                {str(i): name for i, name in enumerate(prefetch_list(work))}),
            "estargz": {"level": CONVERT_LEVEL, "chunk_size": chunk_size},
            "code_digest": code.hexdigest(), "python": platform.python_version(),
            "zlib": zlib.ZLIB_RUNTIME_VERSION, "machine": platform.machine()}


def recipe_key(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PreparedImage:
    """Both forms as OCI layouts under ``root`` (``full/``, ``esgz/``)."""

    root: Path
    key: str
    from_cache: bool
    #: The full form's weights layer (the link's proof fetches it).
    weights_digest: str
    #: When it was built, and what building and converting took then.
    meta: dict[str, Any]


def prepare_image(cache: Path, work: Workload, chunk_size: int) -> PreparedImage:
    """The cache's entry for this recipe, built first when there is none. An entry is built
    under a temporary name and renamed into place whole, its ``meta.json`` (which holds the
    recipe) written last, so a half-built entry is never taken for one."""
    recipe = image_recipe(work, chunk_size)
    key = recipe_key(recipe)
    entry = cache / key
    meta = _entry_meta(entry, recipe)
    if meta is not None:
        return PreparedImage(entry, key, True, meta["weights_digest"], meta)
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{key}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        meta = build_layouts(partial, work, chunk_size)
        meta.update(key=key, recipe=recipe)
        (partial / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(entry, ignore_errors=True)  # an entry without valid meta: incomplete
        partial.rename(entry)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return PreparedImage(entry, key, False, meta["weights_digest"], meta)


def _entry_meta(entry: Path, recipe: dict[str, Any]) -> dict[str, Any] | None:
    try:
        meta: dict[str, Any] = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    complete = all((entry / form / "index.json").is_file() for form in ("full", "esgz"))
    return meta if complete and meta.get("recipe") == recipe else None


def build_layouts(root: Path, work: Workload, chunk_size: int) -> dict[str, Any]:
    """Build the ordinary (gzip) form as an OCI layout ``root/full``, convert it with the
    project's converter (what `gpucloud image optimize` runs) into ``root/esgz``, large
    files cut into ``chunk_size`` chunks (the smallest verifiable fetch unit)."""
    started = time.perf_counter()
    layers = [make_layer(busybox_files()), make_layer(app_files(work)),
              make_layer({WEIGHTS: _random_bytes(work.weights_bytes)})]
    build_image(layers, cmd=CMD).write_oci_layout(root / "full")
    built = time.perf_counter()
    options = OptimizeOptions(level=CONVERT_LEVEL, chunk_size=chunk_size,
                              prefetch=prefetch_list(work))
    with RegistryClient() as client:
        optimize(str(root / "full"), str(root / "esgz"), options, client)
    return {"weights_digest": layers[-1].digest,
            "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(built - started, 1),
            "convert_seconds": round(time.perf_counter() - built, 1)}


def push_layout(client: RegistryClient, registry: str, layout: Path, reference: str) -> None:
    """Push the one image of an OCI layout as ``repository:tag`` (blobs streamed from their
    files; the registry checks each one's digest, so a damaged cache fails here)."""
    repository, tag = reference.rsplit(":", 1)
    entry = json.loads((layout / "index.json").read_text())["manifests"][0]
    manifest = _blob(layout, entry["digest"]).read_bytes()
    parsed = json.loads(manifest)
    for desc in (parsed["config"], *parsed["layers"]):
        if not client.blob_exists(registry, repository, desc["digest"]):
            client.upload_blob(registry, repository, _blob(layout, desc["digest"]),
                               desc["digest"])
    client.put_manifest(registry, repository, tag, manifest, entry["mediaType"])


def _blob(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def image_source(prepared: PreparedImage, cached: bool) -> dict[str, Any]:
    """What the JSON says of where the image came from (``prepared``: when the entry was
    built and what building and converting took then, in this run or an earlier one)."""
    return {"from_cache": prepared.from_cache, "key": prepared.key,
            "cache_dir": str(prepared.root.parent) if cached else None,
            "prepared": {name: prepared.meta[name]
                         for name in ("prepared_at", "build_seconds", "convert_seconds")},
            "recipe": prepared.meta["recipe"]}


# -- the link: a namespace, tbf, the registry and the delay relay -----------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def shaped_registry(workdir: Path) -> Iterator[str]:
    """docker-registry in a new namespace behind a 1 Gbit/s veth; yields ``IP:PORT``."""
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)
    _ip("netns", "add", NETNS)
    try:
        _ip("link", "add", HOST_VETH, "type", "veth", "peer", "name", NS_VETH, "netns", NETNS)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_VETH)
        _ip("link", "set", HOST_VETH, "up")
        _ip("-n", NETNS, "addr", "add", f"{NS_IP}/30", "dev", NS_VETH)
        _ip("-n", NETNS, "link", "set", NS_VETH, "up")
        _ip("-n", NETNS, "link", "set", "lo", "up")
        for netns, dev in ((None, HOST_VETH), (NETNS, NS_VETH)):
            prefix = ["ip", "netns", "exec", netns] if netns else []
            subprocess.run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                            RATE, "burst", "256kb", "latency", "50ms"], check=True,
                           capture_output=True)
        config = {"version": 0.1, "log": {"level": "error", "accesslog": {"disabled": True}},
                  "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}},
                  "http": {"addr": f"{NS_IP}:{REGISTRY_PORT}"}}
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "registry.yml").write_text(json.dumps(config))
        registry = subprocess.Popen(["ip", "netns", "exec", NETNS, "docker-registry", "serve",
                                     str(workdir / "registry.yml")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_http(f"http://{NS_IP}:{REGISTRY_PORT}/v2/", registry)
            yield f"{NS_IP}:{REGISTRY_PORT}"
        finally:
            registry.terminate()
            registry.wait(10)
    finally:
        subprocess.run(["ip", "link", "del", HOST_VETH], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True, check=False)


def _wait_http(url: str, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            if time.monotonic() > deadline or (process and process.poll() is not None):
                raise RuntimeError(f"{url} did not answer") from None
            time.sleep(0.05)


class Relay:
    """A TCP relay on 127.0.0.1 adding ``delay`` one way in each direction (a process)."""

    def __init__(self, target: str) -> None:
        context = multiprocessing.get_context("fork")
        self.delay: Synchronized[float] = context.Value("d", 0.0)
        self.down: Synchronized[int] = context.Value("Q", 0)
        ready = context.Event()
        self.port_value: Synchronized[int] = context.Value("i", 0)
        host, port = target.split(":")
        self.process = context.Process(target=_relay_main, daemon=True,
                                       args=(host, int(port), self.delay, self.down,
                                             self.port_value, ready))
        self.target = target
        self.process.start()
        if not ready.wait(10):
            raise RuntimeError("the relay did not start")
        self.host = f"127.0.0.1:{self.port_value.value}"

    def set_rtt(self, rtt_ms: float) -> None:
        self.delay.value = rtt_ms / 2000

    @property
    def bytes_down(self) -> int:
        return int(self.down.value)

    def close(self) -> None:
        self.process.terminate()
        self.process.join(5)


def _relay_main(host: str, port: int, delay: Synchronized[float], down: Synchronized[int],
                port_value: Synchronized[int], ready: Any) -> None:
    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   count: bool) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        queued = [0]
        room = asyncio.Event()
        room.set()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()
                if count:
                    with down.get_lock():
                        down.value += len(data)
                queued[0] -= len(data)
                if queued[0] < RELAY_QUEUE_BYTES:
                    room.set()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                await room.wait()
                data = await reader.read(RELAY_CHUNK)
                queue.put_nowait((time.monotonic() + delay.value, data))
                if not data:
                    break
                queued[0] += len(data)
                if queued[0] >= RELAY_QUEUE_BYTES:
                    room.clear()
            await task
        except (ConnectionError, OSError):
            task.cancel()
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pump(reader, up_writer, False), pump(up_reader, writer, True),
                             return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=RELAY_CHUNK)
        port_value.value = server.sockets[0].getsockname()[1]
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


def link_throughput(relay: Relay, digest: str, repository: str, rtt_ms: float,
                    host: str | None = None) -> float:
    """MB/s of one blob GET through the relay at ``rtt_ms`` (the link's proof); ``host``:
    straight to the registry over the shaped veth instead."""
    relay.set_rtt(rtt_ms)
    start = time.perf_counter()
    size = 0
    with httpx.stream("GET", f"http://{host or relay.host}/v2/{repository}/blobs/{digest}",
                      timeout=120) as response:
        for chunk in response.iter_bytes(MiB):
            size += len(chunk)
    return round(size / (time.perf_counter() - start) / 1e6, 1)


# -- runs ----------------------------------------------------------------------------------


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def node_cpu_seconds(agent_pid: int, state_dir: Path) -> float:
    """utime+stime of the agent, its descendants and processes naming its state dir."""
    tick = os.sysconf("SC_CLK_TCK")
    marker = str(state_dir).encode()
    total = 0.0
    pids = _descendants(agent_pid)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _descendants(pid: int) -> set[int]:
    found, todo = {pid}, [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def fuse_mounts_under(path: Path) -> int:
    prefix = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        return sum(1 for line in mounts if line.split()[2].startswith("fuse")
                   and line.split()[1].startswith(prefix))


@dataclass
class Run:
    seconds: float
    cpu_seconds: float
    bytes_fetched: int
    lazy_mounts: int
    #: Of ``bytes_fetched``: what the lazyfs daemon fetched as background prefetch.
    prefetched: int = 0
    #: Of ``prefetched``: the prioritized files (the landmark prefix).
    prefetched_priority: int = 0
    #: Seconds the node's lazyfs daemon took to start (before the timed create).
    daemon_start_seconds: float = 0.0


def lazyfs_prefetched(state_dir: Path) -> tuple[int, int]:
    """Bytes the node's lazyfs daemon fetched in the background so far, and of those the
    prioritized files' ((0, 0): no daemon); asked directly on its control socket
    (``images/lazy/daemon``), starting nothing."""
    path = state_dir / "lazyfs" / "control.sock"
    if not path.exists():
        return 0, 0
    layers = _lazyfs_request(path, {"op": "status"}).get("layers", {})  # by layer digest
    return (sum(int(layer.get("prefetched", 0)) for layer in layers.values()),
            sum(int(layer.get("prefetched_priority", 0)) for layer in layers.values()))


LOG_POLL_SECONDS = 0.01


def wait_ready(cloud: Cloud, pod_id: str, name: str, deadline: float, long_poll: bool) -> None:
    """Until the pod's log holds ``READY``: ``long_poll``, waiting reads of the logs API
    (``wait``, each answered as soon as output past the offset is committed), else a read
    every ``LOG_POLL_SECONDS`` (the series' way from 2026-12-01 to 12-07). The bench's API
    server runs on the node's two cores: polled every 10 ms it took 0.85-0.97 CPU-s of a
    ~2.2 s lazy start (s46), CPU the node then lacks; a long poll costs one request per
    output."""
    text, offset, attempt = "", 0, None
    while READY not in text:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{name}: no {READY} in 900 s: {cloud.client.get_pod(pod_id)}")
        if not long_poll:
            text = cloud.client.pod_logs(pod_id).text
            if READY not in text:
                time.sleep(LOG_POLL_SECONDS)
            continue
        got = cloud.client.pod_logs(pod_id, offset=offset, attempt=attempt, wait=5)
        text, offset, attempt = text + got.text, got.next_offset, got.attempt
        if got.finished and READY not in text:
            raise RuntimeError(f"{name}: the pod finished without {READY}: {text[-200:]!r}")


def cold_run(cloud: Cloud, relay: Relay, image: str, name: str,
             measure_reads: Workload | None, trace_to: Path | None = None,
             long_poll: bool = False) -> tuple[Run, dict[str, Any] | None]:
    trace.set_path(str(trace_to) if trace_to else None)  # before the agent and daemon start
    agent = cloud.agent(name)
    assert agent.process is not None
    try:
        # The node's lazyfs daemon runs before the pod, as on a real node (supervised by the
        # agent, it outlives pods); its start, once per node boot, is timed on its own.
        started = time.perf_counter()
        LazyfsClient(agent.state_dir).ensure_running()
        daemon_seconds = time.perf_counter() - started
        drop_caches()
        before_bytes = relay.bytes_down
        before_cpu = node_cpu_seconds(agent.process.pid, agent.state_dir)
        start = time.perf_counter()
        trace.mark("bench.create")
        pod = cloud.create_pod(name, image, ["sh", "/app/start.sh"])
        wait_ready(cloud, pod.id, name, start + 900, long_poll)
        seconds = time.perf_counter() - start
        trace.mark("bench.ready")
        fetched = relay.bytes_down - before_bytes
        prefetched, priority = lazyfs_prefetched(agent.state_dir)
        cpu = node_cpu_seconds(agent.process.pid, agent.state_dir) - before_cpu
        run = Run(round(seconds, 3), round(cpu, 2), fetched, fuse_mounts_under(agent.state_dir),
                  prefetched, priority, round(daemon_seconds, 3))
        reads = None
        if measure_reads is not None:
            rootfs = next(agent.state_dir.glob(f"containers/{pod.id}-*/rootfs"))
            waited = wait_prefetched(agent.state_dir)
            reads = {**cached_reads(rootfs, measure_reads),
                     "prefetch_wait_seconds": round(waited, 1)}
        cloud.client.delete_pod(name)
        return run, reads
    finally:
        # Cordoned first: until its lease lapses the node looks Ready, and the next run's
        # pod must go to the next (cold) node.
        cloud.client.cordon(name)
        agent.terminate()
        stop_lazyfs(agent.state_dir)
        clean_node(agent.state_dir)


def wait_prefetched(state_dir: Path, timeout: float = 240.0) -> float:
    """Seconds until the node's lazyfs daemon has fetched every mounted layer whole (its
    bulk prefetch, after ``READY``), at most ``timeout``; at once for a full pull. Reading
    every file through the mount (``cached_reads`` makes them all local first) then copies
    from the chunk cache, instead of fetching each of the tree's 19,000 files with a
    demand read of its own."""
    path = state_dir / "lazyfs" / "control.sock"
    start = time.perf_counter()
    while path.exists() and time.perf_counter() - start < timeout:
        layers = _lazyfs_request(path, {"op": "status"}).get("layers", {})
        if all(layer.get("prefetch_done") for layer in layers.values()):
            break
        time.sleep(0.5)
    return time.perf_counter() - start


def stop_lazyfs(state_dir: Path) -> None:
    """Stop the node's lazyfs daemon (it outlives its agent by design): a finished run's
    daemon must not go on prefetching into the next run's link, CPU and byte counts."""
    LazyfsClient(state_dir).shutdown()


def _lazyfs_request(path: Path, request: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(json.dumps(request).encode() + b"\n")
        reply: dict[str, Any] = json.loads(sock.makefile("rb").readline())
    return reply


def cached_reads(rootfs: Path, work: Workload) -> dict[str, Any]:
    """Read throughput of fully cached files through ``rootfs``, page cache dropped first."""
    weights = rootfs / WEIGHTS
    _read_all(weights)  # fully cached from here on (local disk or the chunk cache)
    for name in work.tree:
        _read_all(rootfs / name)
    dropped = drop_caches()
    start = time.perf_counter()
    size = _read_all(weights)
    sequential = size / (time.perf_counter() - start) / 1e6
    drop_caches()
    offsets = random.Random(3).sample(range(work.weights_bytes // 4096), 2000)
    start = time.perf_counter()
    with weights.open("rb", buffering=0) as handle:
        for offset in offsets:
            os.pread(handle.fileno(), 4096, offset * 4096)
    random_seconds = time.perf_counter() - start
    drop_caches()
    start = time.perf_counter()
    entries = 0
    for directory, dirs, files in os.walk(rootfs / TREE_ROOT):
        for entry in (*dirs, *files):
            os.lstat(os.path.join(directory, entry))
            entries += 1
    walk_seconds = time.perf_counter() - start
    return {"page_cache_dropped": dropped,
            "sequential_mb_per_s": round(sequential, 1),
            "random_4k_reads_per_s": round(len(offsets) / random_seconds),
            "walk_entries_per_s": round(entries / walk_seconds), "walk_entries": entries}


def _read_all(path: Path) -> int:
    size = 0
    with path.open("rb", buffering=0) as handle:
        while chunk := handle.read(MiB):
            size += len(chunk)
    return size


def summary(runs: list[Run]) -> dict[str, Any]:
    seconds = sorted(r.seconds for r in runs)
    return {
        "runs": len(runs), "p50_seconds": round(statistics.median(seconds), 3),
        "p95_seconds": round(_percentile(seconds, 0.95), 3), "all_seconds": seconds,
        "cpu_seconds_p50": round(statistics.median(r.cpu_seconds for r in runs), 2),
        "bytes_fetched_p50": int(statistics.median(r.bytes_fetched for r in runs)),
        "prefetched_bytes_p50": int(statistics.median(r.prefetched for r in runs)),
        "bytes_fetched_without_prefetch_p50": int(statistics.median(
            r.bytes_fetched - r.prefetched for r in runs)),
        "bytes_fetched_without_bulk_prefetch_p50": int(statistics.median(
            r.bytes_fetched - r.prefetched + r.prefetched_priority for r in runs)),
        "lazy_mounts": max(r.lazy_mounts for r in runs),
        "lazyfs_daemon_start_seconds_p50": round(statistics.median(
            r.daemon_start_seconds for r in runs), 3),
    }


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with 5 runs, p95 is the slowest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


# -- main ----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="a ~200 MB image (< 5 min)")
    parser.add_argument("--runs", type=int, default=5, help="cold runs per form and RTT")
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[2.0, 20.0])
    parser.add_argument("--mb", type=int, help="image size in MB (default 1100, quick 200)")
    parser.add_argument("--chunk-mib", type=float, default=1.0,
                        help="eStargz chunk size of large files (converter default: 4)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="where the JSON goes (default bench/results/lazy_pull.json)")
    parser.add_argument("--forms", nargs="+", choices=("full", "lazy"),
                        default=["full", "lazy"], help="which forms to run (default both)")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="write each run's timeline (GPUCLOUD_LAZY_TRACE) under DIR and "
                        "report its phases (images/lazy/trace.py)")
    parser.add_argument("--image-cache", type=Path, default=IMAGE_CACHE, metavar="DIR",
                        help="where both forms are kept as OCI layouts, keyed by the image's "
                        f"recipe, and reused when it matches (default {IMAGE_CACHE})")
    parser.add_argument("--no-image-cache", action="store_true",
                        help="build the image in this run's temporary directory, keep nothing")
    parser.add_argument("--prepare-only", action="store_true",
                        help="build the image into --image-cache (if not there) and exit")
    parser.add_argument("--ab", metavar="VAR=VALUE",
                        help="A/B in one sitting: runs 1, 3, 5, ... with VAR=VALUE in the "
                        "environment (the agent and lazyfs daemon inherit it), runs 0, 2, "
                        "... without; each variant summarized apart (`ab` in the JSON)")
    parser.add_argument("--short-poll", dest="long_poll", action="store_false",
                        help="wait for READY with a read of the logs API every 10 ms instead "
                        "of waiting reads (the series' way until 2026-12-07: its polling "
                        "took ~0.13 s of a 1.3 s lazy start on the node's 2 cores)")
    parser.add_argument("--no-cached-reads", action="store_true",
                        help="skip the cached-read pass after the last run (bulk prefetch "
                        "wait and whole-image reads: a minute at full size)")
    return parser.parse_args()


def stop_on_signals() -> None:
    """SIGTERM (``timeout``, a killed job) and SIGINT raise ``KeyboardInterrupt`` once, so
    the ``finally`` blocks run: the node's agent terminated, its lazyfs daemon stopped (it
    runs in a session of its own and would go on serving, and prefetching, after us), its
    mounts unmounted, the registry and relay stopped. Further signals are ignored while
    that clean-up runs."""
    def interrupt(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"bench: signal {signum}: stopping the node and its lazyfs daemon",
              file=sys.stderr)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def main() -> None:
    args = parse_args()
    stop_on_signals()
    total = (args.mb or (200 if args.quick else 1100)) * 1_000_000
    chunk_size = int(args.chunk_mib * MiB)
    work = workload(total)
    if args.prepare_only:
        prepare_only(args.image_cache, work, chunk_size)
        return
    result: dict[str, Any] = {
        "benchmark": "lazy_pull", "quick": args.quick,
        "image": {"total_bytes": work.total_bytes, "tree_files": len(work.tree),
                  "tree_bytes": work.total_bytes - work.weights_bytes,
                  "weights_bytes": work.weights_bytes, "read_files": len(work.read_files),
                  "read_bytes": work.read_bytes,
                  "read_fraction": round(work.read_bytes / work.total_bytes, 4)},
        "measured": "pod create -> READY served by GET /v1/pods/{id}/logs, cold node",
        "ready_read": "long poll (wait)" if args.long_poll else "every 10 ms",
        "estargz_chunk_bytes": chunk_size,
    }
    with tempfile.TemporaryDirectory(prefix="gpucloud-lazybench-", dir="/var/tmp") as tmp, \
            ExitStack() as stack:
        workdir = Path(tmp)
        cache = workdir / "image-cache" if args.no_image_cache else args.image_cache
        started = time.perf_counter()
        prepared = prepare_image(cache, work, chunk_size)
        result["image_source"] = {**image_source(prepared, not args.no_image_cache),
                                  "prepare_seconds": round(time.perf_counter() - started, 1)}
        print(f"image {'from the cache' if prepared.from_cache else 'built'}: key "
              f"{prepared.key} ({prepared.root}), "
              f"{result['image_source']['prepare_seconds']} s", file=sys.stderr)
        direct = stack.enter_context(shaped_registry(workdir / "registry"))
        relay = Relay(direct)
        stack.callback(relay.close)
        started = time.perf_counter()
        with RegistryClient() as client:  # into this run's new (cold) registry
            push_layout(client, relay.host, prepared.root / "full", "bench/app:full")
            push_layout(client, relay.host, prepared.root / "esgz", "bench/app:esgz")
        result["push_seconds"] = round(time.perf_counter() - started, 1)
        result["link"] = link_proof(relay, prepared.weights_digest)
        cloud = stack.enter_context(running_cloud(workdir / "cloud"))
        run_forms(args, work, cloud, relay, result)
    finish(result, work, args.rtt_ms[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def prepare_only(cache: Path, work: Workload, chunk_size: int) -> None:
    """``--prepare-only``: the cache's entry for this image, built if missing; no registry,
    no node, nothing measured."""
    started = time.perf_counter()
    prepared = prepare_image(cache, work, chunk_size)
    size = sum(path.stat().st_size for path in prepared.root.rglob("*") if path.is_file())
    print(json.dumps({**image_source(prepared, True), "dir": str(prepared.root),
                      "bytes": size, "seconds": round(time.perf_counter() - started, 1)},
                     indent=2))


def run_forms(args: argparse.Namespace, work: Workload, cloud: Cloud, relay: Relay,
              result: dict[str, Any]) -> None:
    """The cold runs of each form and RTT, summarized into ``result``."""
    forms = {"full": f"{relay.host}/bench/app:full", "lazy": f"{relay.host}/bench/app:esgz"}
    for form, image in forms.items():
        if form not in args.forms:
            continue
        for rtt in args.rtt_ms:
            relay.set_rtt(rtt)
            runs, reads, timelines = [], None, []
            for number in range(args.runs):
                last = (number == args.runs - 1 and rtt == args.rtt_ms[0]
                        and not args.no_cached_reads)
                name = f"{form}-{int(rtt)}-{number}"
                ab_variant(args.ab, number)
                trace_to = args.trace / f"{name}.jsonl" if args.trace else None
                if trace_to is not None:
                    trace_to.parent.mkdir(parents=True, exist_ok=True)
                    trace_to.unlink(missing_ok=True)
                run, measured = cold_run(cloud, relay, image, name,
                                         work if last else None, trace_to, args.long_poll)
                runs.append(run)
                reads = measured or reads
                variant = f" [{args.ab if number % 2 else 'A'}]" if args.ab else ""
                print(f"{form} rtt {rtt} ms run {number}{variant}: {run}", file=sys.stderr)
                if trace_to is not None:
                    timelines.append(trace.summarize(trace.load(str(trace_to))))
                    print(json.dumps(timelines[-1]), file=sys.stderr)
            ab_variant(args.ab, 0)
            result.setdefault(form, {})[f"rtt_{rtt:g}ms"] = summary(runs)
            if args.ab:
                result[form][f"rtt_{rtt:g}ms"]["ab"] = {
                    "A (unset)": summary(runs[0::2]),
                    **({f"B ({args.ab})": summary(runs[1::2])} if len(runs) > 1 else {})}
            if timelines:
                result[form][f"rtt_{rtt:g}ms"]["timelines"] = timelines
            if reads is not None:
                result[form]["cached_reads"] = reads


def ab_variant(ab: str | None, number: int) -> None:
    """``--ab VAR=VALUE``: set VAR for odd-numbered runs, unset it for even ones (the
    node's agent and lazyfs daemon start per run and inherit the environment)."""
    if not ab:
        return
    var, _, value = ab.partition("=")
    if number % 2:
        os.environ[var] = value
    else:
        os.environ.pop(var, None)


def link_proof(relay: Relay, digest: str) -> dict[str, Any]:
    """What the shaped link and the relay sustain: the weights layer fetched whole."""
    proof: dict[str, Any] = {"rate": RATE, "shaping": "tbf on both veth ends",
                             "delay": "relay (no sch_netem in this kernel)"}
    for rtt in (0.0, 20.0):
        proof[f"relay_mb_per_s_rtt_{rtt:g}ms"] = link_throughput(relay, digest, "bench/app", rtt)
    proof["direct_mb_per_s"] = link_throughput(relay, digest, "bench/app", 0, relay.target)
    relay.set_rtt(0)
    return proof


def finish(result: dict[str, Any], work: Workload, rtt: float) -> None:
    """``speedup`` and ``fetched_over_read``, or why they are not there."""
    key = f"rtt_{rtt:g}ms"
    lazy = result.get("lazy", {}).get(key)
    if lazy is not None and not lazy["lazy_mounts"]:
        result["lazy_not_measured"] = (
            "the agent pulled the eStargz image in full (no FUSE mount under its state "
            "directory): the node's lazy path is not in place; figures under 'lazy' are "
            "a full pull of the eStargz form")
    if "lazy_not_measured" in result or lazy is None:
        result["speedup"] = None
        result["fetched_over_read"] = None
        why = result.get("lazy_not_measured", "no lazy runs")
        print(f"lazy path not measured: {why}", file=sys.stderr)
        return
    full = result.get("full", {}).get(key)
    result["speedup"] = (round(full["p50_seconds"] / lazy["p50_seconds"], 2)
                         if full is not None else None)  # None: --forms lazy
    # Wire bytes before READY (TOC included) less the daemon's background prefetch.
    result["fetched_over_read"] = round(
        lazy["bytes_fetched_without_prefetch_p50"] / work.read_bytes, 3)
    # The same with the prioritized files' prefetch counted (they are the start's reads).
    result["fetched_over_read_with_priority_prefetch"] = round(
        lazy["bytes_fetched_without_bulk_prefetch_p50"] / work.read_bytes, 3)
    result["fetched_over_read_with_prefetch"] = round(
        lazy["bytes_fetched_p50"] / work.read_bytes, 3)


if __name__ == "__main__":
    main()
