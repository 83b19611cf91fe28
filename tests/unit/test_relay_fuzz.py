"""Garbage on the wire closes that one connection; the shim keeps serving everyone else."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shim.relay import http2
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim

VERSION = "/runtime.v1.RuntimeService/Version"

frames = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 255), st.integers(0, 9), st.binary(max_size=64)),
    max_size=8,
).map(lambda fs: b"".join(http2.frame(t, f, sid, p) for t, f, sid, p in fs))


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    loop = asyncio.new_event_loop()
    rt = FakeRuntime(socket_in(str(tmp_path_factory.mktemp("rt"))))
    rt.unary[VERSION] = b"ok"
    loop.run_until_complete(rt.start())
    cm = running_shim(rt.endpoint, engine="relay")
    shim = loop.run_until_complete(cm.__aenter__())
    yield loop, shim
    loop.run_until_complete(cm.__aexit__(None, None, None))
    loop.run_until_complete(rt.stop())
    loop.close()


async def _send_garbage(path: str, data: bytes, with_preface: bool) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write((http2.PREFACE if with_preface else b"") + data)
    try:
        await writer.drain()
        await asyncio.wait_for(reader.read(65536), 0.2)
    except (ConnectionError, asyncio.TimeoutError):
        pass
    writer.close()


async def _still_serves(endpoint: str) -> bytes:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        return await ch.unary_unary(VERSION)(b"", timeout=5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(frames, st.binary(max_size=200)), with_preface=st.booleans())
def test_garbage_frames_never_take_the_shim_down(fuzz_env, data: bytes, with_preface: bool) -> None:
    loop, shim = fuzz_env
    loop.run_until_complete(_send_garbage(shim.path, data, with_preface))
    assert loop.run_until_complete(_still_serves(shim.endpoint)) == b"ok"
