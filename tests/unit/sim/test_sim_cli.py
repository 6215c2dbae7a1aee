"""The ``gpucloud sim`` and ``gpucloud bench`` commands, on small synthetic inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpucloud.cli.bench import app as bench_app
from gpucloud.cli.sim import app as sim_app

NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,131072,4,G2
n1,32000,131072,2,T4
n2,16000,65536,0,
"""
PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec
p0,4000,8192,1,500,
p1,8000,8192,1,1000,
p2,8000,8192,2,1000,G2
p3,2000,4096,0,0,
p4,2000,4096,1,250,T4
"""


@pytest.fixture()
def trace(tmp_path: Path) -> tuple[Path, Path]:
    nodes, pods = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    nodes.write_text(NODES)
    pods.write_text(PODS)
    return nodes, pods


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(sim_app, list(args))
    return result.exit_code, result.output


def test_json_output_has_the_documented_fields(trace: tuple[Path, Path]) -> None:
    code, out = _run("openb", "--nodes", str(trace[0]), "--pods", str(trace[1]),
                     "--policy", "fgd", "--seeds", "2", "--output", "json")
    assert code == 0, out
    data = json.loads(out)
    assert data["policy"] == "fgd"
    assert data["seeds"] == [42, 43]
    assert len(data["per_seed"]) == 2
    assert 0.0 <= data["unallocated_pct_at_100"] <= 100.0
    assert len(data["allocated_pct_curve"]) == 131


def test_policy_all_runs_seven(trace: tuple[Path, Path]) -> None:
    code, out = _run("openb", "--nodes", str(trace[0]), "--pods", str(trace[1]),
                     "--policy", "all", "--seeds", "1", "--output", "json")
    assert code == 0, out
    assert [d["policy"] for d in json.loads(out)] == [
        "random", "dotprod", "clustering", "packing", "bestfit", "fgd", "default"]


def test_dump_placements_replays_consistently(trace: tuple[Path, Path], tmp_path: Path) -> None:
    dump = tmp_path / "placements.jsonl"
    code, out = _run("openb", "--nodes", str(trace[0]), "--pods", str(trace[1]),
                     "--policy", "bestfit", "--seeds", "1", "--dump-placements", str(dump))
    assert code == 0, out
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert records and {r["seed"] for r in records} == {42}
    used: dict[tuple[str, str], int] = {}
    for r in records:
        assert r["pod"] in {"p0", "p1", "p2", "p3", "p4"}
        assert r["node"] in {None, "n0", "n1"}  # n2 has no GPU: not part of the cluster
        for gpu, milli in r["gpus"].items():
            used[(r["node"], gpu)] = used.get((r["node"], gpu), 0) + milli
    assert all(v <= 1000 for v in used.values())


def test_plot_writes_a_png(trace: tuple[Path, Path], tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    code, out = _run("openb", "--nodes", str(trace[0]), "--pods", str(trace[1]),
                     "--policy", "bestfit,fgd", "--seeds", "1", "--plot", str(png))
    assert code == 0, out
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("args", "message"), [
    (["openb", "--workload", "no-such-workload"], "no workload 'no-such-workload'"),
    (["openb", "--policy", "fgd"], "give --workload NAME"),
    (["openb", "--nodes", "/nonexistent/n.csv", "--pods", "/nonexistent/p.csv"], "cannot read"),
    (["openb", "--workload", "default", "--policy", "magic"], "unknown policy 'magic'"),
    (["openb", "--workload", "default", "--output", "xml"], "--output must be table or json"),
])
def test_errors_are_one_line(args: list[str], message: str) -> None:
    code, out = _run(*args)
    assert code == 1
    assert message in out
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_bench_scheduler_json() -> None:
    result = CliRunner().invoke(bench_app, ["scheduler", "--nodes", "50", "--pods", "200",
                                            "--output", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["nodes"] == 50 and data["pods"] == 200
    assert data["placements_per_s"] > 0 and data["p99_latency_ms"] >= data["p50_latency_ms"]
