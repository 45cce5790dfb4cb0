"""Between the scheduler's thread and the HTTP event loop: items handed to the loop's queues from other
threads (`Outbox`: one wake-up of the loop for all that arrive before it runs), and what a queue holds
taken at once (`drained`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


async def drained(queue: asyncio.Queue[_T]) -> list[_T]:
    """The next item, and every one queued behind it: what was decided while the last were sent, sent at
    once (a client or a hop that falls behind gets fewer, larger writes)."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


class Outbox:
    """Hands items from other threads to asyncio queues of one event loop, one wake-up of the loop for all
    that arrive before it runs. The scheduler decides a token for every stream of a step at once: one
    wake-up a step, not one a stream: a wake-up (a write to the loop's socket) lets the loop's thread
    take the GIL, and the scheduler's then waits for it back (a step's Python grew with every wake-up: see
    docs/worklog.md, the twelfth session). An owner keeps one for the loop it runs on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # no lock: a deque's append and popleft are atomic, and a thread that puts never waits for the
        # loop's thread (which, holding a lock, would hold the GIL too while it delivers)
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._waking = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @classmethod
    def on(cls, outbox: Outbox | None, loop: asyncio.AbstractEventLoop) -> Outbox:
        """`outbox` if it serves `loop`, else a new one for it (an owner keeps the one its loop uses)."""
        return outbox if outbox is not None and outbox.loop is loop else cls(loop)

    def sink(self, queue: asyncio.Queue[_T]) -> Callable[[_T], None]:
        """A callable that puts into `queue`, from any thread."""
        return lambda item: self.put(queue, item)

    def put(self, queue: asyncio.Queue[_T], item: _T) -> None:
        self._items.append((queue, item))
        if self._waking:
            return  # a delivery is coming that has not begun: it takes this one too
        self._waking = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody waits for what it would have delivered
            self._items.clear()

    def _deliver(self) -> None:
        self._waking = False  # first: an item put from here on asks for a delivery of its own
        while self._items:
            queue, item = self._items.popleft()
            queue.put_nowait(item)
