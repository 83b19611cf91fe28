"""The call deadline (shim/cri/deadline.py): enforced once per layer on one absolute time, judged once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shim.cri.deadline import DEADLINE_SLACK_SECONDS, NO_DEADLINE, Deadline, ended, enforced
from shim.errors import RpcError


async def test_a_call_cancelled_at_its_deadline_ended_by_it_and_one_cancelled_before_by_a_cancel() -> None:
    assert ended(Deadline.after(DEADLINE_SLACK_SECONDS / 2)) is grpc.StatusCode.DEADLINE_EXCEEDED
    assert ended(Deadline.after(-1.0)) is grpc.StatusCode.DEADLINE_EXCEEDED
    assert ended(Deadline.after(10.0)) is grpc.StatusCode.CANCELLED
    assert ended(NO_DEADLINE) is grpc.StatusCode.CANCELLED


async def test_within_keeps_the_sooner_deadline() -> None:
    soon = Deadline.after(1.0)
    assert soon.within(60.0) is soon
    capped = Deadline.after(60.0).within(1.0)
    assert capped.at is not None and soon.at is not None and abs(capped.at - soon.at) < 0.5
    assert NO_DEADLINE.within(2.0).remaining() == pytest.approx(2.0, abs=0.5)
    assert NO_DEADLINE.remaining() is None
    assert Deadline.after(-5.0).remaining() == 0.0


async def test_a_passed_deadline_is_answered_deadline_exceeded_with_what_was_waited_for() -> None:
    with pytest.raises(RpcError) as e:
        async with enforced(Deadline.after(0.01), lambda: "cri-shim: deadline exceeded waiting for x"):
            await asyncio.sleep(10)
    assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert e.value.details == "cri-shim: deadline exceeded waiting for x"


async def test_the_outer_layer_answers_when_two_layers_share_one_deadline() -> None:
    """The relay and the pull scheduler enforce the same absolute time: the relay answers,
    and the scheduler sees a cancel (its waiter leaves; the flight is not its to fail)."""
    deadline = Deadline.after(0.02)
    inner_saw: list[str] = []

    async def inner() -> None:
        try:
            async with enforced(deadline, lambda: "inner"):
                await asyncio.sleep(10)
        except asyncio.CancelledError:
            inner_saw.append("cancel")
            raise

    with pytest.raises(RpcError) as e:
        async with enforced(deadline, lambda: "outer"):
            await inner()
    assert e.value.details == "outer" and inner_saw == ["cancel"]


async def test_a_cancel_from_the_caller_stays_a_cancel() -> None:
    task = asyncio.create_task(_wait(Deadline.after(10.0)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _wait(deadline: Deadline) -> None:
    async with enforced(deadline, lambda: "never"):
        await asyncio.sleep(10)
