"""A declared set of images that do not exist, named by digests that hold "401" or "403".

Used by tests/e2e/test_failure_reasons.py and bench/failure_reasons.py: the shim's image sets
pull each one, the registry answers 404, and ``cri-shim status`` must count every one as
``notFound`` (a classifier that searched the message would count these digests as ``auth``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from typing import Any

from .image_fleet import pinned_set

NEEDLES = ("401", "403")


def digests_holding(n: int, *, seed: int = 33) -> list[str]:
    """``n`` distinct ``sha256:`` digests, each holding "401" or "403" at a random place."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        hexits = f"{rng.getrandbits(256):064x}"
        at = rng.randrange(0, 62)
        out[f"sha256:{hexits[:at]}{rng.choice(NEEDLES)}{hexits[at + 3:]}"] = None
    return list(out)


def write_set(path: str, name: str, host: str, n: int, *, repo: str = "missing/app") -> list[str]:
    """A PinnedImageSet ``name`` of ``n`` missing ``host/repo@<digest>`` images written to ``path``."""
    refs = [f"{host}/{repo}@{d}" for d in digests_holding(n)]
    with open(path, "w") as f:
        f.write(pinned_set(name, refs))
    return refs


def set_status(admin_socket: str, name: str) -> dict[str, Any]:
    """The set's row of ``cri-shim status --json``."""
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket", admin_socket],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"cri-shim status failed: {out.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(out.stdout)["image_sets"]["sets"].get(name, {})
    return row


def wait_all_failed(admin_socket: str, name: str, n: int, timeout: float) -> tuple[dict[str, Any], float]:
    """The set's row once all ``n`` images have failed, and the seconds that took; TimeoutError if not."""
    t0 = time.monotonic()
    row: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout:
        row = set_status(admin_socket, name)
        if row.get("failed") == n:
            return row, time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"{row.get('failed')} of {n} failed after {timeout:g} s: {row}")
