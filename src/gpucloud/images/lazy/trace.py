"""The lazy start's summary of a trace (``core/trace.py``, ``GPUCLOUD_TRACE``).

The benchmark, the agent and the lazyfs daemon mark pod create, pull, each layer's mount
phases, the overlay, every chunk fetch with its span and wait, and ``READY``;
``bench/lazy_pull.py --trace`` turns the trace on and prints the per-phase summary
(``summarize``). ``mark`` and the rest are ``core/trace.py``'s, re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpucloud.core.trace import TRACE_ENV, enabled, load, mark, set_path

__all__ = ["TRACE_ENV", "enabled", "load", "mark", "set_path", "summarize"]


def _first(events: Iterable[dict[str, Any]], name: str) -> float | None:
    return next((float(e["t"]) for e in events if e["event"] == name), None)


def _last(events: list[dict[str, Any]], name: str) -> float | None:
    return next((float(e["t"]) for e in reversed(events) if e["event"] == name), None)


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-phase times (seconds after ``create``) and the fetches before ``ready``.

    Phases: ``pull`` (manifest and config), ``mounts`` (first layer mount asked → last
    mounted), per-layer mount phases, ``overlay``, ``first_read`` (the first chunk fetch
    the workload caused, i.e. runc and the program's start are done), ``ready``; then the
    demand/priority fetches before ``ready``: count, compressed bytes, seconds on the wire
    (summed per request, and the union of the intervals with at least one on the wire)."""
    t0 = _first(events, "bench.create")
    ready = _first(events, "bench.ready") or _last(events, "fetch.end")
    if t0 is None or ready is None:
        return {"error": "no bench.create / bench.ready in the trace"}
    before = [e for e in events if float(e["t"]) <= ready]

    def at(name: str, last: bool = False) -> float | None:
        value = _last(before, name) if last else _first(before, name)
        return None if value is None else round(value - t0, 4)

    out: dict[str, Any] = {
        "agent_launch": at("agent.launch"), "pull_start": at("images.pull.start"),
        "pull_end": at("images.pull.end"), "rootfs_start": at("rootfs.start"),
        "mount_first_asked": at("rootfs.layer.start"),
        "mount_last_done": at("rootfs.layer.end", last=True),
        "overlay_done": at("rootfs.overlay"), "rootfs_end": at("rootfs.end"),
        "container_started": at("agent.started"),
        "first_demand_fetch": _first_fetch(before, "DEMAND", t0),
        "first_priority_fetch": _first_fetch(before, "PRIORITY", t0),
        "first_bulk_fetch": _first_fetch(before, "BULK", t0),
        "ready": round(ready - t0, 4),
    }
    out["layers"] = _mount_phases(before, t0)
    out["fetches"] = _fetches(before)
    return out


def _first_fetch(events: list[dict[str, Any]], priority: str, t0: float) -> float | None:
    return next((round(float(e["t"]) - t0, 4) for e in events
                 if e["event"] == "fetch.start" and e["priority"] == priority), None)


def _mount_phases(events: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    layers: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["event"].startswith("daemon.mount.") and "digest" in e:
            phase = e["event"][len("daemon.mount."):]
            layers.setdefault(str(e["digest"])[7:19], {})[phase] = round(float(e["t"]) - t0, 4)
    return [{"layer": key, **phases} for key, phases in layers.items()]


def _fetches(events: list[dict[str, Any]]) -> dict[str, Any]:
    starts = {(e["pid"], e["id"]): e for e in events if e["event"] == "fetch.start"}
    by_priority: dict[str, dict[str, Any]] = {}
    intervals: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["event"] != "fetch.end":
            continue
        start = starts.get((e["pid"], e["id"]))
        if start is None:
            continue
        p = str(e["priority"])
        row = by_priority.setdefault(p, {"requests": 0, "bytes": 0, "chunks": 0,
                                         "wire_seconds_sum": 0.0})
        row["requests"] += 1
        row["bytes"] += int(e["bytes"])
        row["chunks"] += int(start["chunks"])
        row["wire_seconds_sum"] = round(row["wire_seconds_sum"]
                                        + float(e["t"]) - float(start["t"]), 4)
        intervals.setdefault(p, []).append((float(start["t"]), float(e["t"])))
    for p, spans in intervals.items():
        by_priority[p]["wire_seconds_union"] = round(_union(spans), 4)
        by_priority[p]["first_to_last"] = round(max(b for _, b in spans)
                                                - min(a for a, _ in spans), 4)
    return by_priority


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
