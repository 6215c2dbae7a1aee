"""Benchmark: checkpoint upload and restore through the embedded store.

Starts the server on a thread (SQLite, embedded store under a temporary GPUCLOUD_HOME,
controllers running), registers a node with the agent's own connection and uploads a
checkpoint directory with the agent's own code (agent/checkpoints): a full checkpoint of
``--size-mib`` of random data (16 files), then a second one after 5 % of the data changed
(contiguous regions in a few files, as when some tensors change), then a restore into an
empty directory with every chunk's digest checked. Prints upload MB/s, restore time and
the second checkpoint's bytes sent (target: at most 10 % of the full size); JSON to
bench/results/checkpoint.json.

    .venv/bin/python bench/checkpoint.py [--size-mib 1024]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.server import live_server  # noqa: E402

from gpucloud.agent.checkpoints import PodCheckpoints  # noqa: E402
from gpucloud.agent.connection import Connection  # noqa: E402
from gpucloud.agent.identity import IdentityFile  # noqa: E402
from gpucloud.client.sdk import GpucloudClient  # noqa: E402
from gpucloud.core.models import AssignmentOut, NodeRegisterRequest  # noqa: E402
from gpucloud.core.settings import Settings  # noqa: E402

ADMIN_KEY = "gpc_bench-admin-key-0123456789"
RESULTS = ROOT / "bench" / "results"
FILES = 16
MiB = 1024 * 1024


def make_directory(root: Path, size_mib: int, seed: int) -> int:
    root.mkdir(parents=True)
    rng = random.Random(seed)
    per_file = size_mib * MiB // FILES
    for index in range(FILES):
        (root / f"shard-{index:02d}.bin").write_bytes(rng.randbytes(per_file))
    return per_file * FILES


def change_fraction(root: Path, fraction: float, seed: int) -> int:
    """Overwrite ``fraction`` of the data: one contiguous region in each of 4 files."""
    rng = random.Random(seed)
    files = sorted(root.glob("shard-*.bin"))
    total = sum(path.stat().st_size for path in files)
    region = int(total * fraction) // 4
    changed = 0
    for path in rng.sample(files, 4):
        offset = rng.randrange(0, path.stat().st_size - region)
        with path.open("r+b") as out:
            out.seek(offset)
            out.write(rng.randbytes(region))
        changed += region
    return changed


def renew_lease(conn: Connection, stop: threading.Event) -> None:
    """What the agent's lease thread does: the node stays Ready through a long upload."""
    while not stop.wait(2.0):
        conn.renew()


def assignment_for(conn: Connection, pod_id: str) -> AssignmentOut:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for assignment in conn.client.assignments().pods:
            if assignment.pod_id == pod_id:
                return assignment
        time.sleep(0.1)
    raise SystemExit("the benchmark pod was not scheduled")


def run(size_mib: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpucloud-ckpt-bench-") as temp:
        work = Path(temp)
        settings = Settings(home=work / "home", database_url=f"sqlite:///{work / 'db.sqlite'}",
                            admin_key=ADMIN_KEY)
        with live_server(settings) as url:
            admin = GpucloudClient(url, ADMIN_KEY)
            registration = NodeRegisterRequest(
                join_token=admin.create_join_token().token, name="bench-node", cpu_cores=16,
                memory_bytes=64 * 1024**3)
            conn = Connection(url, registration, IdentityFile(work / "agent"),
                              threading.Event())
            conn.connect()
            stop = threading.Event()
            threading.Thread(target=renew_lease, args=(conn, stop), daemon=True).start()
            pod = admin.create_pod({"name": "bench", "image": "busybox", "command": ["true"],
                                    "checkpoint_dir": "/ckpt"})
            assignment = assignment_for(conn, pod.id)
            source = work / "source"
            size = make_directory(source, size_mib, seed=1)
            uploader = PodCheckpoints(conn, assignment, source)

            started = time.perf_counter()
            full = uploader.upload(marked_at=time.time())
            upload_seconds = time.perf_counter() - started

            changed = change_fraction(source, 0.05, seed=2)
            started = time.perf_counter()
            second = uploader.upload(marked_at=time.time())
            second_seconds = time.perf_counter() - started

            target = work / "restored"
            started = time.perf_counter()
            restored = PodCheckpoints(conn, assignment, target).restore()
            restore_seconds = time.perf_counter() - started
            assert restored is not None and restored.id == second.id
            same = all(filecmp.cmp(path, target / path.name, shallow=False)
                       for path in sorted(source.glob("*.bin")))
            assert same, "the restored directory differs from the source"
            stop.set()
            conn.close()
            admin.close()
    return {
        "size_bytes": size,
        "full_bytes_sent": full.bytes_sent,
        "upload_seconds": round(upload_seconds, 3),
        "upload_mb_per_s": round(size / MiB / upload_seconds, 1),
        "changed_bytes": changed,
        "second_bytes_sent": second.bytes_sent,
        "second_fraction_of_full": round(second.bytes_sent / size, 4),
        "second_upload_seconds": round(second_seconds, 3),
        "restore_seconds": round(restore_seconds, 3),
        "restore_mb_per_s": round(size / MiB / restore_seconds, 1),
        "target_met": second.bytes_sent <= 0.10 * size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    result = run(args.size_mib)
    print(f"checkpoint of {result['size_bytes'] / MiB:.0f} MiB to the embedded store:")
    print(f"  upload:  {result['upload_mb_per_s']} MB/s ({result['upload_seconds']} s)")
    print(f"  restore: {result['restore_seconds']} s ({result['restore_mb_per_s']} MB/s), "
          "every chunk verified")
    print(f"  second checkpoint after 5 % changed: {result['second_bytes_sent'] / MiB:.1f} MiB "
          f"sent = {100 * result['second_fraction_of_full']:.1f} % of the full size "
          f"(target <= 10 %: {'met' if result['target_met'] else 'NOT met'})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
