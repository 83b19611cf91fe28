"""Passthrough cost: the same calls direct to the runtime, through socat and through the shim, interleaved.

    python bench/passthrough.py [--upstream unix:///run/containerd/containerd.sock --runtime-pid PID]

Without --upstream it starts a private containerd (tests/support/containerd.py) and
pushes/pulls a few images so ImageStatus/ListImages have something to say. The shim
runs as a separate process (`python -m shim serve`), as on a node. socat
(`UNIX-LISTEN:...,fork UNIX-CONNECT:<runtime>`: one process per connection, bytes
forwarded without parsing) is the floor for any relay on the machine. Reports, for
Version, ImageStatus, ListImages and ListContainers: p50/p99 latency of sequential
calls and what socat and the shim add to direct at p50; calls/s with 16 concurrent
callers; CPU seconds of the shim, socat and the runtime per 10,000 relayed calls;
the shim's RSS and fds before and after 20,000 calls.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from shim.proto.runtime.v1 import api_pb2  # noqa: E402

RS, IS = "/runtime.v1.RuntimeService/", "/runtime.v1.ImageService/"
PATHS = ("direct", "socat", "shim")
CALLERS = 16
TICK = os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int, children: bool = False) -> float:
    """utime + stime of ``pid`` (and, with ``children``, of its live children: socat's forks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / TICK
    if children:
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            total += cpu_seconds(int(child))
    return total


def wait_for(path: str, proc: subprocess.Popen, what: str) -> None:
    for _ in range(100):
        if os.path.exists(path):
            return
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"{what} did not start")


def start_shim(upstream: str, workdir: str, extra: dict | None = None) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(workdir, "shim.sock")
    cfg = os.path.join(workdir, "shim.yaml")
    Path(cfg).write_text(json.dumps({"server": {"admin_socket": "", **(extra or {})}}))
    proc = subprocess.Popen([sys.executable, "-m", "shim", "serve", "--listen", f"unix://{sock}",
                             "--upstream", upstream, "--config", cfg, "--log-level", "warning"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wait_for(sock, proc, "shim")
    return proc, f"unix://{sock}"


def start_socat(upstream: str, workdir: str) -> tuple[subprocess.Popen, str]:
    if shutil.which("socat") is None:
        raise SystemExit("socat is not installed (scripts/setup.sh installs it)")
    sock = os.path.join(workdir, "socat.sock")
    proc = subprocess.Popen(["socat", f"UNIX-LISTEN:{sock},fork", f"UNIX-CONNECT:{upstream.removeprefix('unix://')}"])
    wait_for(sock, proc, "socat")
    return proc, f"unix://{sock}"


async def latency(mc: grpc.aio.UnaryUnaryMultiCallable, req: bytes) -> float:
    t0 = time.perf_counter()
    await mc(req, timeout=10)
    return time.perf_counter() - t0


async def callers(mc: grpc.aio.UnaryUnaryMultiCallable, req: bytes, *, seconds: float = 0.0,
                  calls: int = 0) -> tuple[int, float]:
    """CALLERS concurrent loops on one channel, for ``seconds`` or ``calls`` calls: (calls, seconds)."""
    deadline = time.perf_counter() + seconds
    count = 0

    async def worker() -> None:
        nonlocal count
        while (count < calls) if calls else (time.perf_counter() < deadline):
            count += 1
            await mc(req, timeout=10)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CALLERS)))
    return count, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def ms(x: float) -> float:
    return round(x * 1e3, 3)


async def run(targets: dict[str, str], pids: dict[str, int], calls: int, tput_seconds: float, cpu_calls: int,
              image: str) -> dict:
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
    chans = {p: grpc.aio.insecure_channel(targets[p], options=opts) for p in PATHS}
    try:
        for name, (method, req) in cases.items():
            mcs = {p: chans[p].unary_unary(method) for p in PATHS}
            for _ in range(50):  # warm up every path
                for p in PATHS:
                    await latency(mcs[p], req)
            lat: dict[str, list[float]] = {p: [] for p in PATHS}
            orders = itertools.cycle(list(itertools.permutations(PATHS)))
            for _ in range(calls):  # interleaved, in every order, same conditions for all
                for p in next(orders):
                    lat[p].append(await latency(mcs[p], req))
            p50 = {p: statistics.median(lat[p]) for p in PATHS}
            r = {f"{p}_p50": ms(p50[p]) for p in PATHS} | {f"{p}_p99": ms(pct(lat[p], 0.99)) for p in PATHS}
            socat_added, shim_added = p50["socat"] - p50["direct"], p50["shim"] - p50["direct"]
            r |= {"socat_added": ms(socat_added), "shim_added": ms(shim_added),
                  "added_ratio": round(shim_added / socat_added, 2) if socat_added > 0 else None}
            out["latency_ms"][name] = r
        rounds = max(1, round(tput_seconds))  # short slices, interleaved, so load elsewhere hits all paths
        for name, (method, req) in cases.items():
            mcs = {p: chans[p].unary_unary(method) for p in PATHS}
            done = {p: [0, 0.0] for p in PATHS}
            for p in PATHS:
                await callers(mcs[p], req, calls=CALLERS * 4)  # warm up
            for k in range(rounds):
                for p in PATHS[k % 3:] + PATHS[:k % 3]:
                    n, dt = await callers(mcs[p], req, seconds=tput_seconds / rounds)
                    done[p][0] += n
                    done[p][1] += dt
            rate = {p: done[p][0] / done[p][1] for p in PATHS}
            out["throughput_calls_per_s"][name] = {p: round(rate[p]) for p in PATHS} | {
                "socat_ratio": round(rate["socat"] / rate["direct"], 2),
                "shim_ratio": round(rate["shim"] / rate["direct"], 2)}
        # CPU for the same calls: the four methods in turn, 16 callers, direct, through socat, through
        # the shim: the relay's, the runtime's and this client's own (gRPC's threads included)
        cpu: dict = {"calls": cpu_calls}
        me = os.getpid()
        for via, children in (("direct", False), ("socat", True), ("shim", False)):
            relay = pids.get(via)

            def sample() -> tuple[float, float, float]:  # (relay, runtime, client)
                return (cpu_seconds(relay, children) if relay else 0.0, cpu_seconds(pids["runtime"]), cpu_seconds(me))
            before = sample()
            for method, req in cases.values():
                await callers(chans[via].unary_unary(method), req, calls=cpu_calls // len(cases))
            after = sample()
            per = 10000 / cpu_calls
            cpu[via] = {"relay_s_per_10k": round((after[0] - before[0]) * per, 2),
                        "runtime_s_per_10k": round((after[1] - before[1]) * per, 2),
                        "client_s_per_10k": round((after[2] - before[2]) * per, 2)}
            cpu[via]["ratio"] = round(cpu[via]["relay_s_per_10k"] / cpu[via]["runtime_s_per_10k"], 2) \
                if cpu[via]["runtime_s_per_10k"] else None
        out["cpu"] = cpu
    finally:
        for ch in chans.values():
            await ch.close()
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


def report(result: dict) -> None:
    print(f"{'p50, ms':16}{'direct':>8}{'socat':>8}{'shim':>8}{'socat+':>8}{'shim+':>8}{'shim+/socat+':>13}"
          f"{'p99 direct/socat/shim':>24}")
    for name, r in result["latency_ms"].items():
        print(f"{name:16}{r['direct_p50']:>8}{r['socat_p50']:>8}{r['shim_p50']:>8}{r['socat_added']:>8}"
              f"{r['shim_added']:>8}{str(r['added_ratio']):>13}"
              f"{r['direct_p99']:>10}/{r['socat_p99']}/{r['shim_p99']}")
    print(f"\nthroughput, {CALLERS} concurrent callers (calls/s):")
    for name, r in result["throughput_calls_per_s"].items():
        print(f"  {name:14} direct {r['direct']:>6}  socat {r['socat']:>6} ({r['socat_ratio']}x)"
              f"  shim {r['shim']:>6} ({r['shim_ratio']}x)")
    c = result["cpu"]
    print(f"\nCPU seconds per 10,000 calls ({c['calls']} calls, the four methods, {CALLERS} callers):")
    d = c["direct"]
    print(f"  direct       : runtime {d['runtime_s_per_10k']:>5}  client {d['client_s_per_10k']:>5}")
    for via in ("socat", "shim"):
        print(f"  through {via:5}: {via} {c[via]['relay_s_per_10k']:>5}  runtime {c[via]['runtime_s_per_10k']:>5}"
              f"  client {c[via]['client_s_per_10k']:>5}  ({c[via]['ratio']}x the runtime's)")
    s = result["soak"]
    print(f"\nshim RSS over {s['calls']} calls: {s['rss_mib_before']} -> {s['rss_mib_after']} MiB "
          f"(max {s['rss_mib_max']}), fds {s['fds_before']} -> {s['fds_after']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", help="runtime endpoint (default: start a private containerd)")
    ap.add_argument("--runtime-pid", type=int, help="with --upstream: the runtime's pid, for its CPU time")
    ap.add_argument("--image", default="", help="image for ImageStatus (default: one pushed by the bench)")
    ap.add_argument("--images", type=int, default=20,
                    help="images pulled into the private containerd (ListImages response size grows with it)")
    ap.add_argument("--calls", type=int, default=2000, help="sequential calls per method and path")
    ap.add_argument("--throughput-seconds", type=float, default=6.0, help="per method and path")
    ap.add_argument("--cpu-calls", type=int, default=20000)
    ap.add_argument("--soak-calls", type=int, default=20000)
    ap.add_argument("--shim-config", default="{}", help="JSON of extra server.* settings for the shim")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.upstream and not args.runtime_pid:
        ap.error("--upstream needs --runtime-pid")
    workdir = tempfile.mkdtemp(prefix="cri-shim-bench-")
    env_ctx = None
    upstream, image, runtime_pid = args.upstream, args.image or "docker.io/library/none:latest", args.runtime_pid
    procs: list[subprocess.Popen] = []
    try:
        if upstream is None:
            from tests.support.bench_env import BenchEnv  # starts registry + containerd, pushes images

            env_ctx = BenchEnv(workdir, images=args.images)
            upstream, image = env_ctx.start()
            runtime_pid = env_ctx.containerd.pid
        shim_proc, shim = start_shim(upstream, workdir, json.loads(args.shim_config))
        procs.append(shim_proc)
        socat_proc, socat = start_socat(upstream, workdir)
        procs.append(socat_proc)
        targets = {"direct": upstream, "socat": socat, "shim": shim}
        pids = {"shim": shim_proc.pid, "socat": socat_proc.pid, "runtime": runtime_pid}
        result = asyncio.run(run(targets, pids, args.calls, args.throughput_seconds, args.cpu_calls, image))
        result["soak"] = asyncio.run(soak(shim, shim_proc.pid, args.soak_calls))
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if env_ctx is not None:
            env_ctx.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
