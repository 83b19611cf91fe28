"""What pull progress costs the runtime: content-API calls per second for N concurrent pulls.

    python bench/pull_progress.py [--pulls 1,8,32] [--image-mib 4] [--link-mibps 8] [--interval 1]

For each N: a fresh containerd behind the shim (pulls.max_parallel: 0, so all N pulls
run at once), N distinct images of ``--image-mib`` MiB (two layers each) pushed to a
local registry whose blob downloads share a ``--link-mibps`` link. All N PullImage
calls go at once; the shim's ``cri_shim_pull_progress_calls_total{method}`` is read
afterwards. Reported: calls per second in total and per method, and the polls (one
ListStatuses each) per second. Reads are one per image (its manifest, once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from tests.support import cri, oci  # noqa: E402
from tests.support.containerd import Containerd  # noqa: E402
from tests.support.registry import RegistryWithProxy, free_port  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402

MiB = 1 << 20
METHODS = ("ListStatuses", "List", "Read", "Abort")


def calls_by_method(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:  # closed now, not at the next GC
        text = response.read().decode()
    out = dict.fromkeys(METHODS, 0.0)
    for line in text.splitlines():
        for m in METHODS:
            if line.startswith(f'cri_shim_pull_progress_calls_total{{method="{m}"}} '):
                out[m] = float(line.split()[-1])
    return out


def run(n: int, reg: RegistryWithProxy, workdir: Path, image_bytes: int, link_bps: int, interval: float) -> dict:
    layer = image_bytes // 2
    pushed = [reg.push(oci.make_image([oci.make_layer({f"{j}.bin": os.urandom(layer)}) for j in range(2)]),
                       f"bench/progress-{n}-{i}", "v1") for i in range(n)]
    ctd = Containerd(workdir / f"ctd-{n}", registries=[reg.host], log_level="warn", max_concurrent_downloads=3)
    port = free_port()
    shim = None
    try:
        ctd.start()
        shim = ShimProcess(workdir / f"shim-{n}", upstream=ctd.socket, log_level="info",
                           config={"pulls": {"max_parallel": 0, "progress_interval_seconds": interval},
                                   "metrics": {"address": f"127.0.0.1:{port}"}}).start()
        assert reg.proxy is not None
        reg.proxy.set_link_throttle(link_bps)

        async def storm() -> list[cri.CallResult]:
            return list(await asyncio.gather(*(cri.acall(str(shim.socket), "PullImage",
                                                         cri.pull_image_request(p.ref), timeout=600)
                                               for p in pushed)))

        t0 = time.monotonic()
        results = asyncio.run(storm())
        seconds = time.monotonic() - t0
        calls = calls_by_method(port)
        return {"pulls": n, "seconds": round(seconds, 2), "ok": sum(r.ok for r in results),
                "calls": {m: int(v) for m, v in calls.items()},
                "calls_per_second": round(sum(calls.values()) / seconds, 2),
                "polls_per_second": round(calls["ListStatuses"] / seconds, 2),
                "calls_per_second_without_reads": round((sum(calls.values()) - calls["Read"]) / seconds, 2)}
    finally:
        if reg.proxy is not None:
            reg.proxy.set_link_throttle(None)
        if shim is not None:
            shim.stop()
        ctd.stop()
        shutil.rmtree(ctd.workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pulls", default="1,8,32", help="comma-separated numbers of concurrent pulls")
    ap.add_argument("--image-mib", type=float, default=4.0)
    ap.add_argument("--link-mibps", type=float, default=8.0)
    ap.add_argument("--interval", type=float, default=1.0, help="pulls.progress_interval_seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-progress-", dir="/tmp"))
    reg = RegistryWithProxy(workdir / "registry")
    rows = []
    try:
        reg.start()
        for n in (int(x) for x in args.pulls.split(",")):
            rows.append(run(n, reg, workdir, int(args.image_mib * MiB), int(args.link_mibps * MiB), args.interval))
            if not args.json:
                r = rows[-1]
                print(f"{r['pulls']:>3} pulls ({r['ok']} ok) in {r['seconds']:6.2f} s: {r['calls_per_second']:5.2f} "
                      f"content-API calls/s ({r['polls_per_second']:.2f} polls/s, "
                      f"{r['calls_per_second_without_reads']:.2f}/s without the one Read per manifest); "
                      f"{r['calls']}", flush=True)
    finally:
        reg.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
