"""A longer, random schemathesis run against a live server (``make test`` runs a short one
with fixed seeds: tests/fuzz/test_schemathesis.py).

    .venv/bin/python bench/fuzz.py --database postgresql --max-examples 200 --max-time 1200

Prints the counts (operations, test cases, unique failures by check) per key and every
failure with the curl line that reproduces it; exits non-zero when anything failed. The
seed is printed so that a failure found at random can be rerun (``--seed``).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures.postgres import postgres_server  # noqa: E402
from tests.fuzz import harness  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--max-examples", type=int, default=200)
    parser.add_argument("--max-time", type=int, default=None, help="seconds per key")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}", flush=True)
    failed = False
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpucloud-fuzz-")))
        url = (stack.enter_context(postgres_server()) if args.database == "postgresql"
               else f"sqlite:///{work / 'fuzz.db'}")
        target = stack.enter_context(harness.live_target(work / "home", url))
        for who, key in (("admin", target.admin_key), ("project", target.project_key)):
            started = time.monotonic()
            settings = harness.config(target, key, seed=seed, max_examples=args.max_examples,
                                      workers=args.workers, max_time=args.max_time)
            report = harness.run(target, settings)
            print(f"{args.database} {who}: {report.summary()} "
                  f"in {time.monotonic() - started:.0f}s", flush=True)
            for line in report.details + report.errors:
                print(f"  {line}")
            failed = failed or bool(report.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
