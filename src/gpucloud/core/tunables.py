"""Benchmark knobs read from the environment at import: a value that does not parse or
falls outside its range is logged and the default used, so a typo never stops a server
(the settings a user sets are ``core/settings.py``'s, whose bad values are one CLI line)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

N = TypeVar("N", int, float)


def number_from_env(name: str, default: N, low: N, high: N,
                    parse: Callable[[str], N] | None = None) -> N:
    """``$name`` as a number in [low, high], else (logged) ``default``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    convert: Callable[[str], N] = parse or type(default)
    try:
        value = convert(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        log.warning("%s=%r is not a number in [%g, %g]; using %g", name, raw, low, high,
                    default)
        return default
    return value
