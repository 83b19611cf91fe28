"""Pull storm: many pods, few unique images, pulled directly from containerd and through the shim.

    python bench/pull_storm.py [--pods 24] [--images 3] [--image-mib 8] [--link-mibps 6]
                               [--conn-mibps 0] [--max-parallel 2] [--credential-groups 0] [--json]
                               [--status-watch SECONDS]

Starts a local docker-registry behind the counting, throttling proxy of tests/support,
pushes ``--images`` fabricated images of ``--image-mib`` MiB (one incompressible layer),
then runs the same storm twice, each time against a fresh containerd (so both phases
download everything: containerd's content store would otherwise already hold the blobs):

* direct: ``--pods`` concurrent PullImage calls straight to containerd;
* shim:   the same calls to ``python -m shim serve`` in front of containerd, with
  ``pulls.max_parallel: --max-parallel``.

Pod ``i`` pulls image ``i % images``; with ``--credential-groups N`` (N >= 1) the registry
requires basic auth, has N users, and pod ``i`` uses user ``(i // images) % N``.
The registry link is throttled to ``--link-mibps`` MiB/s shared by all blob downloads
(a node's link or a registry's egress); ``--conn-mibps`` adds a per-connection cap.

Reported per phase, from the registry's side: manifest resolves (manifest requests by
tag; containerd resolves a tag with one HEAD per pull), all manifest requests, blob bytes
served, the most images with a registry request in flight at once; from the pods' side:
time until every pull answered and the median time-to-image. ``run_storm()`` is what
``scripts/demo.sh`` uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from tests.support import cri, oci  # noqa: E402
from tests.support.containerd import Containerd  # noqa: E402
from tests.support.proxy import RequestRecord  # noqa: E402
from tests.support.registry import RegistryWithProxy  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402

MiB = 1024 * 1024
PHASES = ("direct", "shim")
_TAG_MANIFEST = re.compile(r"/manifests/[^/:?]+(?:\?.*)?$")


def manifest_resolves(records: list[RequestRecord]) -> int:
    """Answered manifest requests by tag (not by digest): one per resolve of an image reference
    (an auth challenge, 401, is not a resolve: it is counted in manifest_requests only)."""
    return sum(1 for r in records
               if r.kind == "manifest" and 200 <= r.status < 300 and _TAG_MANIFEST.search(r.path))


def _users(groups: int) -> list[tuple[str, str]]:
    return [(f"storm-user-{g}", f"storm-pass-{g}-{os.getpid()}") for g in range(groups)]


async def _storm(endpoint: str, requests: list[bytes], timeout: float) -> tuple[list[cri.CallResult], list[float]]:
    """Fire every request at once; returns results and seconds-until-answer per request."""
    t0 = time.monotonic()

    async def one(req: bytes) -> tuple[cri.CallResult, float]:
        res = await cri.acall(endpoint, "PullImage", req, timeout=timeout)
        return res, time.monotonic() - t0

    done = await asyncio.gather(*(one(r) for r in requests))
    return [r for r, _ in done], [t for _, t in done]


WATCHER_GRACE_SECONDS = 10.0


def _start_watcher(workdir: Path, interval: float) -> subprocess.Popen[bytes]:
    """`cri-shim status --watch` on the shim's admin socket, its stdout and stderr in files
    (``WORKDIR/status-watch.out``, ``.err``): nothing reads them during the storm, so a pipe
    would fill up and stop the watcher."""
    with open(workdir / "status-watch.out", "wb") as out, open(workdir / "status-watch.err", "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "shim", "status", "--watch", "--interval", str(interval),
                                 "--admin-socket", str(workdir / "admin.sock")],
                                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err)


def _stop_watcher(watcher: subprocess.Popen[bytes], workdir: Path, log: Callable[[str], None],
                  grace: float = WATCHER_GRACE_SECONDS) -> str:
    """Stop `cri-shim status --watch` as an operator would (Ctrl-C: SIGINT), then SIGTERM and
    SIGKILL ``grace`` seconds apart; log what it printed and how it ended. Returns its stdout.

    The watcher only shows the storm: however it ends, the demo's outcome is the storm's."""
    sent: list[str] = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if watcher.poll() is not None:
            break
        if sent:
            log(f"  `cri-shim status --watch` did not exit within {grace:.0f} s of {sent[-1]}: sending {sig.name}")
        watcher.send_signal(sig)
        sent.append(sig.name)
        try:
            watcher.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    out = (workdir / "status-watch.out").read_text(errors="replace")
    err = (workdir / "status-watch.err").read_text(errors="replace")
    if watcher.returncode is None:
        how = f"still running {grace:.0f} s after SIGKILL (pid {watcher.pid})"
    else:
        how = f"stopped by {sent[-1]}" if sent else "ended by itself"
        if watcher.returncode not in (0, -signal.SIGINT):
            how += f", exit status {watcher.returncode}"
    log(f"  `cri-shim status --watch` during the storm ({how}):\n"
        + textwrap.indent(out.rstrip() or "(it printed nothing)", "  | "))
    if err.strip():
        log("  its stderr:\n" + textwrap.indent(err.rstrip()[-3000:], "  | "))
    return out


def _phase(name: str, reg: RegistryWithProxy, workdir: Path, requests: list[bytes], expected: list[str],
           *, max_parallel: int, link_bps: int | None, conn_bps: int | None, timeout: float,
           log: Callable[[str], None], status_watch: float = 0.0) -> dict[str, Any]:
    proxy = reg.proxy
    assert proxy is not None
    ctd = Containerd(workdir / f"ctd-{name}", registries=[reg.host], log_level="warn")
    shim: ShimProcess | None = None
    watcher: subprocess.Popen[bytes] | None = None
    watched = ""
    try:
        ctd.start()
        endpoint = str(ctd.socket)
        if name == "shim":
            config: dict[str, Any] = {"pulls": {"max_parallel": max_parallel, "progress_interval_seconds": 0.5}}
            if not status_watch:
                config["server"] = {"admin_socket": ""}
            shim = ShimProcess(workdir / "shim", upstream=ctd.socket, config=config, log_level="info").start()
            endpoint = str(shim.socket)
            if status_watch:  # `cri-shim status --watch` as an operator would run it, during the storm
                watcher = _start_watcher(shim.workdir, status_watch)
        proxy.reset()
        proxy.set_link_throttle(link_bps)
        proxy.set_throttle(conn_bps)
        log(f"  {name}: {len(requests)} concurrent PullImage calls to {'the shim' if shim else 'containerd'}")
        results, seconds = asyncio.run(_storm(endpoint, requests, timeout))
        if watcher is not None:
            watched = _stop_watcher(watcher, shim.workdir, log)
            watcher = None
        stats = proxy.stats()
        records = proxy.records()
        answers = [cri.decode_pull_image_response(r.response) if r.ok and r.response else None for r in results]
        errors = sorted({f"{r.code.name}: {r.details}" for r in results if not r.ok})
        return {
            "manifest_resolves": manifest_resolves(records),
            "manifest_requests": stats.manifest_requests,
            "manifest_heads": stats.manifest_heads,
            "manifest_gets": stats.manifest_gets,
            "blob_requests": stats.blob_requests,
            "blob_bytes": stats.blob_bytes,
            "max_concurrent_images": stats.max_concurrent_images,
            "total_seconds": round(max(seconds), 3),
            "p50_seconds": round(statistics.median(seconds), 3),
            "p90_seconds": round(statistics.quantiles(seconds, n=10)[-1], 3) if len(seconds) > 1 else round(seconds[0], 3),
            "pulls": len(results),
            "correct": sum(1 for a, e in zip(answers, expected) if a == e),
            "errors": errors,
            "seconds_per_pod": [round(t, 3) for t in seconds],
            **({"status_watch": watched} if watched else {}),
        }
    except BaseException:
        if shim is not None:
            log(f"shim log tail:\n{shim.log_tail()}")
        log(f"containerd log tail:\n{ctd.log_tail()}")
        raise
    finally:
        if watcher is not None and shim is not None:
            _stop_watcher(watcher, shim.workdir, log)
        proxy.set_link_throttle(None)
        proxy.set_throttle(None)
        if shim is not None:
            shim.stop()
        ctd.stop()
        shutil.rmtree(ctd.workdir, ignore_errors=True)


def run_storm(pods: int = 24, images: int = 3, image_bytes: int = 8 * MiB, *, link_bps: int | None = 6 * MiB,
              conn_bps: int | None = None, max_parallel: int = 2, credential_groups: int = 0,
              phases: tuple[str, ...] = PHASES, timeout: float = 300.0,
              log: Callable[[str], None] = lambda s: None, status_watch: float = 0.0) -> dict[str, Any]:
    """Run the storm in each of ``phases`` ("direct", "shim"); returns parameters and figures per phase."""
    if pods < 1 or images < 1 or credential_groups < 0 or not set(phases) <= set(PHASES):
        raise ValueError("need pods >= 1, images >= 1, credential_groups >= 0, phases from direct/shim")
    workdir = Path(tempfile.mkdtemp(prefix="pull-storm-", dir="/tmp"))
    users = _users(credential_groups)
    reg = RegistryWithProxy(workdir / "registry", credentials=users[0] if users else None, extra_users=users[1:])
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        reg.registry.storage = Path(tempfile.mkdtemp(prefix="pull-storm-", dir="/dev/shm"))
    storage = reg.registry.storage
    try:
        reg.start()
        log(f"  pushing {images} image(s) of {image_bytes / MiB:.1f} MiB to a local registry")
        run = f"{time.time_ns():x}"
        pushed = reg.push_many([(oci.make_image(filler_bytes=image_bytes, unique=f"{run}-{i}"), f"storm/app{i}", "v1")
                                for i in range(images)])
        requests, expected = [], []
        for i in range(pods):
            img = pushed[i % images]
            creds = {}
            if users:
                user, password = users[(i // images) % len(users)]
                creds = {"username": user, "password": password}
            requests.append(cri.pull_image_request(img.ref, **creds))
            expected.append(img.image_id)
        result: dict[str, Any] = {
            "params": {"pods": pods, "images": images, "image_bytes": image_bytes,
                       "bytes_per_image": pushed[0].image.size,
                       "link_bps": link_bps, "conn_bps": conn_bps, "max_parallel": max_parallel,
                       "credential_groups": credential_groups},
        }
        for name in phases:
            result[name] = _phase(name, reg, workdir, requests, expected, max_parallel=max_parallel,
                                  link_bps=link_bps, conn_bps=conn_bps, timeout=timeout, log=log,
                                  status_watch=status_watch)
        return result
    finally:
        reg.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)


# ---------------------------------------------------------------------------- output

ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("manifest_resolves", "registry manifest resolves", str),
    ("manifest_requests", "registry manifest requests (all)", str),
    ("blob_bytes", "blob bytes served", lambda v: f"{v / MiB:.1f} MiB"),
    ("max_concurrent_images", "max images downloading at once", str),
    ("total_seconds", "time until all done", lambda v: f"{v:.2f} s"),
    ("p50_seconds", "p50 time-to-image", lambda v: f"{v:.2f} s"),
    ("correct", "pulls answered with the image", str),
]


def table(result: dict[str, Any]) -> str:
    phases = [p for p in PHASES if p in result]
    heads = {"direct": "direct", "shim": "through shim"}
    width = max(len(label) for _, label, _ in ROWS)
    lines = [f"{'':<{width}}  " + "  ".join(f"{heads[p]:>13}" for p in phases)]
    for key, label, fmt in ROWS:
        cells = []
        for p in phases:
            v = result[p][key]
            cells.append(f"{v}/{result[p]['pulls']}" if key == "correct" else fmt(v))
        lines.append(f"{label:<{width}}  " + "  ".join(f"{c:>13}" for c in cells))
    return "\n".join(lines)


def explain(result: dict[str, Any]) -> str:
    """One or two sentences on what the figures show (computed from them, not canned)."""
    if "direct" not in result or "shim" not in result:
        return ""
    d, s, p = result["direct"], result["shim"], result["params"]
    groups = max(1, p["credential_groups"])
    out = [f"{p['pods']} pods pulling {p['images']} images cost the registry {d['manifest_resolves']} manifest "
           f"resolves directly but {s['manifest_resolves']} through the shim, which collapses identical pulls "
           f"into one per image{' and credential' if groups > 1 else ''}; with max_parallel {p['max_parallel']} "
           f"at most {s['max_concurrent_images']} images downloaded at once (directly: {d['max_concurrent_images']})."]
    if s["p50_seconds"] < d["p50_seconds"]:
        where = "On a shared link that" if p["link_bps"] else "That"
        out.append(f"{where} lets the first images finish sooner: half the pods had their image after "
                   f"{s['p50_seconds']:.1f} s instead of {d['p50_seconds']:.1f} s, and all were done after "
                   f"{s['total_seconds']:.1f} s (directly {d['total_seconds']:.1f} s).")
    else:
        out.append(f"Half the pods had their image after {s['p50_seconds']:.1f} s through the shim "
                   f"({d['p50_seconds']:.1f} s directly); all were done after {s['total_seconds']:.1f} s "
                   f"({d['total_seconds']:.1f} s directly).")
    if abs(s["blob_bytes"] - d["blob_bytes"]) <= 0.01 * max(1, d["blob_bytes"]):
        out.append("Blob bytes are equal: containerd already shares concurrent downloads of the same blob.")
    return " ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=24, help="concurrent PullImage calls (default 24)")
    ap.add_argument("--images", type=int, default=3, help="unique images (default 3)")
    ap.add_argument("--image-mib", type=float, default=8.0, help="layer size in MiB (default 8)")
    ap.add_argument("--link-mibps", type=float, default=6.0,
                    help="registry link in MiB/s shared by all downloads; 0: unlimited (default 6)")
    ap.add_argument("--conn-mibps", type=float, default=0.0, help="per-connection cap in MiB/s; 0: none")
    ap.add_argument("--max-parallel", type=int, default=2, help="the shim's pulls.max_parallel (default 2)")
    ap.add_argument("--credential-groups", type=int, default=0,
                    help="0: anonymous registry; N: basic auth, pods spread over N users (default 0)")
    ap.add_argument("--phases", default="direct,shim", help="comma-separated: direct, shim")
    ap.add_argument("--explain", action="store_true", help="add sentences on what the figures show")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--status-watch", type=float, default=0.0, metavar="SECONDS",
                    help="run `cri-shim status --watch --interval SECONDS` during the shim's storm and "
                         "print what it showed (pull progress); 0: off (default)")
    args = ap.parse_args(argv)
    quiet = args.json
    result = run_storm(
        args.pods, args.images, int(args.image_mib * MiB),
        link_bps=int(args.link_mibps * MiB) or None, conn_bps=int(args.conn_mibps * MiB) or None,
        max_parallel=args.max_parallel, credential_groups=args.credential_groups,
        phases=tuple(p.strip() for p in args.phases.split(",") if p.strip()),
        log=(lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr, flush=True)),
        status_watch=args.status_watch,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table(result))
        if args.explain and (text := explain(result)):
            print()
            print(textwrap.fill(text, width=100))
    failed = any(result[p]["correct"] != result[p]["pulls"] for p in PHASES if p in result)
    if failed:
        for p in PHASES:
            if p in result and result[p]["errors"]:
                print(f"{p}: errors: {result[p]['errors']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
