"""What one abusive local client can make the shim hold: RSS of a shim process during
a PING flood (client never reads), a header-block flood (HEADERS + endless
CONTINUATION) and a gzip bomb on an intercepted method; plus whether an honest
client's Version call still works afterwards.

    python bench/relay_abuse.py [--pings 5000000] [--header-mib 128] [--bomb-mib 512] [--json]

The shim runs as a separate process (`python -m shim serve`) in front of a scripted
runtime (tests/support/fake_runtime.py) in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import grpc

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from shim.relay import h2  # noqa: E402
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
    ping = h2.frame(h2.PING, 0, 0, b"12345678")
    batch = ping * 10000
    chunks = [h2.PREFACE + h2.settings_frame({})] + [batch] * (n // 10000)
    async with Peak(pid) as p:
        sent, how = await send_all(writer, chunks, 5.0)
        await asyncio.sleep(1.0)
    writer.transport.abort()
    return {"pings_sent": sent // len(ping), "outcome": how, "rss_mib_start": round(p.start, 1),
            "rss_mib_max": round(p.max, 1)}


async def header_flood(path: str, pid: int, mib: int) -> dict:
    reader, writer = await asyncio.open_unix_connection(path)
    head = h2.PREFACE + h2.settings_frame({}) + h2.frame(h2.HEADERS, 0, 1, b"\x82\x86\x84")
    cont = h2.frame(h2.CONTINUATION, 0, 1, b"\x00" * 16384)
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
            block = h2.frame(h2.HEADERS, 0, 1, b"\x82\x86\x84") + h2.frame(h2.CONTINUATION, 0, 1, b"\0" * 16000) * 3
            writer.write(h2.PREFACE + h2.settings_frame({}) + h2.frame(h2.PING, 0, 0, b"12345678") * 20000)
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
    writer.write(h2.PREFACE + h2.settings_frame({h2.SETTINGS_INITIAL_WINDOW_SIZE: 1 << 30})
                 + h2.window_update(0, 1 << 30) + h2.headers_frames(1, h2.encode_headers(headers), False, 16384))
    conn_window = stream_window = h2.DEFAULT_WINDOW
    sent, buf = 0, b""
    end = time.monotonic() + 30
    status = "no answer"
    try:
        while time.monotonic() < end:
            while sent < len(message) and min(conn_window, stream_window) > 0:
                n = min(16384, conn_window, stream_window, len(message) - sent)
                last = sent + n >= len(message)
                writer.write(h2.frame(h2.DATA, h2.END_STREAM if last else 0, 1, message[sent:sent + n]))
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
                if ftype == h2.SETTINGS and not flags & h2.ACK:
                    writer.write(h2.frame(h2.SETTINGS, h2.ACK, 0))
                    window = h2.settings_payload(payload).get(h2.SETTINGS_INITIAL_WINDOW_SIZE)
                    if window is not None:
                        stream_window += window - h2.DEFAULT_WINDOW
                elif ftype == h2.WINDOW_UPDATE:
                    inc = int.from_bytes(payload[:4], "big")
                    if sid == 0:
                        conn_window += inc
                    else:
                        stream_window += inc
                elif ftype == h2.HEADERS and b"grpc-status" in payload:
                    return payload[payload.index(b"grpc-status"):][:120].decode("latin-1", "replace")
                elif ftype == h2.GOAWAY:
                    status = f"GOAWAY {int.from_bytes(payload[4:8], 'big')} {payload[8:][:80]!r}"
                elif ftype == h2.RST_STREAM:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pings", type=int, default=5_000_000)
    ap.add_argument("--header-mib", type=int, default=128)
    ap.add_argument("--bomb-mib", type=int, default=512)
    ap.add_argument("--connections", type=int, default=250, help="abusive connections (server.max_connections: 256)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
