"""A scripted CRI runtime in a process of its own, so tests can SIGKILL it mid-call.

``python -m tests.support.runtime_process SOCKET`` serves, on a unix socket:

* ``PullImage``: waits ``--pull-seconds`` (default: an hour), then answers
  ``PullImageResponse{image_ref: "<image>@pulled"}``;
* ``Status``: waits ``--pull-seconds`` too (a passthrough call that hangs);
* every other unary method: an empty response (``Version`` included).

It writes one line per PullImage it starts to ``SOCKET.log``, so a test can wait
until a pull has reached it. :class:`RuntimeProcess` starts, kills and restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import cri

REPO_ROOT = Path(__file__).resolve().parents[2]
PULL = "/runtime.v1.ImageService/PullImage"
STATUS = "/runtime.v1.RuntimeService/Status"


class RuntimeProcess:
    def __init__(self, socket: str | os.PathLike[str], pull_seconds: float = 3600.0) -> None:
        self.socket = Path(socket)
        self.pull_seconds = pull_seconds
        self.log = Path(str(self.socket) + ".log")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 10.0) -> "RuntimeProcess":
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.runtime_process", str(self.socket),
             "--pull-seconds", str(self.pull_seconds)],
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
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)

    stop = kill


async def _serve(socket: str, pull_seconds: float) -> None:
    from shim.proto.runtime.v1 import api_pb2
    from tests.support.fake_runtime import FakeRuntime

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
    args = p.parse_args()
    asyncio.run(_serve(args.socket, args.pull_seconds))


if __name__ == "__main__":
    main()
