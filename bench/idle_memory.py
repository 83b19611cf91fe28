"""Memory at rest: what each library costs at start, and `cri-shim serve`'s idle RSS per configuration.

    python bench/idle_memory.py [--runs 3] [--settle-seconds 3] [--json]

1. Libraries: for each library the shim may load, the RSS a fresh interpreter gains by
   importing it alone (`python -c 'import X'`, VmRSS after minus before; shared
   dependencies counted in each), and what it adds in the order the shim loads them
   (cumulative, so shared dependencies are counted once, at the first that needs them).
2. The shim: `cri-shim serve` (run as `python -m tests.support.loaded_modules serve ...`: the
   same startup path, plus the list of modules loaded, written at exit) in front of a private
   containerd (tests/support/containerd.py: the `containerd` on PATH, 1.6 on Debian 12) with
   (a) the default config (only listen, upstream and the admin socket moved to a temp dir),
   (b) metrics on (`metrics.address`), (c) tracing on (`OTEL_TRACES_EXPORTER=otlp`, an
   endpoint nobody listens on: nothing is exported at rest), (d) `cluster.kubeconfig` set (an
   API server that refuses connections: the client libraries are loaded, the watch retries).
   One Version call goes through it, then after --settle-seconds VmRSS is read; the median
   over --runs starts is reported, with the optional libraries the process loaded.

Needs: containerd (apt-get install -y containerd). Installs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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

from bench.passthrough import rss_kib  # noqa: E402
from tests.support import cri  # noqa: E402
from tests.support.containerd import Containerd  # noqa: E402
from tests.support.loaded_modules import ENV, loaded, top_level  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402

# (label, modules) in the order `cri-shim serve` loads them; the shim's own modules come after the
# libraries it loads with every config, and before those it loads only when configured.
LIBRARIES = [
    ("asyncio (with ssl, concurrent.futures)", "asyncio"),
    ("uvloop", "uvloop"),
    ("PyYAML", "yaml"),
    ("grpcio (grpc, grpc.aio)", "grpc.aio"),
    ("protobuf + the CRI messages", "shim.proto.runtime.v1.api_pb2"),
    ("hpack", "hpack"),
    ("opentelemetry-api (trace, propagator)", "opentelemetry.trace "
                                              "opentelemetry.trace.propagation.tracecontext"),
    ("prometheus_client", "prometheus_client"),
    ("the shim's own modules (shim.cli, shim.process.server)", "shim.cli shim.process.server"),
    ("opentelemetry-sdk (trace): tracing on", "opentelemetry.sdk.trace.export opentelemetry.sdk.resources"),
    ("the OTLP exporter (gRPC): tracing on", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
    ("the OTLP exporter (HTTP): tracing on, http/protobuf", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
    ("kubernetes_asyncio (client, config, watch): cluster.kubeconfig",
     "kubernetes_asyncio.client kubernetes_asyncio.config kubernetes_asyncio.watch"),
]
# Packages and modules whose presence says which optional component was built (uvloop: server.uvloop).
OPTIONAL = ("uvloop", "prometheus_client", "opentelemetry", "kubernetes_asyncio", "aiohttp")
OPTIONAL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc",
                    "opentelemetry.exporter.otlp.proto.http", "shim.imagesets", "shim.cluster")

_MEASURE = """
import importlib, sys
def rss():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1])
out = [rss()]
for group in sys.argv[1:]:
    before = rss()
    for name in group.split():
        importlib.import_module(name)
    out.append(rss() - before)
print(*out)
"""


def mib(kib: float) -> float:
    return round(kib / 1024, 1)


def import_costs(groups: list[str]) -> list[int]:
    """The RSS of a fresh interpreter, then the KiB each group of modules adds, imported in this order."""
    out = subprocess.run([sys.executable, "-P", "-c", _MEASURE, *groups], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    return [int(x) for x in out.split()]


def libraries(runs: int) -> list[dict]:
    """The interpreter, then each library alone and in order (medians over ``runs`` interpreters)."""
    alone = [[import_costs([mod])[1] for _ in range(runs)] for _, mod in LIBRARIES]
    ordered = [import_costs([mod for _, mod in LIBRARIES]) for _ in range(runs)]
    base = mib(statistics.median(r[0] for r in ordered))
    return [{"library": "the interpreter (python -c pass)", "modules": "", "alone_mib": base, "in_order_mib": base}] + [
        {"library": label, "modules": mod, "alone_mib": mib(statistics.median(alone[i])),
         "in_order_mib": mib(statistics.median(r[i + 1] for r in ordered))}
        for i, (label, mod) in enumerate(LIBRARIES)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def configurations(workdir: Path) -> dict[str, tuple[dict, dict[str, str]]]:
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "idle-memory-bench"}}]}))
    otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    return {
        "default": ({}, {}),
        "metrics on": ({"metrics": {"address": f"127.0.0.1:{free_port()}"}}, {}),
        "tracing on (OTLP gRPC)": ({}, otel),
        "cluster.kubeconfig set": ({"cluster": {"kubeconfig": str(kubeconfig),
                                                "state_file": str(workdir / "cluster-sets.json")}}, {}),
    }


def idle_shim(upstream: str, workdir: Path, config: dict, env: dict[str, str], settle: float) -> dict:
    modules_file = workdir / "modules.txt"
    shim = ShimProcess(workdir, upstream=upstream, config=config, log_level="warning",
                       module="tests.support.loaded_modules", env={ENV: str(modules_file), **env})
    shim.start(timeout=30)
    try:
        assert shim.pid is not None
        r = cri.call(shim.socket, "Version", cri.version_request(), timeout=10)
        if r.code != grpc.StatusCode.OK:
            raise SystemExit(f"Version through the shim: {r.code} {r.details}")
        time.sleep(settle)
        rss = rss_kib(shim.pid)
    finally:
        shim.stop()
    mods = loaded(modules_file)
    tops = top_level(mods)
    return {"rss_kib": rss, "loaded": sorted({m for m in OPTIONAL if m in tops}
                                             | {m for m in OPTIONAL_MODULES if m in mods}),
            "modules": len(mods)}


def shims(runs: int, settle: float, workdir: Path) -> dict[str, dict]:
    containerd = Containerd(workdir / "containerd")
    containerd.start()
    try:
        out: dict[str, dict] = {}
        for name, (config, env) in configurations(workdir).items():
            samples = []
            for i in range(runs):
                d = workdir / f"shim-{len(out)}-{i}"
                samples.append(idle_shim(containerd.endpoint, d, config, env, settle))
            out[name] = {"rss_mib": mib(statistics.median(s["rss_kib"] for s in samples)),
                         "rss_mib_range": [mib(min(s["rss_kib"] for s in samples)),
                                           mib(max(s["rss_kib"] for s in samples))],
                         "loaded": samples[-1]["loaded"], "modules": samples[-1]["modules"]}
        return out
    finally:
        containerd.stop()


def report(result: dict) -> None:
    print(f"load average at start: {result['load_average']}")
    print(f"\n{'library':66}{'alone':>7}{'in order':>10}   (MiB of RSS added at import)")
    for r in result["libraries"]:
        print(f"{r['library']:66}{r['alone_mib']:>7}{r['in_order_mib']:>10}")
    print(f"\n`cri-shim serve` at rest, containerd {result['containerd']} (median of {result['runs']} starts):")
    for name, r in result["shims"].items():
        lo, hi = r["rss_mib_range"]
        print(f"  {name:26} {r['rss_mib']:>6} MiB ({lo}-{hi})  {r['modules']} modules; "
              f"loaded: {', '.join(r['loaded']) or '-'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="starts per configuration, imports per library")
    ap.add_argument("--settle-seconds", type=float, default=3.0, help="wait after the first call before reading RSS")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if shutil.which("containerd") is None:
        raise SystemExit("containerd is not installed (apt-get install -y containerd)")
    version = subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout.split()
    workdir = Path(tempfile.mkdtemp(prefix="cri-shim-idle-"))
    try:
        result = {"load_average": [round(x, 2) for x in os.getloadavg()], "runs": args.runs,
                  "containerd": version[2] if len(version) > 2 else "?",
                  "libraries": libraries(args.runs), "shims": shims(args.runs, args.settle_seconds, workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
