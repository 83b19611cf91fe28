"""A call's deadline: one absolute time on the event loop's clock, from the engine down.

An engine reads the caller's deadline once, when the call arrives (the relay from
``grpc-timeout``, grpc.aio from its context), as ``Deadline.after(seconds)``. From there on
it is the same absolute time for every layer: the relay and the pull scheduler enforce it
with :func:`enforced` (``asyncio.timeout_at``), and only the runtime's gRPC client, which
takes a duration, gets ``remaining()``. Whether a call that stopped without an answer of
its own ended by its deadline or by a cancel is decided by :func:`ended`, and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from ..errors import RpcError

# A deadline this close is as good as gone: a call cancelled within it ended by its deadline.
# gRPC clients send what is left of their deadline (grpc-timeout) and cancel (RST_STREAM) when
# it passes, by their own clock, which started before the request reached the shim: on a
# loaded node that RST_STREAM comes a few milliseconds before the shim's own timer. Only how
# an ended call is reported (log, metric, span) depends on this.
DEADLINE_SLACK_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class Deadline:
    """The caller's deadline on the event loop's clock (``at``; ``None``: the caller set none)."""

    at: float | None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """The deadline ``seconds`` from now (none for ``None``)."""
        if seconds is None:
            return cls(None)
        return cls(asyncio.get_running_loop().time() + seconds)

    def remaining(self) -> float | None:
        """Seconds left, never negative; None without a deadline. For a client that takes a
        duration (grpc.aio's ``timeout``); code of ours waits with :func:`enforced`."""
        if self.at is None:
            return None
        return max(0.0, self.at - asyncio.get_running_loop().time())

    def within(self, seconds: float) -> Deadline:
        """This deadline, or ``seconds`` from now if that comes first (a call of the shim's
        own, made for a caller, ends by the caller's deadline too)."""
        soon = asyncio.get_running_loop().time() + seconds
        return self if self.at is not None and self.at <= soon else Deadline(soon)


NO_DEADLINE = Deadline(None)


def ended(deadline: Deadline) -> grpc.StatusCode:
    """How a call that stopped without an answer of its own (cancelled) ended:
    DEADLINE_EXCEEDED if ``deadline`` has passed (within DEADLINE_SLACK_SECONDS), else
    CANCELLED (the caller went away, or the shim is stopping)."""
    left = deadline.remaining()
    if left is not None and left <= DEADLINE_SLACK_SECONDS:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


@contextlib.asynccontextmanager
async def enforced(deadline: Deadline, details: Callable[[], str]) -> AsyncIterator[None]:
    """Run the body until ``deadline`` (``asyncio.timeout_at``); when it passes first, raise
    RpcError DEADLINE_EXCEEDED with ``details()`` (read then: it may say what was waited for).

    A cancel from outside (the caller went away, or an enclosing deadline's timer, which wins
    over this one when both fire at once) passes through as a cancel. asyncio.timeout, not
    wait_for: on 3.11 wait_for can swallow a cancel that arrives just as the result does.
    """
    try:
        async with asyncio.timeout_at(deadline.at):
            yield
    except TimeoutError:
        raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, details()) from None
