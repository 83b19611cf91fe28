"""Shim CPU per intercepted call against a relayed one, in one run.

    python bench/intercept_cpu.py [--rate 100] [--seconds 5] [--rounds 4] [--shim-root /work/main]

A kubelet-like client calls the shim (a separate ``python -m shim serve`` process, as on a
node) at a fixed rate, one method at a time: ``Version`` (relayed: the anchor),
``ImageStatus`` of a pinned image, ``ListImages`` (20 images, 5 pinned), ``PullImage`` of
an image the runtime has, and ``RemoveImage`` of a pinned image (refused, FAILED_PRECONDITION);
and, as the floor of an intercepted call, ``RemoveImage`` of an empty name, which the shim
answers without calling the runtime. With ``--no-pins`` the shim intercepts neither ImageStatus
nor ListImages (shim/process/app.py): their cost as relayed calls, the least an answer patched
on its way through the relay could cost.
The methods take turns in short slices, in a different order each round, so load from
elsewhere on the machine hits them alike. For each slice the shim's CPU time is read from
``/proc/PID/task/*/schedstat`` (nanoseconds, every thread: the event loop and gRPC's own);
the report is microseconds of shim CPU per call and the ratio to ``Version``'s. The bench's own
CPU per call (a grpc.aio client, as the shim's upstream channel is) is printed beside it: what
one unary call through grpc.aio costs a Python process on this machine.

The runtime is scripted (tests/support/fake_runtime.py, in a process of its own) so the
answers are the same for every shim: its CPU is not counted. ``--shim-root`` runs the shim
from another checkout (e.g. main, for a before/after). The load average is printed with the
figures: this machine is shared, and on a busy one they are noise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
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
IMAGES = 20
PINNED_EVERY = 4  # every 4th image is under registry.k8s.io/pause (pinned)
PIN = "registry.k8s.io/pause:*"


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid``, in nanoseconds."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended between the listing and the read
    return total


def store():  # type: ignore[no-untyped-def]
    from tests.support.fake_images import FakeImageStore, StoredImage, image_id

    return FakeImageStore([StoredImage(image_id(i + 1), [f"registry.k8s.io/pause:{i}" if i % PINNED_EVERY == 0 else
                                                          f"quay.io/team/app{i}:v1"],
                                       [f"quay.io/team/app{i}@sha256:{i:064x}"]) for i in range(IMAGES)])


async def serve_runtime(socket: str) -> None:
    from tests.support.fake_runtime import FakeRuntime

    class NoRecord(list):  # type: ignore[type-arg]
        def append(self, item: object) -> None:
            pass

    version = api_pb2.VersionResponse(version="0.1.0", runtime_name="fake", runtime_version="1.7.0",
                                      runtime_api_version="v1").SerializeToString()
    pulled = api_pb2.PullImageResponse(image_ref="sha256:" + "1" * 64).SerializeToString()
    rt = FakeRuntime(socket, unary={RS + "Version": version, IS + "PullImage": pulled})
    store().install(rt)
    rt.received = NoRecord()
    await rt.start()
    await asyncio.Event().wait()


def cases() -> dict[str, tuple[str, bytes, grpc.StatusCode]]:
    status = api_pb2.ImageStatusRequest()
    status.image.image = "registry.k8s.io/pause:0"
    pull = api_pb2.PullImageRequest()
    pull.image.image = "quay.io/team/app1:v1"
    pull.sandbox_config.metadata.name, pull.sandbox_config.metadata.namespace = "pod", "default"
    remove = api_pb2.RemoveImageRequest()
    remove.image.image = "registry.k8s.io/pause:4"
    return {
        "Version (relayed)": (RS + "Version", b"", grpc.StatusCode.OK),
        "ImageStatus": (IS + "ImageStatus", status.SerializeToString(), grpc.StatusCode.OK),
        "ListImages": (IS + "ListImages", b"", grpc.StatusCode.OK),
        "PullImage (present)": (IS + "PullImage", pull.SerializeToString(), grpc.StatusCode.OK),
        "RemoveImage (refused)": (IS + "RemoveImage", remove.SerializeToString(), grpc.StatusCode.FAILED_PRECONDITION),
        # answered by the shim alone (an empty name is never looked up: shim/images/remove_image.py): what
        # serving an intercepted call costs without its call to the runtime
        "Floor: RemoveImage \"\"": (IS + "RemoveImage", b"", grpc.StatusCode.OK),
    }


async def paced(mc: grpc.aio.UnaryUnaryMultiCallable, req: bytes, expect: grpc.StatusCode, rate: float,
                seconds: float) -> int:
    """Calls at ``rate`` per second for ``seconds``, each on its own tick (kubelet's polling, not a burst)."""
    n = max(1, round(rate * seconds))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    pending: set[asyncio.Task[None]] = set()

    async def one() -> None:
        try:
            await mc(req, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            code = e.code()
        if code != expect:
            raise SystemExit(f"{mc}: {code.name}, expected {expect.name}")

    for i in range(n):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t = asyncio.ensure_future(one())
        pending.add(t)
        t.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)
    return n


async def run(target: str, pid: int, rate: float, seconds: float, rounds: int, only: list[str],
              pins: bool = True) -> dict:
    cs = {name: c for name, c in cases().items() if not only or name.split()[0] in only or name.startswith(("Version", "Floor"))}
    if not pins:  # ImageStatus and ListImages are relayed (shim/process/app.py); no RemoveImage is refused
        cs = {name.replace("ImageStatus", "ImageStatus (relayed)").replace("ListImages", "ListImages (relayed)"): c
              for name, c in cs.items() if not name.startswith(("RemoveImage", "Floor"))}
    spent = {name: 0 for name in cs}
    calls = {name: 0 for name in cs}
    client = {name: 0 for name in cs}
    me = os.getpid()
    async with grpc.aio.insecure_channel(target) as ch:
        mcs = {name: ch.unary_unary(method) for name, (method, _, _) in cs.items()}
        for name, (_, req, expect) in cs.items():  # warm up, and check every case answers as expected
            await paced(mcs[name], req, expect, rate, 1.0)
        if pins:  # the answers are marked, whichever way the shim does it (intercepted or patched)
            status = api_pb2.ImageStatusResponse.FromString(
                await ch.unary_unary(IS + "ImageStatus")(cases()["ImageStatus"][1], timeout=10))
            listed = api_pb2.ListImagesResponse.FromString(await ch.unary_unary(IS + "ListImages")(b"", timeout=10))
            if not status.image.pinned or sum(i.pinned for i in listed.images) != IMAGES // PINNED_EVERY:
                raise SystemExit("the shim's answers are not marked pinned")
        rng = random.Random(1)
        for _ in range(rounds):
            order = list(cs)
            rng.shuffle(order)
            for name in order:
                _, req, expect = cs[name]
                before, mine = cpu_ns(pid), cpu_ns(me)
                calls[name] += await paced(mcs[name], req, expect, rate, seconds)
                await asyncio.sleep(0.05)  # the last answers' trailing work
                spent[name] += cpu_ns(pid) - before
                client[name] += cpu_ns(me) - mine
    per = {name: spent[name] / calls[name] / 1e3 for name in cs}
    anchor = per["Version (relayed)"]
    return {name: {"calls": calls[name], "cpu_us_per_call": round(per[name], 1),
                   "x_relayed": round(per[name] / anchor, 2),
                   "client_cpu_us_per_call": round(client[name] / calls[name] / 1e3, 1)} for name in cs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=100.0, help="calls per second (kubelet-like: 100)")
    ap.add_argument("--seconds", type=float, default=5.0, help="one slice of one method")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--shim-root", default=str(ROOT), help="the checkout whose shim is measured")
    ap.add_argument("--runtime", help=argparse.SUPPRESS)  # internal: serve the scripted runtime on this socket
    ap.add_argument("--only", action="append", default=[], metavar="METHOD",
                    help="measure only this intercepted method (and Version), e.g. ImageStatus; repeatable")
    ap.add_argument("--no-pins", action="store_true",
                    help="no pins: ImageStatus and ListImages are relayed (what they cost as relayed calls)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.runtime:
        asyncio.run(serve_runtime(args.runtime))
        return
    workdir = tempfile.mkdtemp(prefix="cri-shim-intercept-")
    procs: list[subprocess.Popen] = []
    try:
        rt_sock, shim_sock = os.path.join(workdir, "runtime.sock"), os.path.join(workdir, "shim.sock")
        procs.append(subprocess.Popen([sys.executable, "-P", "-m", "bench.intercept_cpu", "--runtime", rt_sock],
                                      cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        cfg = os.path.join(workdir, "shim.yaml")
        Path(cfg).write_text(json.dumps({"server": {"admin_socket": ""}, "pins": {"images": [] if args.no_pins else [PIN]}}))
        for _ in range(100):
            if os.path.exists(rt_sock):
                break
            time.sleep(0.1)
        shim = subprocess.Popen([sys.executable, "-P", "-m", "shim", "serve", "--listen", f"unix://{shim_sock}",
                                 "--upstream", f"unix://{rt_sock}", "--config", cfg, "--log-level", "warning"],
                                cwd=args.shim_root, env={**os.environ, "PYTHONPATH": args.shim_root})
        procs.append(shim)
        for _ in range(100):
            if os.path.exists(shim_sock):
                break
            time.sleep(0.1)
        else:
            raise SystemExit("the shim did not start")
        load_before = [round(x, 2) for x in os.getloadavg()]
        result = asyncio.run(run(f"unix://{shim_sock}", shim.pid, args.rate, args.seconds, args.rounds, args.only,
                                 not args.no_pins))
        out = {"shim_root": args.shim_root, "rate": args.rate, "cases": result,
               "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"shim from {out['shim_root']}, {args.rate:g} calls/s; load average (1, 5, 15 min) before "
          f"{out['load_average']['before']}, after {out['load_average']['after']} (shared machine)")
    print(f"{'method':26}{'calls':>7}{'shim CPU us/call':>18}{'x relayed':>11}{'client CPU us/call':>20}")
    for name, r in result.items():
        print(f"{name:26}{r['calls']:>7}{r['cpu_us_per_call']:>18}{r['x_relayed']:>11}{r['client_cpu_us_per_call']:>20}")


if __name__ == "__main__":
    main()
