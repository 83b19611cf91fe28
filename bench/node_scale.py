"""Image sets at node scale: what 100,000 declared images cost kubelet's calls and the shim.

    python bench/node_scale.py [--sets 10] [--per-set 10000] [--seconds 20] [--add 10] [--json]

Starts docker-registry behind the counting proxy of tests/support and a private
containerd 1.6 (root in /dev/shm). One small image is pushed and pulled; containerd then
holds ``--sets`` x ``--per-set`` names, ``--tags-per-image`` (100) per distinct image: copies
of the pulled image that differ by one config label, so each has its own image ID and
shares the pulled layer (one ``ctr images import``, see ``tag_many``), and "all present"
costs no download. "All missing" declares as many names the registry answers 404 for.

Each run starts ``python -m shim serve`` in front of containerd, with ``image_sets.dir``
holding the sets (``kind: ImageSet``, one file per set), and a kubelet-like client
(one gRPC channel, a thread) calling Version and ImageStatus through the shim every
20 ms. Per phase it reports the relayed p50/p99/max of each, the shim's CPU (share of
one core, from /proc) and RSS, and those of its children (the YAML parser process of
shim/imagesets/parse_process.py, while it runs). A second client calls containerd
directly the same way in every window (``direct``): what the runtime itself answers in
that window, so that a phase's relayed latency can be told from the runtime's own:

* ``no sets`` and ``no sets, again``: the same shim with an empty ``image_sets.dir`` (the
  baseline, first and last in the run: the machine's load moves);
* ``present, at rest``: after the first pass (all images known);
* ``missing, right after the first pass``, then ``missing, at rest``: the window that follows
  the first pass (the runtime still busy with the thousands of pulls that just failed), then
  the next one;
* ``present, editing``: one set's file of ``--per-set`` rewritten every 2 s (the same names,
  two of them swapped: a new text and content hash, so the whole file is re-read and diffed);
* ``..., nobody calling``: after ``no sets``, ``present, at rest`` and ``missing, at rest``, one
  more window with both clients paused: the shim's CPU with the sets and nothing else to do
  (the client's 100 calls a second cost the shim about 5 % of a core on their own);
* ``+N to a 20,000-image set``: two sets' names in one file, ``--add`` images (pushed,
  not in containerd) appended; the time from the closed write until the registry
  proxy sees the first manifest request for one of them.

The machine may be shared: the load average is printed with the figures.

Containerd is what bounds the setup: its CRI merges and sorts an image's reference list for
every tag it learns (100,000 tags of one image: about 60 a second, and over 10 minutes to
recover after a restart). With 100 names per image the import runs at about 300 names a
second (100,000 in about 5.5 minutes here) and ListImages is 3.5 MB; ``--tags-per-image 1``
(100,000 distinct images, about 11 MB of ListImages) imports at about 180 a second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

import grpc  # noqa: E402

from tests.support import cri, image_fleet  # noqa: E402
from tests.support.containerd import Containerd  # noqa: E402
from tests.support.registry import RegistryWithProxy, free_port  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402

VERSION = "/runtime.v1.RuntimeService/Version"
IMAGE_STATUS = "/runtime.v1.ImageService/ImageStatus"
EDIT_EVERY = 2.0


def set_file(name: str, refs: list[str]) -> str:
    items = "".join(f"  - name: {r}\n" for r in refs)
    return f"apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata:\n  name: {name}\nspec:\n  images:\n{items}"


def write(path: Path, text: str) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def tag_many(ctd: Containerd, workdir: Path, source: str, names: list[str], per_image: int) -> int:
    """containerd holds an image under every name in ``names``, ``per_image`` consecutive names
    per distinct image: ``source`` is exported once, then ``len(names) / per_image`` copies of
    it that differ by one config label (so each has its own image ID and manifest, and shares
    ``source``'s layer, already unpacked) go into one OCI archive whose index names each
    copy's manifest once per tag; one ``ctr images import``. Returns the distinct images.

    Why not every name on one image: containerd's CRI merges and sorts an image's whole
    reference list for each tag it learns (O(n) per event, O(n^2 log n) on restart), about
    60 tags a second at 100,000. ``per_image`` 1 is the fully distinct case: two blobs per
    name to import (about 180 names a second here instead of 300), and a ListImages answer
    of about 112 bytes per image instead of 35 per name."""
    ctr = ["ctr", "--address", str(ctd.socket), "--namespace", "k8s.io"]
    tar = workdir / "one.tar"
    subprocess.run([*ctr, "images", "export", str(tar), source], check=True, capture_output=True)
    root = workdir / "oci"
    with tarfile.open(tar) as t:
        t.extractall(root, filter="data")
    blobs = root / "blobs" / "sha256"
    index = json.loads((root / "index.json").read_text())
    desc = dict(index["manifests"][0])
    desc.pop("annotations", None)
    manifest = json.loads((blobs / desc["digest"].split(":", 1)[1]).read_bytes())
    config = json.loads((blobs / manifest["config"]["digest"].split(":", 1)[1]).read_bytes())

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return "sha256:" + digest, len(data)

    copies: list[dict[str, Any]] = []
    for j in range((len(names) + per_image - 1) // per_image):
        config.setdefault("config", {}).setdefault("Labels", {})["io.cri-shim.bench.copy"] = str(j)
        c_digest, c_size = blob(json.dumps(config).encode())
        m_digest, m_size = blob(json.dumps({**manifest, "config": {**manifest["config"], "digest": c_digest,
                                                                   "size": c_size}}).encode())
        copies.append({**desc, "digest": m_digest, "size": m_size})
    index["manifests"] = [{**copies[i // per_image],
                           "annotations": {"io.containerd.image.name": n,
                                           "org.opencontainers.image.ref.name": n.rsplit(":", 1)[1]}}
                          for i, n in enumerate(names)]
    (root / "index.json").write_text(json.dumps(index))
    many = workdir / "many.tar"
    with tarfile.open(many, "w") as t:
        for p in sorted(root.rglob("*")):
            t.add(p, arcname=str(p.relative_to(root)), recursive=False)
    subprocess.run([*ctr, "images", "import", "--no-unpack", str(many)], check=True, capture_output=True,
                   timeout=3600)
    shutil.rmtree(root, ignore_errors=True)
    many.unlink()
    # The CRI plugin learns imported images from events, in order: wait for the last one.
    with grpc.insecure_channel(cri.target(ctd.socket)) as ch:
        status: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(IMAGE_STATUS)
        deadline = time.monotonic() + 1800
        while not all(cri.decode_image_status_response(status(cri.image_status_request(n), timeout=30))
                      for n in (names[0], names[-1])):
            if time.monotonic() > deadline:
                raise RuntimeError("containerd's CRI does not see the imported tags")
            time.sleep(1)
    return len(copies)


class Progress(dict[str, Any]):
    """The results, each also printed to stderr as it is taken (a long run that fails keeps them)."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        print(f"[{time.strftime('%H:%M:%S')}] {key}: {value}", file=sys.stderr, flush=True)


class Kubelet:
    """Version and ImageStatus through the shim every 20 ms; latencies (ms) per window."""

    def __init__(self, socket: Path, image: str) -> None:
        self.channel = grpc.insecure_channel(cri.target(socket))
        self.version: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(VERSION)
        self.status: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(IMAGE_STATUS)
        self.image = cri.image_status_request(image)
        self.samples: dict[str, list[float]] = {"Version": [], "ImageStatus": []}
        self.errors = 0
        self.paused = threading.Event()  # set: no calls (the shim's CPU with nobody calling)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kubelet", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            if self.paused.is_set():
                continue
            for name, call, req in (("Version", self.version, cri.version_request()),
                                    ("ImageStatus", self.status, self.image)):
                t = time.perf_counter()
                try:
                    call(req, timeout=30)
                except grpc.RpcError:
                    with self._lock:
                        self.errors += 1
                    continue
                with self._lock:
                    self.samples[name].append((time.perf_counter() - t) * 1000)

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            out, self.samples = self.samples, {"Version": [], "ImageStatus": []}
        return out

    def take_errors(self) -> int:
        with self._lock:
            n, self.errors = self.errors, 0
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=35)
        self.channel.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu(pid: int) -> tuple[float, dict[int, float]]:
    """CPU seconds of the shim's children (the YAML parser process): those it has reaped
    (cutime + cstime of its stat) and, per pid, those alive now."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    reaped = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    alive: dict[int, float] = {}
    for kid in _children(pid):
        try:
            alive[kid] = _cpu_seconds(kid)
        except OSError:
            pass
    return reaped, alive


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():  # a child is listed under the thread that started it
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


_DIRECT: list[Kubelet] = []  # the client calling containerd directly, while a run lasts


def measure(kubelet: Kubelet, pid: int, seconds: float, during: Any = None) -> dict[str, Any]:
    kubelet.take()
    kubelet.take_errors()
    for k in _DIRECT:
        k.take()
    cpu0, t0, load0 = _cpu_seconds(pid), time.monotonic(), os.getloadavg()[0]
    reaped0, alive0 = _children_cpu(pid)
    end = t0 + seconds
    while time.monotonic() < end:
        if during is not None:
            during()
        time.sleep(min(EDIT_EVERY if during is not None else 0.5, max(0.0, end - time.monotonic())))
    cpu = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    reaped1, alive1 = _children_cpu(pid)
    kids = (reaped1 - reaped0 + sum(c - alive0.get(k, 0.0) for k, c in alive1.items())) / (time.monotonic() - t0)
    kids_rss = 0.0
    for k in alive1:
        try:
            kids_rss += _rss_mib(k)
        except OSError:
            pass
    s = kubelet.take()
    direct = {name: {"p50": _pct(v, 0.5), "p99": _pct(v, 0.99)} for k in _DIRECT for name, v in k.take().items()}
    return {"Version": {"p50": _pct(s["Version"], 0.5), "p99": _pct(s["Version"], 0.99),
                        "max": _pct(s["Version"], 1.0), "n": len(s["Version"])},
            "ImageStatus": {"p50": _pct(s["ImageStatus"], 0.5), "p99": _pct(s["ImageStatus"], 0.99),
                            "max": _pct(s["ImageStatus"], 1.0), "n": len(s["ImageStatus"])},
            "shim_cpu_percent": round(100 * cpu, 1), "shim_rss_mib": _rss_mib(pid),
            "parser_cpu_percent": round(100 * kids, 1), "parser_rss_mib": round(kids_rss, 1),
            "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)], "errors": kubelet.take_errors(),
            "direct": direct}


def idle(kubelet: Kubelet, pid: int, seconds: float) -> dict[str, Any]:
    """The shim's CPU and RSS over a window in which neither client calls."""
    clients = [kubelet, *_DIRECT]
    for k in clients:
        k.paused.set()
    time.sleep(0.1)  # a call under way ends
    try:
        cpu0, t0, load0 = _cpu_seconds(pid), time.monotonic(), os.getloadavg()[0]
        time.sleep(seconds)
        cpu = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        return {"shim_cpu_percent": round(100 * cpu, 2), "shim_rss_mib": _rss_mib(pid),
                "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    finally:
        for k in clients:
            k.paused.clear()


def wait_metric(port: int, shim: ShimProcess, want: float, state: str, sets: list[str], timeout: float) -> float:
    t = time.monotonic()
    while True:
        got = sum(image_fleet.metric(port, "cri_shim_image_set_images", {"set": s, "state": state}) or 0
                  for s in sets)
        if got >= want:
            return round(time.monotonic() - t, 1)
        if time.monotonic() - t > timeout:
            raise TimeoutError(f"{state}: {got} of {want} after {timeout} s\n{shim.log_tail()}")
        time.sleep(0.5)


def run(sets: int, per_set: int, seconds: float, add: int, missing_per_set: int | None = None,
        max_parallel: int = 2, tags_per_image: int = 100, first_pass_timeout: float = 1800,
        pulls: dict[str, Any] | None = None) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-", dir="/tmp"))
    # containerd's root in memory: its metadata commits (one fsync each) would otherwise bound
    # the import at about 120 images a second here
    ctd_dir = Path(tempfile.mkdtemp(prefix="bench-scale-ctd-", dir="/dev/shm"))
    registry = RegistryWithProxy(str(workdir / "registry")).start()
    assert registry.proxy is not None
    registry.proxy.idle_seconds = 2.0  # thousands of failed pulls: see CountingProxy.idle_seconds
    ctd: Containerd | None = None
    out: dict[str, Any] = Progress({"sets": sets, "per_set": per_set, "declared": sets * per_set, "cores": os.cpu_count()})
    try:
        ctd = Containerd(ctd_dir, registries=[registry.host, registry.direct_host])
        ctd.start()
        [base, *extra] = image_fleet.push_fleet(registry, "scale", 1 + add)
        image_fleet.pull_into(str(ctd.socket), [base.ref])
        _DIRECT.append(Kubelet(ctd.socket, base.ref))
        host = registry.host
        present = [[f"{host}/present/s{k}:i{i}" for i in range(per_set)] for k in range(sets)]
        n_missing = per_set if missing_per_set is None else missing_per_set
        missing = [[f"{host}/missing/s{k}:i{i}" for i in range(n_missing)] for k in range(sets)]
        t = time.monotonic()
        out["distinct_images"] = tag_many(ctd, workdir, base.ref, [r for s in present for r in s], tags_per_image)
        out["tagging_seconds"] = round(time.monotonic() - t, 1)
        out["runtime ListImages"] = _list_cost(ctd)

        def shim_with(name: str, files: dict[str, list[str]]) -> tuple[ShimProcess, Path, int]:
            d = workdir / name.replace(",", "").replace(" ", "-") / "sets"  # a space breaks a gRPC target
            d.mkdir(parents=True)
            for n, refs in files.items():
                (d / f"{n}.yaml").write_text(set_file(n, refs))
            port = free_port()
            assert ctd is not None
            shim = ShimProcess(d.parent, upstream=ctd.socket, log_level="info",
                               config={"image_sets": {"dir": str(d), "max_file_bytes": 16 << 20,
                                                      "max_parallel": max_parallel},
                                       "pulls": {"max_parallel": max_parallel + 1, **(pulls or {})},
                                       "metrics": {"address": f"127.0.0.1:{port}"}})
            shim.start(timeout=60)
            return shim, d, port

        def anchor(name: str) -> None:
            """The baseline: the same shim, no sets (taken first and last: the load moves)."""
            shim, _, _ = shim_with(name, {})
            kubelet = Kubelet(shim.socket, base.ref)
            try:
                out[name] = measure(kubelet, shim.pid or 0, seconds)
                if name == "no sets":
                    out["no sets, nobody calling"] = idle(kubelet, shim.pid or 0, seconds)
            finally:
                kubelet.close()
                shim.stop()

        anchor("no sets")

        # all present; then one set edited every 2 s; then +add to a 20,000-image set
        files = {f"s{k}": present[k] for k in range(sets)}
        shim, d, port = shim_with("present", files)
        kubelet = Kubelet(shim.socket, base.ref)
        try:
            out["present, first pass seconds"] = wait_metric(port, shim, sets * per_set, "present", list(files), 600)
            time.sleep(2)
            out["present, at rest"] = measure(kubelet, shim.pid or 0, seconds)
            out["present, at rest, nobody calling"] = idle(kubelet, shim.pid or 0, seconds)
            n = [0]

            def edit() -> None:
                n[0] += 1
                refs = present[0][:-10] + [f"{host}/present/s0:i{i}" for i in range(per_set - 10, per_set)]
                refs[n[0] % 10], refs[-1 - n[0] % 10] = refs[-1 - n[0] % 10], refs[n[0] % 10]  # a new order
                write(d / "s0.yaml", set_file("s0", refs))
            out["present, editing"] = measure(kubelet, shim.pid or 0, seconds, during=edit)
            write(d / "s0.yaml", set_file("s0", present[0]))
            # +add to a 20,000-image set: s0 and s1 in one file
            os.unlink(d / "s1.yaml")
            write(d / "s0.yaml", set_file("s0", present[0] + present[1]))
            wait_metric(port, shim, 2 * per_set, "present", ["s0"], 120)
            time.sleep(2)
            rounds: list[dict[str, Any]] = []
            assert registry.proxy is not None
            for r in range(3):
                # round 1: pushed images (pulled); later rounds: names the registry answers 404 for
                new = [p.ref for p in extra] if r == 0 else [f"{host}/added/r{r}:i{i}" for i in range(add)]
                registry.proxy.reset()
                t0 = time.monotonic()
                write(d / "s0.yaml", set_file("s0", present[0] + present[1] + new + rounds_names(rounds)))
                while not [x for x in registry.proxy.records() if x.kind == "manifest"]:
                    if time.monotonic() - t0 > 60:
                        raise RuntimeError(f"no registry request 60 s after the write\n{shim.log_tail()}")
                    time.sleep(0.005)
                first = min(x.start for x in registry.proxy.records() if x.kind == "manifest")
                rounds.append({"names": new, "first_request_seconds": round(first - t0, 3)})
                time.sleep(1)
            out[f"+{add} to a {2 * per_set}-image set"] = [x["first_request_seconds"] for x in rounds]
        finally:
            kubelet.close()
            shim.stop()

        # all missing
        if not n_missing:
            anchor("no sets, again")
            return out
        out["missing declared"] = sets * n_missing
        files = {f"m{k}": missing[k] for k in range(sets)}
        shim, d, port = shim_with("missing", files)
        kubelet = Kubelet(shim.socket, base.ref)
        try:
            try:
                out["missing, first pass seconds"] = wait_metric(port, shim, sets * n_missing, "failed",
                                                                 list(files), first_pass_timeout)
                out["missing, right after the first pass"] = measure(kubelet, shim.pid or 0, seconds)
                phase = "missing, at rest"
            except TimeoutError as e:
                out["missing, first pass"] = str(e).splitlines()[0]
                phase = "missing, first pass still running"
            out[phase] = measure(kubelet, shim.pid or 0, seconds)
            out[phase + ", nobody calling"] = idle(kubelet, shim.pid or 0, seconds)
            out["missing, registry requests per second at rest"] = _registry_rate(registry, seconds=10)
        finally:
            kubelet.close()
            shim.stop()
        anchor("no sets, again")
        return out
    finally:
        while _DIRECT:
            _DIRECT.pop().close()
        if ctd is not None:
            ctd.stop()
        registry.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(ctd_dir, ignore_errors=True)


def _list_cost(ctd: Containerd) -> dict[str, float]:
    """containerd's own ListImages answer: its size and time (direct, 3 calls, the median)."""
    opts = [("grpc.max_receive_message_length", 256 << 20)]
    with grpc.insecure_channel(cri.target(ctd.socket), options=opts) as ch:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary("/runtime.v1.ImageService/ListImages")
        times, size = [], 0
        for _ in range(3):
            t = time.perf_counter()
            size = len(call(b"", timeout=120))
            times.append(time.perf_counter() - t)
    return {"bytes": size, "seconds": round(sorted(times)[1], 3)}


def rounds_names(rounds: list[dict[str, Any]]) -> list[str]:
    return [n for r in rounds for n in r["names"]]


def _registry_rate(registry: RegistryWithProxy, seconds: float) -> float:
    assert registry.proxy is not None
    registry.proxy.reset()
    time.sleep(seconds)
    return round(len([x for x in registry.proxy.records() if x.kind == "manifest"]) / seconds, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", type=int, default=10)
    p.add_argument("--per-set", type=int, default=10000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--add", type=int, default=10)
    p.add_argument("--missing-per-set", type=int, default=None,
                   help="images per set in the all-missing run (default: --per-set; 0: skip it)")
    p.add_argument("--max-parallel", type=int, default=2, help="image_sets.max_parallel (2: the default)")
    p.add_argument("--tags-per-image", type=int, default=100,
                   help="names per distinct image in containerd for the present run (see tag_many)")
    p.add_argument("--missing-timeout", type=float, default=1800,
                   help="seconds to wait for the all-missing first pass before measuring anyway")
    p.add_argument("--pulls", type=json.loads, default={}, metavar="JSON",
                   help='more pulls.* settings for every shim of the run, e.g. \'{"progress_interval_seconds": 0}\'')
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.sets < 2:
        p.error("--sets: at least 2 (the +add phase merges the first two sets into one file)")
    out = run(a.sets, a.per_set, a.seconds, a.add, a.missing_per_set, a.max_parallel,
              a.tags_per_image, a.missing_timeout, a.pulls)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['sets']} sets x {out['per_set']} = {out['declared']} images declared "
          f"({out['cores']} cores, shared: see the load averages)")
    for k, v in out.items():
        if isinstance(v, dict) and "Version" in v:
            print(f"  {k}: Version p50 {v['Version']['p50']} ms p99 {v['Version']['p99']} ms max "
                  f"{v['Version']['max']} ms; ImageStatus p50 {v['ImageStatus']['p50']} p99 {v['ImageStatus']['p99']}"
                  f" ms; shim CPU {v['shim_cpu_percent']} % of a core, RSS {v['shim_rss_mib']} MiB (its parser "
                  f"process: {v['parser_cpu_percent']} %, {v['parser_rss_mib']} MiB); "
                  f"load {v['load_average']}; direct to containerd: {v['direct']}")
        elif k not in ("sets", "per_set", "declared", "cores"):
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
