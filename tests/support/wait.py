"""Waiting for a condition in a test: ``wait_for`` in async tests, ``wait_for_blocking`` in the others.

Both poll ``predicate`` until it returns something true and return that value; after
``timeout`` seconds they raise AssertionError naming ``what`` (the predicate when not given).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

DEFAULT_TIMEOUT = 10.0


def _timed_out(timeout: float, what: str, predicate: Callable[[], Any]) -> AssertionError:
    return AssertionError(f"not within {timeout:g} s: {what or predicate}")


async def wait_for(predicate: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT, what: str = "", *,
                   interval: float = 0.02, blocking: bool = False) -> Any:
    """``predicate`` may return an awaitable (a coroutine function's call), which is awaited;
    ``blocking``: it blocks (HTTP, a subprocess), so it runs in a thread."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = await asyncio.to_thread(predicate) if blocking else predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > end:
            raise _timed_out(timeout, what, predicate)
        await asyncio.sleep(interval)


def wait_for_blocking(predicate: Callable[[], Any], timeout: float = DEFAULT_TIMEOUT, what: str = "", *,
                      interval: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise _timed_out(timeout, what, predicate)
        time.sleep(interval)
