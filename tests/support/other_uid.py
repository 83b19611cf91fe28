"""Run a function as another local user (a process the shim does not trust), for abuse tests.

The interpreter may live where another uid cannot exec it (/root/.pyenv here), so the
child starts as root, imports ``fn``'s module, then drops to ``uid`` before calling it. A
new interpreter, not a fork: a fork of a process with gRPC channels (the test's own
clients, a FakeRuntime) disturbs their connections. JSON in, JSON out.

    with shared_dir() as d:                # a directory that uid can reach (0711), removed after
        result = run_as(NOBODY, attack, f"{d}/shim.sock", 10.0, timeout=30)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from tests.support.shim import REPO_ROOT, shim_env

NOBODY = 65534  # uid and gid (nogroup) of Debian's nobody


def require_root() -> None:
    """Skip unless this process may run a client as another uid (root, with a ``nobody``)."""
    import pwd

    import pytest

    if os.geteuid() != 0:
        pytest.skip("running a client as another uid needs root")
    try:
        pwd.getpwuid(NOBODY)
    except KeyError:
        pytest.skip(f"no user with uid {NOBODY} (nobody) on this machine")


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A short directory under /tmp that any uid may traverse (not list), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="cs-uid-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


_BOOT = """
import importlib, json, os, sys
uid, target, args = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
module, _, name = target.partition(":")
fn = getattr(importlib.import_module(module), name)  # imported as root: the code under /root is readable
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
print("\\nRESULT " + json.dumps(fn(*args)))
"""


def run_as(uid: int, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """``fn(*args)`` (a module-level function; JSON arguments and result) in a new interpreter
    that drops to ``uid`` (gid the same number, no supplementary groups) before calling it."""
    proc = subprocess.run([sys.executable, "-c", _BOOT, str(uid), f"{fn.__module__}:{fn.__qualname__}",
                           json.dumps(args)], cwd=REPO_ROOT, env=shim_env(), capture_output=True, text=True,
                          timeout=timeout)
    marker = "\nRESULT "
    if proc.returncode != 0 or marker not in proc.stdout:
        raise AssertionError(f"the process running as uid {uid} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.rsplit(marker, 1)[1])
