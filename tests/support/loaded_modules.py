"""``cri-shim`` as it runs on a node, telling at exit which modules it loaded.

    python -m tests.support.loaded_modules serve --listen ... --upstream ... --config ...

runs ``shim.cli.main`` with the same arguments (the same startup path as ``cri-shim serve``)
and, when the process exits normally (SIGTERM included: the shim returns from ``main``),
writes the names in ``sys.modules`` to the file named by ``$CRI_SHIM_LOADED_MODULES``, one
per line. ``ShimProcess(..., module="tests.support.loaded_modules")`` starts it like the shim.

Nothing here imports a library the shim might leave alone: only ``atexit``, ``os`` and ``sys``.
"""

from __future__ import annotations

import atexit
import os
import sys

ENV = "CRI_SHIM_LOADED_MODULES"


def _dump() -> None:
    with open(os.environ[ENV], "w") as f:
        f.write("".join(f"{name}\n" for name in sorted(sys.modules)))


def loaded(path: str | os.PathLike[str]) -> set[str]:
    """The module names a run wrote to ``path``."""
    with open(path) as f:
        return set(f.read().split())


def top_level(modules: set[str]) -> set[str]:
    """``opentelemetry.sdk.trace`` -> ``opentelemetry``, and so on."""
    return {m.partition(".")[0] for m in modules}


if __name__ == "__main__":
    if not os.environ.get(ENV):
        sys.exit(f"{ENV} must name the file to write")
    atexit.register(_dump)
    from shim.cli import main

    sys.exit(main())
