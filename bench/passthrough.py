"""Passthrough cost: the same calls direct to the runtime, through socat, nghttpx, HAProxy and the shim, interleaved.

    python bench/passthrough.py [--upstream unix:///run/containerd/containerd.sock --runtime-pid PID]

Needs (installs nothing): containerd, docker-registry and skopeo for the private runtime
(tests/support/bench_env.py), and the three relays beside the shim:
`apt-get install -y socat nghttp2-proxy haproxy` (Debian 12: socat 1.7.4, nghttpx 1.52,
HAProxy 2.6).

Without --upstream it starts a private containerd (tests/support/containerd.py) and
pushes/pulls a few images so ImageStatus/ListImages have something to say. The shim
runs as a separate process (`python -m shim serve`), as on a node. socat
(`UNIX-LISTEN:...,fork UNIX-CONNECT:<runtime>`: one process per connection, bytes
forwarded without parsing) is the floor for any relay on the machine. nghttpx and HAProxy
are HTTP/2-aware proxies that parse every frame as the shim does: each listens on a unix
socket and forwards to the runtime's, with HTTP/2 in clear text (prior knowledge, what gRPC
speaks) on both sides, one worker/thread each (`nghttpx --workers=1`: a main process and
one worker; HAProxy `nbthread 1`, `proto h2` on the bind and the server line). Before
measuring, every path must answer Version and relay an UNIMPLEMENTED status (carried in
trailers) unchanged; the runtime only speaks HTTP/2, so that proves h2 on both sides.
Reports, for Version, ImageStatus, ListImages and ListContainers: p50/p99 latency of
sequential calls and what each relay adds to direct at p50; calls/s with 16 concurrent
callers; CPU seconds of each relay and the runtime per 10,000 relayed calls; every relay's
RSS at the end; the shim's RSS and fds before and after 20,000 calls. The load average is
printed with the figures: on a busy machine they are noise.
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
RELAYS = ("socat", "nghttpx", "haproxy", "shim")
PATHS = ("direct", *RELAYS)
FORKING = ("socat", "nghttpx")  # relays whose work is done in child processes (counted with them)
INSTALL = {"socat": "socat", "nghttpx": "nghttp2-proxy", "haproxy": "haproxy"}  # binary -> Debian package
CALLERS = 16
TICK = os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int, children: bool = False) -> int:
    """VmRSS of ``pid`` (and, with ``children``, of its live children: socat's forks, nghttpx's worker)."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total = int(line.split()[1])
    if children:
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            total += rss_kib(int(child))
    return total


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int, children: bool = False) -> float:
    """utime + stime of ``pid`` (and, with ``children``, of its live children: socat's forks, nghttpx's worker)."""
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


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise SystemExit(f"{binary} is not installed (apt-get install -y {INSTALL[binary]})")
    return path


def start_socat(upstream: str, workdir: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(workdir, "socat.sock")
    proc = subprocess.Popen([need("socat"), f"UNIX-LISTEN:{sock},fork",
                             f"UNIX-CONNECT:{upstream.removeprefix('unix://')}"])
    wait_for(sock, proc, "socat")
    return proc, f"unix://{sock}"


def start_nghttpx(upstream: str, workdir: str) -> tuple[subprocess.Popen, str]:
    """nghttpx: h2c (prior knowledge) on a unix socket, h2 to the runtime's unix socket."""
    sock = os.path.join(workdir, "nghttpx.sock")
    proc = subprocess.Popen([need("nghttpx"), "--conf=/dev/null", f"--frontend=unix:{sock};no-tls",
                             f"--backend=unix:{upstream.removeprefix('unix://')};;proto=h2", "--workers=1",
                             "--no-via", f"--errorlog-file={os.path.join(workdir, 'nghttpx.log')}"])
    wait_for(sock, proc, "nghttpx")
    return proc, f"unix://{sock}"


def start_haproxy(upstream: str, workdir: str) -> tuple[subprocess.Popen, str]:
    """HAProxy in HTTP mode: `proto h2` on the unix bind (h2c prior knowledge) and on the server."""
    sock = os.path.join(workdir, "haproxy.sock")
    cfg = os.path.join(workdir, "haproxy.cfg")
    Path(cfg).write_text(f"""global
    nbthread 1

defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s

frontend cri
    bind unix@{sock} proto h2
    default_backend runtime

backend runtime
    server runtime unix@{upstream.removeprefix('unix://')} proto h2
""")
    proc = subprocess.Popen([need("haproxy"), "-db", "-f", cfg])  # -db: foreground, one process
    wait_for(sock, proc, "haproxy")
    return proc, f"unix://{sock}"


async def check_paths(targets: dict[str, str]) -> None:
    """Every path answers Version, and relays a status in trailers (UNIMPLEMENTED) as the runtime sent it.

    The runtime (grpc-go) speaks only HTTP/2 and gRPC clients h2 with prior knowledge, so this
    proves each relay speaks h2 on both sides and forwards trailers."""
    for p, target in targets.items():
        async with grpc.aio.insecure_channel(target) as ch:
            try:
                await ch.unary_unary(RS + "Version")(b"", timeout=10)
            except grpc.aio.AioRpcError as e:
                raise SystemExit(f"{p}: Version failed: {e.code().name} {e.details()}") from None
            try:
                await ch.unary_unary(RS + "NoSuchMethod")(b"", timeout=10)
                raise SystemExit(f"{p}: an unknown method succeeded")
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise SystemExit(f"{p}: an unknown method gave {e.code().name} {e.details()}, "
                                     "not the runtime's UNIMPLEMENTED") from None


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
            added = {p: p50[p] - p50["direct"] for p in RELAYS}
            r |= {f"{p}_added": ms(added[p]) for p in RELAYS}
            r["added_ratio"] = round(added["shim"] / added["socat"], 2) if added["socat"] > 0 else None
            out["latency_ms"][name] = r
        rounds = max(1, round(tput_seconds))  # short slices, interleaved, so load elsewhere hits all paths
        for name, (method, req) in cases.items():
            mcs = {p: chans[p].unary_unary(method) for p in PATHS}
            done = {p: [0, 0.0] for p in PATHS}
            for p in PATHS:
                await callers(mcs[p], req, calls=CALLERS * 4)  # warm up
            for k in range(rounds):
                for p in PATHS[k % len(PATHS):] + PATHS[:k % len(PATHS)]:
                    n, dt = await callers(mcs[p], req, seconds=tput_seconds / rounds)
                    done[p][0] += n
                    done[p][1] += dt
            rate = {p: done[p][0] / done[p][1] for p in PATHS}
            out["throughput_calls_per_s"][name] = {p: round(rate[p]) for p in PATHS} | {
                f"{p}_ratio": round(rate[p] / rate["direct"], 2) for p in RELAYS}
        # CPU for the same calls: the four methods in turn, 16 callers, direct and through each relay:
        # the relay's, the runtime's and this client's own (gRPC's threads included)
        cpu: dict = {"calls": cpu_calls}
        me = os.getpid()
        for via in PATHS:
            relay = pids.get(via)
            children = via in FORKING

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
    load = result.get("load_average")
    if load:
        print(f"load average (1, 5, 15 min) before: {load['before']}, after: {load['after']}")
    print(f"{'p50, ms':16}" + "".join(f"{p:>9}" for p in PATHS) + "  | added:" + "".join(f"{p:>9}" for p in RELAYS)
          + f"{'shim+/socat+':>14}")
    for name, r in result["latency_ms"].items():
        print(f"{name:16}" + "".join(f"{r[p + '_p50']:>9}" for p in PATHS) + "  |       "
              + "".join(f"{r[p + '_added']:>9}" for p in RELAYS) + f"{str(r['added_ratio']):>14}")
    print("p99, ms: " + "; ".join(f"{name} " + "/".join(str(r[p + "_p99"]) for p in PATHS)
                                  for name, r in result["latency_ms"].items()) + f"  ({'/'.join(PATHS)})")
    print(f"\nthroughput, {CALLERS} concurrent callers (calls/s, and x direct):")
    for name, r in result["throughput_calls_per_s"].items():
        print(f"  {name:14} direct {r['direct']:>6}" + "".join(f"  {p} {r[p]:>6} ({r[p + '_ratio']}x)" for p in RELAYS))
    c = result["cpu"]
    print(f"\nCPU seconds per 10,000 calls ({c['calls']} calls, the four methods, {CALLERS} callers):")
    d = c["direct"]
    print(f"  direct         : {'':15}runtime {d['runtime_s_per_10k']:>5}  client {d['client_s_per_10k']:>5}")
    for via in RELAYS:
        print(f"  through {via:7}: {via:>7} {c[via]['relay_s_per_10k']:>5}  runtime {c[via]['runtime_s_per_10k']:>5}"
              f"  client {c[via]['client_s_per_10k']:>5}  ({c[via]['ratio']}x the runtime's)")
    print("\nRSS at the end, MiB: " + ", ".join(f"{p} {v}" for p, v in result["rss_mib"].items())
          + " (socat: the listener and its live forks; nghttpx: main and worker)")
    s = result["soak"]
    print(f"shim RSS over {s['calls']} calls: {s['rss_mib_before']} -> {s['rss_mib_after']} MiB "
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
        targets, pids = {"direct": upstream, "shim": shim}, {"shim": shim_proc.pid, "runtime": runtime_pid}
        for name, start in (("socat", start_socat), ("nghttpx", start_nghttpx), ("haproxy", start_haproxy)):
            proc, targets[name] = start(upstream, workdir)
            procs.append(proc)
            pids[name] = proc.pid
        asyncio.run(check_paths(targets))
        load_before = [round(x, 2) for x in os.getloadavg()]
        result = asyncio.run(run(targets, pids, args.calls, args.throughput_seconds, args.cpu_calls, image))
        result["rss_mib"] = {p: round(rss_kib(pids[p], p in FORKING) / 1024, 1) for p in RELAYS}
        result["soak"] = asyncio.run(soak(shim, shim_proc.pid, args.soak_calls))
        result["load_average"] = {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}
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
