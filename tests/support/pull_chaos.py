"""Randomized pull storms with callers that give up: shared by the quick test and the soak.

:class:`ScriptedPulls` is the runtime's PullImage: each pull takes a random time,
answers ``image_ref = "<image>|<user>"`` (so a caller can tell whose pull it got),
fails with NOT_FOUND for images whose name ends in ``bad``, and counts how many pulls
run at once *in the runtime* (the cap the shim must keep).

:func:`storm` sends callers at the shim, each picking an image from a small set
(so pulls collapse), one of a few credentials, and a fate: wait (a long deadline),
a short deadline (it may run out while queued or while the pull is in flight), or
a cancel after a random delay. A third of those who give up ask for an image of
their own, so that their leaving cancels the runtime's pull. Survivors (fate ``wait``) must get the answer of
their own pull. Returns the tally.
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc

from shim.proto.runtime.v1 import api_pb2

PULL = "/runtime.v1.ImageService/PullImage"
USERS = ("", "alice", "bob")


def expected(image: str, user: str) -> tuple[grpc.StatusCode, bytes | str]:
    if image.endswith("bad:1"):
        return grpc.StatusCode.NOT_FOUND, f"{image} not found"
    return grpc.StatusCode.OK, api_pb2.PullImageResponse(image_ref=f"{image}|{user}").SerializeToString()


@dataclass
class ScriptedPulls:
    mean_seconds: float = 0.03
    active: int = 0
    max_active: int = 0
    calls: int = 0
    cancelled: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(1))

    async def __call__(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.active += 1
        self.calls += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.rng.expovariate(1 / self.mean_seconds))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
        req = api_pb2.PullImageRequest.FromString(request)
        code, answer = expected(req.image.image, req.auth.username)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, str(answer))
        return answer  # type: ignore[return-value]


@dataclass
class Tally:
    callers: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)  # "<fate>:<code>"
    wrong: list[str] = field(default_factory=list)  # survivors that got someone else's answer
    seconds: float = 0.0

    def survivors(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.startswith("wait:"))


async def one_caller(chans: list[grpc.aio.Channel], rng: random.Random, n: int, tally: Tally,
                     names: list[str], wait_share: float = 0.4) -> None:
    """One caller of the storm, with a random image, credentials and fate; its outcome goes in ``tally``."""
    r = rng.random()
    fate = "wait" if r < wait_share else "deadline" if r < (1 + wait_share) / 2 else "cancel"
    # A third of those who give up want an image nobody else does: their leaving cancels the pull.
    solo = fate != "wait" and rng.random() < 1 / 3
    image, user = f"reg/solo{n}:1" if solo else rng.choice(names), rng.choice(USERS)
    req = api_pb2.PullImageRequest()
    req.image.image = image
    if user:
        req.auth.username, req.auth.password = user, f"{user}-pw"
    timeout = 30.0 if fate != "deadline" else rng.uniform(0.005, 0.15)
    call = rng.choice(chans).unary_unary(PULL)(req.SerializeToString(), timeout=timeout)
    if fate == "cancel":
        asyncio.get_running_loop().call_later(rng.uniform(0, 0.1), call.cancel)
    try:
        response = await call
        code, got = grpc.StatusCode.OK, response
    except asyncio.CancelledError:
        code, got = grpc.StatusCode.CANCELLED, None
    except grpc.aio.AioRpcError as e:
        code, got = e.code(), e.details()
    tally.outcomes[f"{fate}:{code.name}"] += 1
    if fate == "wait" and (code, got) != expected(image, user):
        tally.wrong.append(f"{image} as {user or '-'}: {code.name} {got!r}")


def image_names(images: int = 12) -> list[str]:
    return [f"reg/img{i}:1" for i in range(images - 1)] + ["reg/bad:1"]


async def storm(endpoint: str, *, callers: int | None = None, seconds: float | None = None, seed: int = 0,
                images: int = 12, channels: int = 4, max_in_progress: int = 200, wait_share: float = 0.4) -> Tally:
    """Run callers until ``callers`` were sent or ``seconds`` passed (whichever is given)."""
    rng = random.Random(seed)
    chans = [grpc.aio.insecure_channel(endpoint) for _ in range(channels)]
    names = image_names(images)
    tally = Tally()
    slots = asyncio.Semaphore(max_in_progress)

    async def caller(n: int) -> None:
        try:
            await one_caller(chans, rng, n, tally, names, wait_share)
        finally:
            slots.release()

    t0 = time.monotonic()
    tasks = []
    try:
        while (callers is None or tally.callers < callers) and (seconds is None or time.monotonic() - t0 < seconds):
            await slots.acquire()
            tasks.append(asyncio.ensure_future(caller(tally.callers)))
            tally.callers += 1
            await asyncio.sleep(rng.uniform(0, 0.004))
        await asyncio.gather(*tasks)
    finally:
        for ch in chans:
            await ch.close()
    tally.seconds = time.monotonic() - t0
    return tally


def gauges(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:  # closed now, not at the next GC
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("cri_shim_pulls_in_flight", "cri_shim_pull_queue_length"):
            out[name] = float(value)
    return out


async def settled_gauges(metrics_port: int, timeout: float = 5.0) -> dict[str, float]:
    """The pull gauges once they are 0 (or whatever they are after ``timeout``)."""
    end = time.monotonic() + timeout
    while True:
        g = await asyncio.to_thread(gauges, metrics_port)
        if not any(g.values()) or time.monotonic() > end:
            return g
        await asyncio.sleep(0.1)
