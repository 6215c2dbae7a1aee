"""State that belongs to one asyncio event loop (an anyio ``CapacityLimiter``, an
``asyncio.Lock``, a connection pool): made on first use in each loop, and gone with the
loop (a test app's loop that ended takes its state with it)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerLoop(Generic[T]):
    """``make()``'s result for the running event loop, one per loop."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = (
            weakref.WeakKeyDictionary())

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        found = self._by_loop.get(loop)
        if found is None:
            found = self._by_loop[loop] = self._make()
        return found
