"""Parsing and formatting of resource quantities (memory ``16Gi``, CPU ``500m`` or ``2``)."""

from __future__ import annotations

import math
import re

from gpucloud.core.errors import InvalidInput

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?|[kmgtp]|B)?\s*$")
_MEMORY_UNITS: dict[str, int] = {
    "": 1, "B": 1,
    "K": 1000, "k": 1000, "M": 1000**2, "m": 1000**2, "G": 1000**3, "g": 1000**3,
    "T": 1000**4, "t": 1000**4, "P": 1000**5, "p": 1000**5,
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5,
}
_CPU = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(m)?\s*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])?\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
#: Past any quantity gpucloud accepts (every caller bounds its own), and within BIGINT:
#: a larger one is refused here, before float arithmetic overflows.
MAX_QUANTITY = 2**62


def parse_memory(field: str, value: str | int) -> int:
    """Bytes in a memory quantity: plain bytes or a K/M/G/T/P suffix (binary with ``i``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidInput(field, "must not be negative")
        return value
    match = _MEMORY.match(str(value))
    if not match:
        raise InvalidInput(field, f"{value!r} is not a memory quantity such as 512Mi or 16Gi")
    number, unit = match.groups()
    return _bounded_int(field, float(number) * _MEMORY_UNITS[unit or ""])


def _bounded_int(field: str, value: float, rounded: bool = False) -> int:
    """``value`` as an int (rounded, or else truncated), or InvalidInput past
    :data:`MAX_QUANTITY` (``int(1e308 * 1000)`` would raise OverflowError)."""
    if not math.isfinite(value) or abs(value) > MAX_QUANTITY:
        raise InvalidInput(field, "is too large")
    return round(value) if rounded else int(value)


def parse_cpu_milli(field: str, value: str | float | int) -> int:
    """Milli-cores in a CPU quantity: ``2``, ``0.5`` or ``500m``."""
    if isinstance(value, bool):
        raise InvalidInput(field, "must be a number of cores")
    if isinstance(value, int | float):
        if value < 0:
            raise InvalidInput(field, "must not be negative")
        return _bounded_int(field, float(value) * 1000, rounded=True)
    if not isinstance(value, str):
        raise InvalidInput(field, "must be a number of cores")
    match = _CPU.match(value)
    if not match:
        raise InvalidInput(field, f"{value!r} is not a CPU quantity such as 2, 0.5 or 500m")
    number, milli = match.groups()
    return _bounded_int(field, float(number) * (1 if milli else 1000), rounded=True)


def parse_duration(field: str, value: str | float | int) -> float:
    """Seconds in a duration: a number of seconds, or one with an ``s/m/h/d`` suffix
    (``90``, ``30m``, ``2h``)."""
    if isinstance(value, bool):
        raise InvalidInput(field, "must be a duration such as 90, 30m or 2h")
    if isinstance(value, int | float):
        seconds = float(value)
    elif not isinstance(value, str):
        raise InvalidInput(field, "must be a duration such as 90, 30m or 2h")
    else:
        match = _DURATION.match(value)
        if not match:
            raise InvalidInput(field, f"{value!r} is not a duration such as 90, 30m or 2h")
        number, unit = match.groups()
        seconds = float(number) * _DURATION_UNITS[unit or ""]
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidInput(field, "must be a positive, finite number of seconds")
    return seconds


def format_memory(num_bytes: int) -> str:
    """The shortest exact binary form of a byte count (``16Gi``), else bytes."""
    for unit in ("Pi", "Ti", "Gi", "Mi", "Ki"):
        size = _MEMORY_UNITS[unit]
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


def format_cpu(milli: int) -> str:
    """Cores as ``2`` or ``0.5``; milli-cores that are not a tenth as ``250m``."""
    if milli % 1000 == 0:
        return str(milli // 1000)
    if milli % 100 == 0:
        return f"{milli / 1000:g}"
    return f"{milli}m"
