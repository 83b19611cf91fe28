"""Log volume a client can cause is bounded: client strings are cut in every line, lines of one
kind are rate-limited with a count of those dropped, and an image name longer than any image
reference is refused with INVALID_ARGUMENT before it reaches a log (or the runtime)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import grpc
import pytest

from shim.observability import logs
from shim import reference
from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import shim_process
from tests.support.fake_images import FakeImageStore, StoredImage, image_id
from tests.support.slow_pulls import PULL, VERSION, pull_request

REMOVE = "/runtime.v1.ImageService/RemoveImage"
STATUS = "/runtime.v1.ImageService/ImageStatus"


def record(msg: str = "pull refused", level: int = logging.INFO, name: str = "cri_shim.pull",
           exc: BaseException | None = None, **fields: object) -> logging.LogRecord:
    r = logging.LogRecord(name, level, __file__, 1, msg, (), (type(exc), exc, None) if exc else None)
    r.fields = fields  # type: ignore[attr-defined]
    return r


@pytest.mark.parametrize("formatter", [logs.KeyValueFormatter(), logs.JsonFormatter()], ids=["text", "json"])
def test_every_field_and_error_line_is_cut(formatter: logging.Formatter) -> None:
    huge = "a" * (1 << 20)
    try:
        raise ValueError(f"bad name {huge}")
    except ValueError as e:
        err = e
    line = formatter.format(record(image=huge, method="/" + huge, exc=err, count=3))
    assert len(line) < 5 * logs.FIELD_MAX_CHARS
    assert line.count(f"[{(1 << 20) - logs.FIELD_MAX_CHARS} more chars]") == 1  # image
    if isinstance(formatter, logs.JsonFormatter):
        assert json.loads(line)["count"] == 3
    short = formatter.format(record(image="docker.io/library/nginx:1"))
    assert "docker.io/library/nginx:1" in short and "more chars" not in short


def test_shown_quotes_a_short_escaped_part() -> None:
    assert logs.shown("ab\ncd") == "'ab\\ncd'"
    assert len(logs.shown("x" * 10**6)) <= logs.QUOTE_MAX_CHARS + 2
    nested = [[["deep"] * 10**4] * 10**4]  # formatting it whole would take minutes
    assert len(logs.shown(nested)) < 100


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lines_of_one_kind_are_rate_limited_with_a_count() -> None:
    clock = Clock()
    limit = logs.RateLimit(max_repeats=20, window=10.0, clock=clock)
    passed = [r for r in (record(image=f"i{i}") for i in range(50)) if limit.filter(r)]
    assert len(passed) == 20 and all("suppressed" not in r.fields for r in passed)  # type: ignore[attr-defined]
    assert limit.filter(record("another kind"))  # kinds are counted apart
    assert all(limit.filter(record(level=logging.DEBUG)) for _ in range(100))  # debug is not limited
    clock.now += 9.9
    assert not limit.filter(record())
    clock.now += 0.1  # a new window: the first line says how many were dropped
    first = record()
    assert limit.filter(first) and first.fields["suppressed"] == 31  # type: ignore[attr-defined]
    second = record()
    assert limit.filter(second) and "suppressed" not in second.fields  # type: ignore[attr-defined]
    off = logs.RateLimit(max_repeats=0, window=10.0, clock=clock)
    assert all(off.filter(record()) for _ in range(100))


@pytest.mark.parametrize("length", [reference.MAX_LENGTH + 1, 1 << 20])
async def test_overlong_image_names_are_refused_and_leave_the_log_small(runtime: FakeRuntime, tmp_path,
                                                                       length: int) -> None:
    """200 PullImage calls with a long name (and RemoveImage / ImageStatus, intercepted
    because of a pin): INVALID_ARGUMENT, nothing reaches the runtime, the log stays small
    (before: 110 MB of log in 11 s for 1 MiB names), and an honest client is served."""
    runtime.unary[VERSION] = b"\x0a\x050.1.0"
    name = "registry.example.com/" + "a" * (length - len("registry.example.com/"))
    settings = {"server": {"admin_socket": ""}, "pins": {"images": ["nginx"]}}
    async with shim_process(runtime.endpoint, tmp_path, settings) as shim:
        before = len(shim.logs().encode())
        async with grpc.aio.insecure_channel(shim.endpoint, options=[
                ("grpc.max_send_message_length", 8 << 20)]) as ch:
            pull = ch.unary_unary(PULL)
            codes = []
            for _ in range(20):
                results = await asyncio.gather(*(pull(pull_request(name), timeout=30) for _ in range(10)),
                                               return_exceptions=True)
                codes += [r.code() if isinstance(r, grpc.aio.AioRpcError) else r for r in results]
            spec = api_pb2.ImageSpec(image=name)
            for method, req in ((REMOVE, api_pb2.RemoveImageRequest(image=spec)),
                                (STATUS, api_pb2.ImageStatusRequest(image=spec))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ch.unary_unary(method)(req.SerializeToString(), timeout=30)
                if req.ByteSize() > 1 << 20:  # over the method's request limit: refused before it is read
                    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert f"server.max_request_bytes.{method.rsplit('/', 1)[1]}" in e.value.details()
                else:
                    codes.append(e.value.code())
                    assert f"has {length} characters" in e.value.details()
            await ch.unary_unary(VERSION)(b"", timeout=10)
        assert len(codes) >= 200 and set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
        assert runtime.calls("PullImage") == [] and runtime.calls("RemoveImage") == []
        grown = len(shim.logs().encode()) - before
        print(f"\nlog bytes after 202 refused calls with {length}-character names: {grown}", file=sys.stderr)
        assert grown < 64 * 1024, shim.logs()[-3000:]
        assert shim.proc.poll() is None


async def test_repeated_lines_are_rate_limited_with_a_count(runtime: FakeRuntime, tmp_path) -> None:
    """90 RemoveImage calls for a pinned image, each refused with an info line: 20 lines per
    window are written; the first line of the next window says how many were dropped."""
    FakeImageStore([StoredImage(image_id(1), ["docker.io/library/nginx:latest"], [])]).install(runtime)
    window = 3.0
    settings = {"server": {"admin_socket": ""}, "pins": {"images": ["nginx"]},
                "log": {"max_repeats": 20, "repeat_window_seconds": window}}
    remove = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image="nginx")).SerializeToString()
    async with shim_process(runtime.endpoint, tmp_path, settings) as shim:
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            call = ch.unary_unary(REMOVE)
            t = time.monotonic()
            for _ in range(90):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(remove, timeout=10)
                assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            took = time.monotonic() - t
            end = await shim.await_log("remove refused")
            await asyncio.sleep(window)
            with pytest.raises(grpc.aio.AioRpcError):
                await call(remove, timeout=10)
            await shim.await_log("suppressed=", after=end)
        lines = [ln for ln in shim.logs().splitlines() if "remove refused" in ln]
        windows = int(took // window) + 1  # windows the 90 calls took
        assert 21 <= len(lines) <= 20 * windows + 1, (len(lines), took)
        dropped = int(lines[-1].split("suppressed=")[1].split()[0])
        counted = sum(int(ln.split("suppressed=")[1].split()[0]) for ln in lines if "suppressed=" in ln)
        assert len(lines) + counted == 91, (len(lines), counted)  # every refusal written or counted
        print(f"\n90 refusals in {took:.1f} s: {len(lines) - 1} lines written, then suppressed={dropped}",
              file=sys.stderr)
