"""What one extra hop through the shim costs a passthrough call (full mode).

Starts a scripted runtime (in this process) and the shim (as a process, the way
systemd runs it), then times the same unary call direct and through the shim,
one call at a time. Prints p50/p99 for both and the difference.

    python bench/hop_latency.py [--calls 2000] [--payload 512]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from tests.support.fake_runtime import FakeRuntime, socket_in  # noqa: E402
from tests.support.shim_process import shim_process  # noqa: E402

METHOD = "/runtime.v1.RuntimeService/PodSandboxStatus"


async def _time(endpoint: str, calls: int, payload: bytes) -> list[float]:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        mc = ch.unary_unary(METHOD)
        for _ in range(50):  # warm up
            await mc(payload, timeout=5)
        out = []
        for _ in range(calls):
            t0 = time.perf_counter()
            await mc(payload, timeout=5)
            out.append(time.perf_counter() - t0)
        return out


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e6


async def main(calls: int, payload_size: int) -> None:
    tmp = tempfile.mkdtemp(prefix="bench-hop-")
    rt = await FakeRuntime(socket_in(tmp)).start()
    payload = b"\x0a" + bytes([min(payload_size, 127)]) + b"x" * min(payload_size, 127)
    rt.unary[METHOD] = b"\x0a\x10" + b"y" * 16 + b"z" * payload_size
    try:
        async with shim_process(rt.endpoint, Path(tmp) / "shim", {"log": {"level": "warning"}}) as shim:
            direct = await _time(rt.endpoint, calls, payload)
            via = await _time(shim.endpoint, calls, payload)
    finally:
        await rt.stop()
    for name, xs in (("direct", direct), ("via shim", via)):
        print(f"{name:9s} p50 {_pct(xs, 0.5):7.0f} us  p99 {_pct(xs, 0.99):7.0f} us  mean {statistics.mean(xs)*1e6:7.0f} us")
    print(f"hop cost  p50 {_pct(via, 0.5) - _pct(direct, 0.5):7.0f} us")


if __name__ == "__main__":
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--calls", type=int, default=2000)
    a.add_argument("--payload", type=int, default=512, help="response payload bytes")
    args = a.parse_args()
    asyncio.run(main(args.calls, args.payload))
