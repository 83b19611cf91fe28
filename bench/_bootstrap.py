"""``python bench/NAME.py ARGS`` is run as ``python -m bench.NAME ARGS``.

Run as a script, a benchmark has only ``bench/`` on ``sys.path`` and cannot import ``shim``
or ``tests.support`` from this checkout. Each benchmark starts with::

    if __name__ == "__main__" and not __package__:  # python bench/NAME.py
        import _bootstrap
        _bootstrap.run_as_module(__file__)

which replaces the process (same pid, arguments and working directory) with
``python -P -m bench.NAME`` and this checkout's root first on ``PYTHONPATH``, as the test
harness runs every child that imports ``shim`` (``-P``: the working directory is not put on
``sys.path``, so another checkout there cannot shadow this one).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_as_module(file: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-P", "-m", f"bench.{Path(file).stem}", *sys.argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
