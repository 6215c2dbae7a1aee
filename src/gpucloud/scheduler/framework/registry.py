"""Registry of plugins by name, and profiles: which plugins run, in what order, how weighted.

A profile is plain configuration (``ProfileConfig``: names and weights, loadable from YAML
or JSON); ``Registry.build`` turns it into live plugin objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpucloud.scheduler.framework.plugin import (
    FilterPlugin,
    PreFilterPlugin,
    ReservePlugin,
    ScorePlugin,
)

PluginArgs = Mapping[str, Any]
Factory = Callable[[PluginArgs], object]

TIE_BREAKS = ("first", "random", "rank")


@dataclass(frozen=True)
class ProfileConfig:
    """Configuration of one profile.

    ``scores`` maps score plugin name -> weight; ``args`` maps plugin name -> its arguments.
    ``sample_size``: when more than ``sample_threshold`` nodes are feasible, only a random
    sample of ``sample_size`` of them is scored (Nomad-style bounded scoring, so the cost of
    a placement does not grow with the cluster); None scores every feasible node.
    ``tie_break``: among equal best scores take the ``first`` node, a ``random`` one, or
    the one first in a random node order drawn once per seed (``rank``).
    """

    name: str
    pre_filters: tuple[str, ...]
    filters: tuple[str, ...]
    scores: tuple[tuple[str, float], ...]
    reserve: str
    tie_break: str = "first"
    sample_size: int | None = None
    sample_threshold: int | None = None
    args: Mapping[str, PluginArgs] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, name: str, raw: Mapping[str, Any]) -> ProfileConfig:
        """A profile from a mapping as found in a config file; unknown keys are errors."""
        allowed = {"pre_filters", "filters", "scores", "reserve", "tie_break", "sample_size",
                   "sample_threshold", "args"}
        extra = set(raw) - allowed
        if extra:
            raise ValueError(f"profile {name!r}: unknown keys {sorted(extra)}")
        scores = raw.get("scores", {})
        return cls(
            name=name,
            pre_filters=tuple(raw.get("pre_filters", ())),
            filters=tuple(raw.get("filters", ())),
            scores=tuple((str(k), float(v)) for k, v in dict(scores).items()),
            reserve=str(raw["reserve"]),
            tie_break=str(raw.get("tie_break", "first")),
            sample_size=raw.get("sample_size"),
            sample_threshold=raw.get("sample_threshold"),
            args=dict(raw.get("args", {})),
        )


@dataclass(frozen=True)
class Profile:
    """Live plugins of a profile, in the order they run."""

    name: str
    pre_filters: tuple[PreFilterPlugin, ...]
    filters: tuple[FilterPlugin, ...]
    scores: tuple[tuple[ScorePlugin, float], ...]
    reserve: ReservePlugin
    tie_break: str
    sample_size: int | None
    sample_threshold: int | None


class Registry:
    """Plugin factories by name."""

    def __init__(self) -> None:
        self._factories: dict[str, Factory] = {}

    def register(self, name: str, factory: Factory) -> None:
        if name in self._factories:
            raise ValueError(f"plugin {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(self._factories)

    def create(self, name: str, args: PluginArgs | None = None) -> object:
        factory = self._factories.get(name)
        if factory is None:
            raise ValueError(f"unknown scheduler plugin {name!r}")
        return factory(args or {})

    def build(self, config: ProfileConfig, context: PluginArgs | None = None) -> Profile:
        """Instantiate every plugin of a profile; unknown names raise ValueError.

        ``context`` (e.g. ``workload``: the pods a fragmentation model is measured against)
        is passed to every plugin, under the profile's own arguments.
        """
        if config.tie_break not in TIE_BREAKS:
            raise ValueError(f"profile {config.name!r}: tie_break must be one of {TIE_BREAKS}")

        def make(name: str) -> Any:
            return self.create(name, {**(context or {}), **config.args.get(name, {})})

        return Profile(
            name=config.name,
            pre_filters=tuple(make(n) for n in config.pre_filters),
            filters=tuple(make(n) for n in config.filters),
            scores=tuple((make(n), w) for n, w in config.scores),
            reserve=make(config.reserve),
            tie_break=config.tie_break,
            sample_size=config.sample_size,
            sample_threshold=config.sample_threshold,
        )
