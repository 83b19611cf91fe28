"""Passthrough cost: the same calls direct to the runtime and through the shim, interleaved.

    python bench/passthrough.py [--upstream unix:///run/containerd/containerd.sock] [--calls 2000]

Without --upstream it starts a private containerd (tests/support/containerd.py) and
pushes/pulls a few images so ImageStatus/ListImages have something to say. The shim
runs as a separate process (`python -m shim serve`), as on a node. Reports p50/p99
latency per method, calls/s with 16 concurrent callers, and the shim's RSS before and
after 20,000 calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shim.proto.runtime.v1 import api_pb2  # noqa: E402

RS, IS = "/runtime.v1.RuntimeService/", "/runtime.v1.ImageService/"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_shim(upstream: str, workdir: str, extra: dict | None = None) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(workdir, "shim.sock")
    cfg = os.path.join(workdir, "shim.yaml")
    Path(cfg).write_text(json.dumps({"server": {"admin_socket": "", **(extra or {})}}))
    proc = subprocess.Popen([sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}",
                             "--upstream", upstream, "--config", cfg, "--log-level", "warning"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    for _ in range(100):
        if os.path.exists(sock):
            return proc, f"unix://{sock}"
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("shim did not start")


async def latency(ch: grpc.aio.Channel, method: str, req: bytes) -> float:
    t0 = time.perf_counter()
    await ch.unary_unary(method)(req, timeout=10)
    return time.perf_counter() - t0


async def stream_first(ch: grpc.aio.Channel, method: str, req: bytes) -> float:
    t0 = time.perf_counter()
    call = ch.unary_stream(method)(req, timeout=10)
    try:  # containerd 1.6 answers UNIMPLEMENTED: still one full stream round trip
        await asyncio.wait_for(call.read(), 0.05)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        pass
    call.cancel()
    return time.perf_counter() - t0


async def throughput(target: str, method: str, req: bytes, seconds: float, callers: int = 16) -> float:
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        mc = ch.unary_unary(method)
        deadline = time.perf_counter() + seconds
        count = 0

        async def worker() -> None:
            nonlocal count
            while time.perf_counter() < deadline:
                await mc(req, timeout=10)
                count += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(callers)))
        return count / (time.perf_counter() - t0)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


async def run(upstream: str, shim: str, calls: int, tput_seconds: float, image: str) -> dict:
    opts = [("grpc.max_receive_message_length", 64 << 20)]
    status_req = api_pb2.ImageStatusRequest()
    status_req.image.image = image
    cases = {
        "Version": (RS + "Version", b""),
        "ImageStatus": (IS + "ImageStatus", status_req.SerializeToString()),
        "ListImages": (IS + "ListImages", b""),
        "ListContainers": (RS + "ListContainers", b""),
    }
    out: dict = {"latency_ms": {}, "throughput_calls_per_s": {}}
    async with grpc.aio.insecure_channel(upstream, options=opts) as direct, \
            grpc.aio.insecure_channel(shim, options=opts) as via:
        for name, (method, req) in cases.items():
            for _ in range(50):  # warm up both paths
                await latency(direct, method, req)
                await latency(via, method, req)
            d, s = [], []
            for _ in range(calls):  # interleaved, same conditions for both
                d.append(await latency(direct, method, req))
                s.append(await latency(via, method, req))
            out["latency_ms"][name] = {
                "direct_p50": round(statistics.median(d) * 1e3, 3), "shim_p50": round(statistics.median(s) * 1e3, 3),
                "direct_p99": round(pct(d, 0.99) * 1e3, 3), "shim_p99": round(pct(s, 0.99) * 1e3, 3),
                "p50_ratio": round(statistics.median(s) / statistics.median(d), 2),
            }
        d, s = [], []
        for _ in range(min(calls, 300)):
            d.append(await stream_first(direct, RS + "GetContainerEvents", b""))
            s.append(await stream_first(via, RS + "GetContainerEvents", b""))
        out["latency_ms"]["GetContainerEvents(open)"] = {
            "direct_p50": round(statistics.median(d) * 1e3, 3), "shim_p50": round(statistics.median(s) * 1e3, 3)}
    for name in ("Version", "ImageStatus", "ListImages"):
        method, req = cases[name]
        dt = await throughput(upstream, method, req, tput_seconds)
        st = await throughput(shim, method, req, tput_seconds)
        out["throughput_calls_per_s"][name] = {"direct": round(dt), "shim": round(st), "ratio": round(st / dt, 2)}
    return out


async def soak(shim: str, pid: int, n: int) -> dict:
    before = rss_kib(pid)
    fd_before = fds(pid)
    async with grpc.aio.insecure_channel(shim) as ch:
        mc = ch.unary_unary(RS + "Version")
        samples = []
        for i in range(n // 100):
            await asyncio.gather(*(mc(b"", timeout=10) for _ in range(100)))
            if i % 20 == 0:
                samples.append(rss_kib(pid))
    return {"calls": n, "rss_mib_before": round(before / 1024, 1), "rss_mib_after": round(rss_kib(pid) / 1024, 1),
            "rss_mib_max": round(max(samples) / 1024, 1), "fds_before": fd_before, "fds_after": fds(pid)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", help="runtime endpoint (default: start a private containerd)")
    ap.add_argument("--image", default="", help="image for ImageStatus (default: one pushed by the bench)")
    ap.add_argument("--images", type=int, default=20,
                    help="images pulled into the private containerd (ListImages response size grows with it)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--throughput-seconds", type=float, default=5.0)
    ap.add_argument("--soak-calls", type=int, default=20000)
    ap.add_argument("--shim-config", default="{}", help="JSON of extra server.* settings for the shim")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="cri-shim-bench-")
    env_ctx = None
    upstream, image = args.upstream, args.image or "docker.io/library/none:latest"
    if upstream is None:
        from tests.support.bench_env import BenchEnv  # starts registry + containerd, pushes images

        env_ctx = BenchEnv(workdir, images=args.images)
        upstream, image = env_ctx.start()
    proc, shim = start_shim(upstream, workdir, json.loads(args.shim_config))
    try:
        result = asyncio.run(run(upstream, shim, args.calls, args.throughput_seconds, image))
        result["soak"] = asyncio.run(soak(shim, proc.pid, args.soak_calls))
    finally:
        proc.terminate()
        proc.wait(10)
        if env_ctx is not None:
            env_ctx.stop()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'method':28} {'direct p50':>10} {'shim p50':>9} {'ratio':>6} {'direct p99':>10} {'shim p99':>9}")
    for name, r in result["latency_ms"].items():
        print(f"{name:28} {r['direct_p50']:>10} {r['shim_p50']:>9} {r.get('p50_ratio', ''):>6} "
              f"{r.get('direct_p99', ''):>10} {r.get('shim_p99', ''):>9}")
    print("\nthroughput, 16 concurrent callers (calls/s):")
    for name, r in result["throughput_calls_per_s"].items():
        print(f"  {name:14} direct {r['direct']:>7}  shim {r['shim']:>7}  ratio {r['ratio']}")
    s = result["soak"]
    print(f"\nRSS over {s['calls']} calls: {s['rss_mib_before']} -> {s['rss_mib_after']} MiB "
          f"(max {s['rss_mib_max']}), fds {s['fds_before']} -> {s['fds_after']}")


if __name__ == "__main__":
    main()
