"""A scripted PullImage for the fake runtime that takes a while and counts concurrency,
plus a client storm that keeps pulls coming. Used by the lifecycle tests."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from dataclasses import dataclass, field

import grpc

from shim.proto.runtime.v1 import api_pb2

PULL = "/runtime.v1.ImageService/PullImage"
VERSION = "/runtime.v1.RuntimeService/Version"


def pull_request(image: str) -> bytes:
    return api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)).SerializeToString()


def hold_pulls(path: str, refs: list[str], hold_s: float) -> dict[str, int]:
    """PullImage of every one of ``refs`` at once through the socket ``path``, each with a
    deadline of ``hold_s``; returns their status codes, counted. Runs as another uid too
    (tests/support/other_uid.py ``run_as``: JSON in and out)."""
    async def main() -> dict[str, int]:
        async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
            pull = ch.unary_unary(PULL)

            async def one(ref: str) -> str:
                try:
                    await pull(pull_request(ref), timeout=hold_s)
                    return "OK"
                except grpc.aio.AioRpcError as e:
                    return e.code().name

            codes = await asyncio.gather(*(one(r) for r in refs))
        return {c: codes.count(c) for c in set(codes)}
    return asyncio.run(main())


@dataclass
class SlowPulls:
    """Each pull takes ``seconds``; ``current``/``max`` are the runtime's concurrent pulls."""

    seconds: float
    current: int = 0
    max: int = 0
    started: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def __call__(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        self.started.append(image)
        self.current += 1
        self.max = max(self.max, self.current)
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled.append(image)
            raise
        finally:
            self.current -= 1
        self.finished.append(image)
        return api_pb2.PullImageResponse(image_ref="sha256:" + hashlib.sha256(image.encode()).hexdigest()).SerializeToString()

    def reset_max(self) -> None:
        self.max = self.current

    async def wait_current(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.current < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"runtime never had {n} pulls at once (has {self.current})")
            await asyncio.sleep(0.01)

    async def wait_at_most(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.current > n:
            if time.monotonic() > deadline:
                raise AssertionError(f"runtime still has {self.current} pulls, expected <= {n}")
            await asyncio.sleep(0.01)


@dataclass
class Storm:
    """``workers`` clients pulling distinct images back to back, plus a Version poller."""

    channel: grpc.aio.Channel
    workers: int
    call_timeout: float = 30.0
    ok: int = 0
    versions_ok: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _names: itertools.count = field(default_factory=itertools.count)

    def start(self) -> "Storm":
        pull = self.channel.unary_unary(PULL)
        version = self.channel.unary_unary(VERSION)

        async def worker(w: int) -> None:
            while not self._stop.is_set():
                image = f"registry.test/storm/w{w}:{next(self._names)}"
                try:
                    await pull(pull_request(image), timeout=self.call_timeout)
                    self.ok += 1
                except grpc.aio.AioRpcError as e:
                    self.errors.append(f"PullImage {image}: {e.code().name} {e.details()}")

        async def poller() -> None:
            while not self._stop.is_set():
                try:
                    await version(b"", timeout=self.call_timeout)
                    self.versions_ok += 1
                except grpc.aio.AioRpcError as e:
                    self.errors.append(f"Version: {e.code().name} {e.details()}")
                await asyncio.sleep(0.02)

        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(worker(w)) for w in range(self.workers)]
        self._tasks.append(loop.create_task(poller()))
        return self

    async def stop(self) -> None:
        """Let every call in progress finish (none is cancelled by us)."""
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), self.call_timeout + 5)
