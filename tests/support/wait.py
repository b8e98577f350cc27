"""Waiting on facts, not on time."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import trio


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 20.0,
                     interval: float = 0.005) -> None:
    """Wait until ``predicate()`` (a plain or an async function) is true, checking every
    ``interval`` seconds.

    Raises:
        trio.TooSlowError: it was still false after ``timeout`` seconds.
    """
    with trio.fail_after(timeout):
        while True:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await trio.sleep(interval)
