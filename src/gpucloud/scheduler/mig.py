"""MIG (Multi-Instance GPU) profiles and their placement rules.

An A100/H100/H200 GPU in MIG mode has 8 memory slices and 7 compute slices. Each profile
occupies a fixed number of memory slices and may only *start* at certain slices (NVIDIA MIG
user guide, "A100/H100 placement"): 7g at 0; 4g at 0; 3g at 0 or 4; 2g at 0, 2 or 4; the
double-memory 1g (1g.10gb on A100-40GB, 1g.20gb on 80 GB parts, 1g.35gb on H200) at 0, 2,
4 or 6; the small 1g at 0..6. These start rules alone give the per-GPU limits (seven 1g,
four double-memory 1g, three 2g, two 3g, one 4g, one 7g). Profile names depend on the
model's memory, so a profile name implies the GPU models it can run on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

MIG_SLOTS = 8
MIG_COMPUTE_SLICES = 7


@dataclass(frozen=True)
class MigGeometry:
    """Shape of a profile on the slot grid: compute slices, memory slices, allowed starts."""

    compute: int
    size: int
    starts: tuple[int, ...]

    def mask(self, start: int) -> int:
        """Bitmask of the memory slices an instance starting at ``start`` occupies."""
        return ((1 << self.size) - 1) << start

    @cached_property
    def masks(self) -> tuple[int, ...]:
        return tuple(self.mask(start) for start in self.starts)


_G7 = MigGeometry(7, 8, (0,))
_G4 = MigGeometry(4, 4, (0,))
_G3 = MigGeometry(3, 4, (0, 4))
_G2 = MigGeometry(2, 2, (0, 2, 4))
_G1_DOUBLE = MigGeometry(1, 2, (0, 2, 4, 6))
_G1 = MigGeometry(1, 1, (0, 1, 2, 3, 4, 5, 6))

_SHAPES = (("1g", _G1), ("1g-double", _G1_DOUBLE), ("2g", _G2), ("3g", _G3), ("4g", _G4),
           ("7g", _G7))


def _family(small: int, double: int, two: int, three: int, seven: int) -> dict[str, MigGeometry]:
    """Profile names of one memory size: memory (GB) of 1g, double 1g, 2g, 3g/4g, 7g."""
    return {
        f"1g.{small}gb": _G1,
        f"1g.{double}gb": _G1_DOUBLE,
        f"2g.{two}gb": _G2,
        f"3g.{three}gb": _G3,
        f"4g.{three}gb": _G4,
        f"7g.{seven}gb": _G7,
    }


_FAMILY_80 = _family(10, 20, 20, 40, 80)

MIG_PROFILES: dict[str, dict[str, MigGeometry]] = {
    "A100-40GB": _family(5, 10, 10, 20, 40),
    "A100-80GB": _FAMILY_80,
    "H100-80GB": _FAMILY_80,
    "H800-80GB": _FAMILY_80,
    "H200-141GB": _family(18, 35, 35, 71, 141),
}


def mig_capable_model(model: str) -> bool:
    """Whether a GPU model (canonical name) supports MIG."""
    return model in MIG_PROFILES


def geometry(model: str, profile: str) -> MigGeometry | None:
    """The geometry of ``profile`` on ``model``, or None if that model has no such profile."""
    return MIG_PROFILES.get(model, {}).get(profile.strip().lower())


def models_with_profile(profile: str) -> tuple[str, ...]:
    """GPU models (canonical names) that offer ``profile``."""
    key = profile.strip().lower()
    return tuple(model for model, table in MIG_PROFILES.items() if key in table)


def known_profile(profile: str) -> bool:
    return bool(models_with_profile(profile))


def fits(geom: MigGeometry, used: int) -> bool:
    """Whether an instance of ``geom`` fits on a GPU whose used slices are ``used``."""
    return any(used & mask == 0 for mask in geom.masks)


@cache
def remaining_room(used: int) -> int:
    """How many placements of each larger shape remain, weighted by their size.

    Used to pick the start slot that destroys the least future capacity.
    """
    return sum(geom.size * sum(1 for m in geom.masks if used & m == 0) for _, geom in _SHAPES)


def best_start(geom: MigGeometry, used: int) -> int | None:
    """The start slot that keeps the most room for later instances (None if none fits)."""
    options = [s for s in geom.starts if used & geom.mask(s) == 0]
    if not options:
        return None
    return max(options, key=lambda s: (remaining_room(used | geom.mask(s)), -s))


def layout_starts(layout: tuple[tuple[str, int], ...], profile: str) -> tuple[int, ...]:
    """The start slots of a fixed layout's instances of ``profile`` (sorted)."""
    key = profile.strip().lower()
    return tuple(sorted({start for name, start in layout if name.strip().lower() == key}))


def free_layout_start(geom: MigGeometry, starts: tuple[int, ...], used: int) -> int | None:
    """The lowest of a fixed layout's instance starts whose slices no pod holds (None: every
    instance of that profile is taken). Nothing new is ever made on a fixed layout; a start
    the profile cannot have (a bad report) is never used."""
    return next((s for s in starts if s in geom.starts and used & geom.mask(s) == 0), None)
