"""What one abusive local client can make the shim hold: RSS of a shim process during
a PING flood (client never reads), a header-block flood (HEADERS + endless
CONTINUATION) and a gzip bomb on an intercepted method; plus whether an honest
client's Version call still works afterwards.

    python bench/relay_abuse.py [--pings 5000000] [--header-mib 128] [--bomb-mib 512] [--json]
    python bench/relay_abuse.py --honest [--busy 2] [--rounds 3]

``--honest``: instead, the latency a kubelet-like client sees while each attack of
tests/e2e/test_relay_abuse.py runs (a fresh shim per attack): one kept connection,
Version (relayed) then ImageStatus of a pinned image (intercepted) every 50 ms;
p50, p99 and max per attack, and the calls that failed. The attacker runs in a process
of its own (as the tests' uid-changing attacker does), so it never takes this
process's GIL from the honest client. ``--busy N`` keeps N busy loops running
meanwhile (normal priority; both cores of a 2-core box with 2), stopped at the end.

The shim runs as a separate process (`python -m shim serve`) in front of a scripted
runtime (tests/support/fake_runtime.py) in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from shim.relay import http2  # noqa: E402
from tests.support.fake_runtime import FakeRuntime  # noqa: E402
from tests.support.shim import start_shim  # noqa: E402

VERSION = "/runtime.v1.RuntimeService/Version"
PULL = "/runtime.v1.ImageService/PullImage"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Peak:
    """Samples a process's RSS every 20 ms while running."""

    def __init__(self, pid: int) -> None:
        self.pid, self.max, self._task = pid, 0.0, None

    async def __aenter__(self) -> "Peak":
        self.start = rss_mib(self.pid)

        async def sample() -> None:
            while True:
                self.max = max(self.max, rss_mib(self.pid))
                await asyncio.sleep(0.02)
        self._task = asyncio.get_running_loop().create_task(sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.max = max(self.max, rss_mib(self.pid))
        self._task.cancel()


async def send_all(writer: asyncio.StreamWriter, chunks, seconds: float) -> tuple[int, str]:
    """Write chunks until done, the peer stops reading for ``seconds``, or it closes."""
    sent = 0
    for chunk in chunks:
        writer.write(chunk)
        try:
            await asyncio.wait_for(writer.drain(), seconds)
        except asyncio.TimeoutError:
            return sent, "shim stopped reading"
        except ConnectionError:
            return sent, "closed by shim"
        sent += len(chunk)
    return sent, "all sent"


async def honest_version(endpoint: str) -> str:
    t0 = time.perf_counter()
    try:
        async with grpc.aio.insecure_channel(endpoint) as ch:
            await ch.unary_unary(VERSION)(b"", timeout=10)
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name} ({e.details()})"
    return f"OK in {(time.perf_counter() - t0) * 1e3:.1f} ms"


async def ping_flood(path: str, pid: int, n: int) -> dict:
    reader, writer = await asyncio.open_unix_connection(path)
    ping = http2.frame(http2.PING, 0, 0, b"12345678")
    batch = ping * 10000
    chunks = [http2.PREFACE + http2.settings_frame({})] + [batch] * (n // 10000)
    async with Peak(pid) as p:
        sent, how = await send_all(writer, chunks, 5.0)
        await asyncio.sleep(1.0)
    writer.transport.abort()
    return {"pings_sent": sent // len(ping), "outcome": how, "rss_mib_start": round(p.start, 1),
            "rss_mib_max": round(p.max, 1)}


async def header_flood(path: str, pid: int, mib: int) -> dict:
    reader, writer = await asyncio.open_unix_connection(path)
    head = http2.PREFACE + http2.settings_frame({}) + http2.frame(http2.HEADERS, 0, 1, b"\x82\x86\x84")
    cont = http2.frame(http2.CONTINUATION, 0, 1, b"\x00" * 16384)
    chunks = [head] + [cont * 64] * (mib * 1024 // 1024)
    async with Peak(pid) as p:
        sent, how = await send_all(writer, chunks, 5.0)
        await asyncio.sleep(1.0)
    writer.transport.abort()
    return {"mib_sent": round(sent / 2**20, 1), "outcome": how, "rss_mib_start": round(p.start, 1),
            "rss_mib_max": round(p.max, 1)}


async def many_connections(path: str, pid: int, n: int) -> dict:
    """``n`` connections, each holding the most it can: a header block just under the
    limit left open and PINGs it never reads the answers to."""
    conns = []
    async with Peak(pid) as p:
        for _ in range(n):
            try:
                reader, writer = await asyncio.open_unix_connection(path)
            except OSError:
                break
            block = http2.frame(http2.HEADERS, 0, 1, b"\x82\x86\x84") + http2.frame(http2.CONTINUATION, 0, 1, b"\0" * 16000) * 3
            writer.write(http2.PREFACE + http2.settings_frame({}) + http2.frame(http2.PING, 0, 0, b"12345678") * 20000)
            writer.write(block)  # PINGs first: a block left open makes any later frame an error
            conns.append(writer)
        await asyncio.sleep(2.0)
        honest = await honest_version(path if path.startswith("unix://") else f"unix://{path}")
    for w in conns:
        w.transport.abort()
    return {"connections": len(conns), "honest_version_meanwhile": honest, "rss_mib_start": round(p.start, 1),
            "rss_mib_max": round(p.max, 1)}


async def gzip_bomb(endpoint: str, pid: int, mib: int) -> dict:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip
    block = b"\0" * (1 << 20)
    body = b"".join(z.compress(block) for _ in range(mib)) + z.flush()
    msg = b"\x01" + len(body).to_bytes(4, "big") + body
    async with Peak(pid) as p:
        t0 = time.perf_counter()
        outcome = await raw_unary(endpoint[len("unix://"):], PULL, msg, {b"grpc-encoding": b"gzip"})
    return {"compressed_kib": round(len(body) / 1024), "decompressed_mib": mib,
            "outcome": outcome,
            "seconds": round(time.perf_counter() - t0, 2), "rss_mib_start": round(p.start, 1),
            "rss_mib_max": round(max(p.max, rss_mib(pid)), 1)}


async def raw_unary(path: str, method: str, message: bytes, extra: dict[bytes, bytes]) -> str:
    """One gRPC call over a raw HTTP/2 connection, within the server's flow-control
    windows; returns what ended it (grpc-status and message, RST_STREAM, GOAWAY)."""
    reader, writer = await asyncio.open_unix_connection(path)
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
               (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
               *extra.items()]
    writer.write(http2.PREFACE + http2.settings_frame({http2.SETTINGS_INITIAL_WINDOW_SIZE: 1 << 30})
                 + http2.window_update(0, 1 << 30) + http2.headers_frames(1, http2.encode_headers(headers), False, 16384))
    conn_window = stream_window = http2.DEFAULT_WINDOW
    sent, buf = 0, b""
    end = time.monotonic() + 30
    status = "no answer"
    try:
        while time.monotonic() < end:
            while sent < len(message) and min(conn_window, stream_window) > 0:
                n = min(16384, conn_window, stream_window, len(message) - sent)
                last = sent + n >= len(message)
                writer.write(http2.frame(http2.DATA, http2.END_STREAM if last else 0, 1, message[sent:sent + n]))
                sent += n
                conn_window -= n
                stream_window -= n
            data = await asyncio.wait_for(reader.read(65536), end - time.monotonic())
            if not data:
                return status if status != "no answer" else "connection closed"
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n = int.from_bytes(buf[:3], "big")
                ftype, flags, sid, payload = buf[3], buf[4], int.from_bytes(buf[5:9], "big"), buf[9:9 + n]
                buf = buf[9 + n:]
                if ftype == http2.SETTINGS and not flags & http2.ACK:
                    writer.write(http2.frame(http2.SETTINGS, http2.ACK, 0))
                    window = http2.settings_payload(payload).get(http2.SETTINGS_INITIAL_WINDOW_SIZE)
                    if window is not None:
                        stream_window += window - http2.DEFAULT_WINDOW
                elif ftype == http2.WINDOW_UPDATE:
                    inc = int.from_bytes(payload[:4], "big")
                    if sid == 0:
                        conn_window += inc
                    else:
                        stream_window += inc
                elif ftype == http2.HEADERS and b"grpc-status" in payload:
                    return payload[payload.index(b"grpc-status"):][:120].decode("latin-1", "replace")
                elif ftype == http2.GOAWAY:
                    status = f"GOAWAY {int.from_bytes(payload[4:8], 'big')} {payload[8:][:80]!r}"
                elif ftype == http2.RST_STREAM:
                    return f"RST_STREAM {int.from_bytes(payload[:4], 'big')}"
    except (asyncio.TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
    return status


async def main_async(args: argparse.Namespace) -> dict:
    workdir = tempfile.mkdtemp(prefix="cri-shim-abuse-")
    rt = await FakeRuntime(os.path.join(workdir, "rt.sock")).start()
    rt.unary[VERSION] = b"v"
    rt.unary[PULL] = b"\x0a\x04done"
    shim = await start_shim(rt.endpoint, workdir, {"server": {"admin_socket": ""}})
    out: dict = {}
    try:
        out["idle_rss_mib"] = round(rss_mib(shim.pid), 1)
        out["ping_flood"] = await ping_flood(shim.path, shim.pid, args.pings)
        out["ping_flood"]["honest_version_after"] = await honest_version(shim.endpoint)
        out["header_flood"] = await header_flood(shim.path, shim.pid, args.header_mib)
        out["header_flood"]["honest_version_after"] = await honest_version(shim.endpoint)
        out["many_connections"] = await many_connections(shim.path, shim.pid, args.connections)
        out["many_connections"]["honest_version_after"] = await honest_version(shim.endpoint)
        out["gzip_bomb"] = await gzip_bomb(shim.endpoint, shim.pid, args.bomb_mib)
        out["gzip_bomb"]["honest_version_after"] = await honest_version(shim.endpoint)
        out["rss_mib_end"] = round(rss_mib(shim.pid), 1)
    finally:
        await shim.astop()
        await rt.stop()
    return out


# --------------------------------------------------------------------------- --honest

PINNED = "example.invalid/pinned:1"  # a pin makes ImageStatus intercepted
HONEST_ATTACKS = ("ping_flood", "silent_sockets", "continuation_flood", "huge_header_blocks", "gzip_bomb",
                  "data_beyond_window", "queued_pulls")


def queued_pulls(path: str) -> dict:
    """The memory test's attack: 40 PullImage requests of 15 MiB on one connection, then 40
    just under 4 MiB (pulls.max_parallel 1, a pull that does not finish)."""
    from tests.e2e.test_relay_abuse import queue_big_pulls

    big = queue_big_pulls(path, 40, 15 << 20, 0.0)
    near = queue_big_pulls(path, 40, (4 << 20) - (64 << 10), 3.0)
    return {"15MiB": big, "4MiB": near}


def run_attack(name: str, path: str, timeout: float = 300) -> None:
    """The attack in a new interpreter (this process keeps its GIL for the honest client);
    its errors go to stderr."""
    module = "bench.relay_abuse" if name == "queued_pulls" else "tests.e2e.test_relay_abuse"
    code = f"import sys, {module} as m; m.{name}(sys.argv[1])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code, path], env=env, timeout=timeout, check=True,
                   stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """``n`` processes spinning at normal priority, stopped (and reaped) on the way out."""
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def honest_during(name: str, workdir: str) -> tuple[list[float], list[str]]:
    """The honest client's latencies (seconds) and failures during one run of ``name``."""
    from tests.e2e.test_relay_abuse import Honest  # the tests' kubelet-like client
    from tests.support import cri

    async def slow_pull(request: bytes, context: object) -> bytes:
        await asyncio.sleep(3600)
        return b""

    d = tempfile.mkdtemp(prefix=f"{name}-", dir=workdir)
    rt = await FakeRuntime(os.path.join(d, "rt.sock")).start()
    rt.unary[VERSION] = cri.version_request()
    rt.unary[PULL] = slow_pull
    shim = await start_shim(rt.endpoint, d, {"server": {"admin_socket": ""}, "pins": {"images": [PINNED]},
                                             "pulls": {"max_parallel": 1, "progress_interval_seconds": 0}})
    try:
        honest = Honest(shim.path, interval=0.05, fresh_every=0,
                        also=(("ImageStatus", cri.image_status_request(PINNED)),))
        honest.start()
        try:
            await asyncio.to_thread(run_attack, name, shim.path)
            await asyncio.sleep(0.5)
        finally:
            await honest.stop()
        failures = honest.failures + ([] if shim.proc.poll() is None else [f"the shim exited ({shim.proc.returncode})"])
        return honest.latencies, failures
    finally:
        await shim.astop()
        await rt.stop()


async def honest_main(args: argparse.Namespace) -> dict:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # silent_sockets holds 600 connections
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    workdir = tempfile.mkdtemp(prefix="cri-shim-honest-")
    out: dict = {"busy_loops": args.busy, "rounds": args.rounds, "cpus": os.cpu_count()}
    try:
        with busy_loops(args.busy):
            for name in args.attacks or HONEST_ATTACKS:
                lat: list[float] = []
                failures: list[str] = []
                p99s = []
                for _ in range(args.rounds):
                    one, failed = await honest_during(name, workdir)
                    lat += one
                    failures += failed
                    p99s.append(round(percentile(sorted(one), 0.99) * 1e3, 1) if one else None)
                lat.sort()
                out[name] = {"calls": len(lat), "failed": len(failures), "first_failures": failures[:2],
                             "p50_ms": round(statistics.median(lat) * 1e3, 1) if lat else None,
                             "p99_ms": round(percentile(lat, 0.99) * 1e3, 1) if lat else None,
                             "max_ms": round(lat[-1] * 1e3, 1) if lat else None, "p99_ms_by_round": p99s}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pings", type=int, default=5_000_000)
    ap.add_argument("--header-mib", type=int, default=128)
    ap.add_argument("--bomb-mib", type=int, default=512)
    ap.add_argument("--connections", type=int, default=250, help="abusive connections (server.max_connections: 256)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--honest", action="store_true", help="the honest client's latency during each attack instead")
    ap.add_argument("--busy", type=int, default=0, help="busy loops kept running meanwhile (--honest)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each attack (--honest)")
    ap.add_argument("--attacks", nargs="*", choices=HONEST_ATTACKS, help="only these (--honest)")
    args = ap.parse_args()
    result = asyncio.run(honest_main(args) if args.honest else main_async(args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
