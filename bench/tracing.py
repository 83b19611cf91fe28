"""What tracing costs per CRI call through the shim (fake runtime, in-process shim).

    python bench/tracing.py [--calls 2000] [--rounds 3] [--base REV] [--engine relay|grpc] [--uvloop]

Each mode runs in a fresh process (client, shim and fake runtime on one event loop)
and makes ``--calls`` sequential calls after a warm-up. Reported per call: wall time
(median over batches of 100) and process CPU time (includes the span exporter's
thread; the OTLP collector runs in a separate process and is not counted).

Modes (Version is a passthrough call, PullImage an intercepted one):

- direct          client -> fake runtime, no shim
- main-off        through the shim at ``--base`` (default: the merge base with main, the
                  code before tracing existed; exported with ``git archive`` to a temp dir)
- off             through this shim, no OTEL_* set: tracing off
- on-nocontext    OTEL endpoint set, caller sends no traceparent (kubelet tracing off)
- on-unsampled    ... caller's traceparent has sampled=0 (kubelet's default rate)
- on-sampled      ... caller's traceparent is sampled: every call is a span, exported
- pull-off / pull-on-sampled   the same for PullImage (scheduler, decode, metrics)

Rounds interleave the modes; the table shows the median and the best round (on a
shared machine the best round is the steadier estimate of the code's own cost).

``--micro`` instead times the tracing steps alone, per call, in a tight loop (process
CPU, exporter thread included): the check a passthrough call from an unsampled caller
pays, extract+start+inject+end of an unsampled server span (intercepted calls always
make one), and of a sampled one exported over OTLP/gRPC to a collector process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)
VERSION = "/runtime.v1.RuntimeService/Version"
PULL = "/runtime.v1.ImageService/PullImage"
SAMPLED = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
UNSAMPLED = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-00"

MODES = {
    # mode: (root, method, traceparent, tracing on)
    "direct": (None, VERSION, None, False),
    "main-off": ("main", VERSION, SAMPLED, False),
    "off": ("here", VERSION, SAMPLED, False),
    "on-nocontext": ("here", VERSION, None, True),
    "on-unsampled": ("here", VERSION, UNSAMPLED, True),
    "on-sampled": ("here", VERSION, SAMPLED, True),
    "pull-main-off": ("main", PULL, SAMPLED, False),
    "pull-off": ("here", PULL, SAMPLED, False),
    "pull-on-sampled": ("here", PULL, SAMPLED, True),
}


async def child(method: str, traceparent: str | None, through_shim: bool, calls: int,
                engine: str) -> dict[str, float]:
    import tempfile

    import grpc

    from shim.proto.runtime.v1 import api_pb2
    from tests.support.fake_runtime import FakeRuntime, socket_in
    from tests.support.inproc import running_shim

    workdir = tempfile.mkdtemp(prefix="bench-")
    rt = await FakeRuntime(socket_in(workdir)).start()
    rt.unary[VERSION] = b"\x0a\x050.1.0\x12\x0acontainerd"
    rt.unary[PULL] = api_pb2.PullImageResponse(image_ref="sha256:" + "0" * 64).SerializeToString()
    request = (api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image="docker.io/library/bench:1"))
               .SerializeToString() if method == PULL else b"")
    md = (("traceparent", traceparent),) if traceparent else None

    async def run(endpoint: str) -> dict[str, float]:
        async with grpc.aio.insecure_channel(endpoint) as ch:
            mc = ch.unary_unary(method)
            for _ in range(300):
                await mc(request, metadata=md, timeout=10)
            rt.received.clear()
            batches = []
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(calls // 100):
                t = time.perf_counter()
                for _ in range(100):
                    await mc(request, metadata=md, timeout=10)
                    rt.received.clear()
                batches.append((time.perf_counter() - t) / 100)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return {"wall_us": statistics.median(batches) * 1e6, "cpu_us": cpu / (len(batches) * 100) * 1e6,
                "mean_wall_us": wall / (len(batches) * 100) * 1e6}

    try:
        if not through_shim:
            return await run(rt.endpoint)
        async with running_shim(rt.endpoint, engine=engine) as shim:
            out = await run(shim.endpoint)
            out["tracing"] = bool(getattr(getattr(shim.app, "tracing", None), "enabled", False))
            return out
    finally:
        await rt.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def run_child(args: argparse.Namespace) -> None:
    root, method, traceparent, _ = MODES[args.child]
    # The measured code: this child imports shim (and tests.support) from --root, this
    # checkout or the --base export; the one place a benchmark picks its import path itself.
    sys.path.insert(0, str(args.root))
    os.chdir(args.root)
    if args.uvloop:
        import uvloop

        uvloop.install()
    out = asyncio.run(child(method, traceparent, root is not None, args.calls, args.engine))
    print(json.dumps(out))


async def _collector_main() -> None:
    from tests.support.otlp_collector import OtlpCollector

    col = await OtlpCollector().start()
    print(col.port, flush=True)
    while True:
        await asyncio.sleep(3600)


def run_micro(args: argparse.Namespace) -> None:
    collector = subprocess.Popen([sys.executable, __file__, "--collector"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(collector.stdout.readline())  # type: ignore[union-attr]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
        env["OTEL_BSP_MAX_QUEUE_SIZE"] = "100000"  # measure export cost, not drops
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
        code = MICRO.replace("N_CALLS", str(args.calls * 10))
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
    finally:
        collector.terminate()
        collector.wait()


MICRO = """
import time, grpc
from shim.observability.tracing import Tracing
from shim.cri.methods import canonical
from shim.grpc_engine.proxy import forward_metadata
n = N_CALLS
md = (("user-agent", "kubelet"), ("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"), ("tracestate", "k=v"))
unsampled = (("user-agent", "kubelet"), ("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-00"))
class Ctx:
    def invocation_metadata(self): return unsampled
ctx = Ctx()
def cpu(fn, n):
    t = time.process_time()
    fn(n)
    return (time.process_time() - t) / n * 1e6
t = Tracing.from_env(route=canonical)
assert t.enabled
def scan(n):
    for _ in range(n):
        assert not t.wants_passthrough_span(forward_metadata(ctx))
def span(m):
    def go(n):
        for _ in range(n):
            s, out = t.server_span("/runtime.v1.RuntimeService/Version", m)
            t.end(s, grpc.StatusCode.OK)
    return go
print(f"passthrough, caller not sampled: check {cpu(scan, n):7.2f} us/call (no span)")
print(f"span, caller not sampled (intercepted)  {cpu(span(unsampled), n):7.2f} us/call")
n2 = n // 5
t0 = time.process_time()
span(md)(n2)
made = time.process_time() - t0
t.force_flush(60000)
total = time.process_time() - t0
print(f"span, sampled: create+end               {made / n2 * 1e6:7.2f} us/call")
print(f"span, sampled: incl. OTLP export        {total / n2 * 1e6:7.2f} us/call  ({n2} spans)")
t.shutdown()
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base", default="", help="git revision without tracing (default: merge-base HEAD main)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("--engine", default="relay", choices=["relay", "grpc"])
    p.add_argument("--child")
    p.add_argument("--root", default=str(HERE))
    p.add_argument("--collector", action="store_true")
    p.add_argument("--micro", action="store_true")
    args = p.parse_args()
    if args.collector:
        asyncio.run(_collector_main())
        return
    if args.child:
        run_child(args)
        return
    if args.micro:
        run_micro(args)
        return

    import tempfile

    base = args.base or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=HERE, capture_output=True,
                                       text=True, check=True).stdout.strip()
    base_dir = tempfile.mkdtemp(prefix="bench-base-")
    archive = subprocess.run(["git", "archive", base], cwd=HERE, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", base_dir], input=archive, check=True)
    print(f"base {base[:12]} in {base_dir}", file=sys.stderr)
    collector = subprocess.Popen([sys.executable, __file__, "--collector"], stdout=subprocess.PIPE, text=True)
    port = int(collector.stdout.readline())  # type: ignore[union-attr]
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            for mode in modes:
                root, _, _, on = MODES[mode]
                env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
                if on:
                    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
                cmd = [sys.executable, __file__, "--child", mode, "--calls", str(args.calls),
                       "--root", base_dir if root == "main" else str(HERE), "--engine", args.engine] + \
                    (["--uvloop"] if args.uvloop else [])
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1} {mode:16} {results[mode][-1]}", file=sys.stderr)
    finally:
        collector.terminate()
        collector.wait()

    print(f"\nengine {args.engine}, {args.rounds} rounds of {args.calls} sequential calls"
          f"{', uvloop' if args.uvloop else ''}; microseconds per call")
    print(f"{'mode':18}{'wall median':>12}{'wall best':>12}{'cpu median':>12}{'cpu best':>12}")
    for mode in modes:
        wall = [x["wall_us"] for x in results[mode]]
        cpu = [x["cpu_us"] for x in results[mode]]
        print(f"{mode:18}{statistics.median(wall):12.1f}{min(wall):12.1f}{statistics.median(cpu):12.1f}{min(cpu):12.1f}")


if __name__ == "__main__":
    main()
