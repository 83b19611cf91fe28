"""A scripted CRI runtime in a process of its own, so tests can SIGKILL it mid-call.

``python -m tests.support.runtime_process SOCKET`` serves, on a unix socket:

* ``PullImage``: waits ``--pull-seconds`` (default: an hour), then answers
  ``PullImageResponse{image_ref: "<image>@pulled"}``;
* ``Status``: waits ``--pull-seconds`` too (a passthrough call that hangs);
* every other unary method: an empty response (``Version`` included).

It writes one line per PullImage it starts to ``SOCKET.log``, so a test can wait
until a pull has reached it. :class:`RuntimeProcess` starts, kills and restarts it.

With ``--soak`` it is the soak's runtime instead (see :func:`soak_runtime`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support import cri, procs

REPO_ROOT = Path(__file__).resolve().parents[2]
PULL = "/runtime.v1.ImageService/PullImage"
STATUS = "/runtime.v1.RuntimeService/Status"


class RuntimeProcess:
    def __init__(self, socket: str | os.PathLike[str], pull_seconds: float = 3600.0, soak: bool = False) -> None:
        self.socket = Path(socket)
        self.pull_seconds = pull_seconds
        self.soak = soak
        self.log = Path(str(self.socket) + ".log")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 10.0) -> "RuntimeProcess":
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.runtime_process", str(self.socket),
             "--pull-seconds", str(self.pull_seconds), *(["--soak"] if self.soak else [])],
            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"scripted runtime exited with {self._proc.returncode}")
            if self.socket.exists() and cri.call(self.socket, "Version", b"", timeout=1).ok:
                return self
            time.sleep(0.02)
        raise TimeoutError(f"scripted runtime not serving on {self.socket}")

    def pulls_started(self) -> int:
        try:
            return len(self.log.read_text().splitlines())
        except FileNotFoundError:
            return 0

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            procs.kill(proc)

    stop = kill


SOAK_IMAGES = 200
SOAK_STATS = "/soak.Stats/Get"
LIST_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
CONTAINER_STATUS = "/runtime.v1.RuntimeService/ContainerStatus"
SLOW = "/runtime.v1.RuntimeService/ExecSync"


def soak_store():  # type: ignore[no-untyped-def]
    """The soak's images: every 4th is tagged under registry.k8s.io/pause (pinned by the soak's config)."""
    from tests.support.fake_images import FakeImageStore, StoredImage, image_id

    return FakeImageStore([StoredImage(image_id(i + 1), [f"registry.k8s.io/pause:{i}" if i % 4 == 0 else
                                                          f"quay.io/team/app{i}:v1"],
                                       [f"quay.io/team/app{i}@sha256:{i:064x}"]) for i in range(SOAK_IMAGES)])


def soak_list_containers() -> bytes:
    from shim.cri import protowire as wire

    return b"".join(wire.len_field(1, wire.string_field(1, f"container-{i:04d}") + wire.string_field(2, "sandbox"))
                    for i in range(20))


def soak_runtime(socket: str):  # type: ignore[no-untyped-def]
    """The soak's scripted runtime: an image store (ImageStatus, ListImages, StreamImages, RemoveImage),
    pulls from :mod:`tests.support.pull_chaos`, a fixed ListContainers, a NOT_FOUND ContainerStatus,
    an ExecSync that takes 1 s, ``runtime.v1.FakeBidi/*`` echo streams (a CRI method from the
    future), and ``/soak.Stats/Get``: the pulls'
    counters as JSON."""
    import json

    import grpc

    from tests.support.fake_runtime import FakeRuntime
    from tests.support.pull_chaos import ScriptedPulls

    pulls = ScriptedPulls(mean_seconds=0.02)

    async def stats(request: bytes, context: object) -> bytes:
        return json.dumps({"calls": pulls.calls, "active": pulls.active, "max_active": pulls.max_active,
                           "cancelled": pulls.cancelled}).encode()

    async def slow(request: bytes, context: object) -> bytes:
        await asyncio.sleep(1)
        return b""

    rt = FakeRuntime(socket, unary={PULL: pulls, SOAK_STATS: stats, LIST_CONTAINERS: soak_list_containers(),
                                    CONTAINER_STATUS: (grpc.StatusCode.NOT_FOUND, "container not found", ()),
                                    SLOW: slow, "/runtime.v1.RuntimeService/Version": b"\x0a\x02v1"})
    soak_store().install(rt)
    rt.received = _NoRecord()  # a soak's worth of requests would be a leak of the test's own making
    return rt


class _NoRecord(list):  # type: ignore[type-arg]
    def append(self, item: object) -> None:
        pass


async def _serve(socket: str, pull_seconds: float, soak: bool) -> None:
    from shim.proto.runtime.v1 import api_pb2
    from tests.support.fake_runtime import FakeRuntime

    if soak:
        if os.path.exists(socket):
            os.unlink(socket)
        await soak_runtime(socket).start()
        await asyncio.Event().wait()

    log = open(socket + ".log", "a", buffering=1)

    async def pull(request: bytes, context: object) -> bytes:
        image = api_pb2.PullImageRequest.FromString(request).image.image
        log.write(image + "\n")
        await asyncio.sleep(pull_seconds)
        return api_pb2.PullImageResponse(image_ref=f"{image}@pulled").SerializeToString()

    async def status(request: bytes, context: object) -> bytes:
        await asyncio.sleep(pull_seconds)
        return b""

    if os.path.exists(socket):
        os.unlink(socket)
    rt = FakeRuntime(socket, unary={PULL: pull, STATUS: status})
    await rt.start()
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("--pull-seconds", type=float, default=3600.0)
    p.add_argument("--soak", action="store_true")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args.socket, args.pull_seconds, args.soak))


if __name__ == "__main__":
    main()
