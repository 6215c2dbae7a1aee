"""A pass asked for by a create places pods first; periodic passes keep their order."""

from __future__ import annotations

from typing import Any

from gpucloud.controllers.loops import ControllerRunner
from gpucloud.services.context import ServiceContext

NAMES = ("deadlines", "drains", "credit", "retention", "autoscale", "jobs", "scheduling")


def _recording(runner: ControllerRunner) -> list[str]:
    """Each controller's (real) tick, noted in the order it runs."""
    order: list[str] = []
    for name in NAMES:
        controller = getattr(runner, name)
        real = controller.tick

        def tick(real: Any = real, name: str = name) -> Any:
            order.append(name)
            return real()

        controller.tick = tick
    return order


def test_a_woken_pass_runs_jobs_and_the_scheduler_before_the_periodic_controllers(
        ctx: ServiceContext) -> None:
    runner = ControllerRunner(ctx)
    order = _recording(runner)
    runner.run_once(woken=True)
    assert order == ["jobs", "scheduling", "deadlines", "drains", "credit", "retention",
                     "autoscale"]
    order.clear()
    runner.run_once()
    assert order == list(NAMES)
