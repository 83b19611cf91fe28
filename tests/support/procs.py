"""Stopping the processes the tests start (containerd, registry, shims)."""

from __future__ import annotations

import subprocess


def terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL if it is still running after ``timeout``.

    Returns True when the SIGKILL was needed. A process that already exited is left alone.
    """
    if proc.poll() is not None:
        return False
    proc.terminate()
    try:
        proc.wait(timeout)
        return False
    except subprocess.TimeoutExpired:
        kill(proc)
        return True


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL (a crash, for fault tests) and reap it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
