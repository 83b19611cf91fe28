"""Failure reasons: a declared set of 5,000 missing images whose digests hold "401" or "403".

    python bench/failure_reasons.py [--images 5000] [--max-parallel 8] [--json]

Starts docker-registry behind the counting proxy of tests/support and a private containerd
(the system's, 1.6 on Debian 12); ``python -m shim serve`` with ``image_sets.dir`` holding one
PinnedImageSet of ``--images`` references ``HOST/missing/app@sha256:<hex>``, each digest
holding "401" or "403" (tests/support/missing_set.py). The registry answers every one 404.
Reported: the reasons ``cri-shim status`` gives the set's failed images (expected: every one
``notFound``, none ``auth``) and the seconds until all had failed. The issue this answers
(#33): the earlier classifier searched the whole message, so 30 of 5,000 counted as ``auth``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from tests.support.containerd import Containerd  # noqa: E402
from tests.support.missing_set import wait_all_failed, write_set  # noqa: E402
from tests.support.registry import RegistryWithProxy  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402


def run(images: int, max_parallel: int) -> dict[str, object]:
    with contextlib.ExitStack() as cleanup:  # stopped in reverse: shim, containerd, registry, files
        workdir = tempfile.mkdtemp(prefix="bench-reasons-", dir="/tmp")
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        registry = RegistryWithProxy(os.path.join(workdir, "registry")).start()
        cleanup.callback(registry.stop)
        containerd = Containerd(os.path.join(workdir, "ctd"), registries=[registry.host])
        cleanup.callback(containerd.stop)
        containerd.start()
        sets = Path(workdir) / "sets"
        sets.mkdir()
        write_set(str(sets / "missing.yaml"), "missing", registry.host, images)
        shim = ShimProcess(Path(workdir) / "shim", upstream=containerd.socket, log_level="warning",
                           config={"image_sets": {"dir": str(sets), "max_parallel": max_parallel,
                                                  "retry_initial_seconds": 3600, "retry_max_seconds": 3600},
                                   "pulls": {"max_parallel": max_parallel + 1}})
        cleanup.callback(shim.stop)
        shim.start(timeout=30)
        assert shim.admin_socket and registry.proxy is not None
        row, seconds = wait_all_failed(shim.admin_socket, "missing", images, timeout=max(120.0, images / 10))
        return {"images": images, "failed": row["failed"], "failed_reasons": row.get("failed_reasons", {}),
                "seconds_until_all_failed": round(seconds, 1), "max_parallel": max_parallel,
                "registry_manifest_requests": registry.proxy.stats().manifest_requests}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--max-parallel", type=int, default=8)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    out = run(a.images, a.max_parallel)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['images']} missing images by digest (each holding 401 or 403): {out['failed']} failed in "
          f"{out['seconds_until_all_failed']} s; reasons {out['failed_reasons']}")


if __name__ == "__main__":
    main()
