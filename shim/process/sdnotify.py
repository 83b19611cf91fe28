"""systemd service notification (the sd_notify datagram protocol), no library needed.

With ``Type=notify`` systemd sets NOTIFY_SOCKET; we send READY=1 once the socket
accepts calls (so ``Before=kubelet.service`` really means "kubelet starts after the
shim serves"), RELOADING=1/READY=1 around a reload and STOPPING=1 on shutdown.
Outside systemd NOTIFY_SOCKET is unset and every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time


def notify(*states: str) -> bool:
    """Send ``KEY=VALUE`` lines to systemd. Returns False when not under systemd or on error."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not states:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall("\n".join(states).encode())
        return True
    except OSError:
        return False


def ready(status: str) -> bool:
    return notify("READY=1", f"STATUS={status}")


def reloading() -> bool:
    # MONOTONIC_USEC lets newer systemd (Type=notify-reload) match the reload to this message.
    return notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


def stopping(status: str) -> bool:
    return notify("STOPPING=1", f"STATUS={status}")
