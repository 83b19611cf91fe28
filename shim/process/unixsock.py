"""Claiming a unix socket path: replace a stale socket, never take over a live one."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
from pathlib import Path

from ..config import UNIX_PATH_MAX
from ..observability import logs

_log = logs.get("server")


class StartupError(Exception):
    """The shim (or one of its sockets) cannot start; the message says why, for the operator."""


def _peer(sock: socket.socket) -> str:
    """'pid 1234, cri-shim' for the process at the other end of a unix socket, if we can tell."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    except OSError:
        return ""
    if pid <= 0:
        return ""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid {pid}"
    return f"pid {pid}, {comm}"


def claim(path: str) -> None:
    """Make the directory; replace a stale socket; refuse to take over a live one."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StartupError(f"cannot create the directory of {path}: {e.strerror}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise StartupError(f"cannot inspect {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket; remove it or choose another listen path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:  # nobody listening: left behind by a crash
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        logs.log(_log, logging.INFO, "replaced stale socket", path=path)
        return
    except FileNotFoundError:
        return
    except (TimeoutError, OSError) as e:
        # Someone holds it but does not answer (a stuck shim, a full backlog): don't steal it.
        reason = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        raise StartupError(f"{path} is held by a process that does not answer ({reason}); "
                           "stop it or remove the socket, or choose another listen path") from None
    else:
        who = _peer(probe)
        raise StartupError(f"another process{f' ({who})' if who else ''} is already serving on {path}; "
                           "stop it first (systemctl stop cri-shim) or choose another listen path")
    finally:
        probe.close()


def staging_path(path: str) -> str:
    """Where to bind first: a hidden name beside ``path`` (same directory, so ``publish`` can
    link it), or ``path`` itself when that name would not fit in a unix socket address.

    Bound there, the socket gets its mode and group before any client can find it; only then
    does ``publish`` give it its real name."""
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, f".{base}.{os.getpid()}")
    if len(tmp.encode()) > UNIX_PATH_MAX:
        return path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a crashed process with the same pid
    return tmp


def publish(tmp: str, path: str) -> None:
    """Give the socket bound at ``tmp`` its name ``path`` (a hard link: never over a socket
    another process created meanwhile), then drop ``tmp``. Raises StartupError."""
    if tmp == path:
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise StartupError(f"{path} appeared while the shim was starting: another process listens there; "
                           "stop it or choose another listen path") from None
    except OSError as e:
        raise StartupError(f"cannot create {path}: {e.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
