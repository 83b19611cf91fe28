"""Image sets: adding 10 images to a declared set of 2,000 present ones.

    python bench/imageset_reconcile.py [--images 2000] [--add 10] [--rounds 3] [--max-parallel 4] [--json]

Starts docker-registry behind the counting proxy of tests/support and a private
containerd, pushes ``--images`` small images (one shared layer, distinct configs) and
pulls them straight into containerd over CRI (not through the shim). All of them are
declared in one PinnedImageSet; ``python -m shim serve`` starts with ``image_sets.dir``
pointing at it and the time until it reports them all present (no pull) is taken.

Then, ``--rounds`` times, ``--add`` new images (pushed beforehand, pulled through the
counting proxy) are appended to the file, and measured from the moment the write
is closed:

* first pull: until the registry sees the first request for one of the new images;
* all present: until containerd (asked directly, every 10 ms) has every new image.

For comparison, kube-fledged #177: 1,676 images present, 10 added, 2m37s before
the first pull started and about 3 minutes overall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

from tests.support import image_fleet  # noqa: E402
from tests.support.containerd import Containerd  # noqa: E402
from tests.support.registry import RegistryWithProxy, free_port  # noqa: E402
from tests.support.shim import ShimProcess  # noqa: E402

KUBE_FLEDGED = {"images_present": 1676, "added": 10, "first_pull_seconds": 157.0, "overall_seconds": 180.0}


def run(images: int, add: int, rounds: int, max_parallel: int) -> dict[str, object]:
    workdir = tempfile.mkdtemp(prefix="bench-sets-", dir="/tmp")
    registry = RegistryWithProxy(os.path.join(workdir, "registry")).start()
    containerd: Containerd | None = None
    shim: ShimProcess | None = None
    try:
        containerd = Containerd(os.path.join(workdir, "ctd"), registries=[registry.host, registry.direct_host])
        containerd.start()
        t = time.monotonic()
        base = image_fleet.push_fleet(registry, "bench", images + add * rounds)
        extra = [p.ref for p in base[images:]]  # through the counting proxy
        present = [p.with_host(registry.direct_host).ref for p in base[:images]]
        image_fleet.pull_into(str(containerd.socket), present, concurrency=32)
        load_seconds = time.monotonic() - t

        sets = Path(workdir) / "sets"
        sets.mkdir()
        set_file = sets / "release.yaml"
        set_file.write_text(image_fleet.pinned_set("release", present))
        port = free_port()
        shim = ShimProcess(Path(workdir) / "shim", upstream=containerd.socket, log_level="info",
                           config={"image_sets": {"dir": str(sets), "max_parallel": max_parallel},
                                   "pulls": {"max_parallel": max_parallel + 1},  # one slot stays kubelet's
                                   "metrics": {"address": f"127.0.0.1:{port}"}})
        t = time.monotonic()
        shim.start(timeout=30)
        labels = {"set": "release", "state": "present"}
        while (image_fleet.metric(port, "cri_shim_image_set_images", labels) or 0) < images:
            if time.monotonic() - t > 120:
                raise RuntimeError(f"shim never reported {images} present:\n{shim.log_tail()}")
            time.sleep(0.02)
        startup_seconds = time.monotonic() - t
        startup_pulls = image_fleet.metric(port, "cri_shim_pull_requests_total", {"priority": "background"}) or 0

        with image_fleet.Presence(str(containerd.socket)) as presence:
            results = []
            assert registry.proxy is not None
            for r in range(rounds):
                new = extra[r * add:(r + 1) * add]
                registry.proxy.reset()
                with set_file.open("a") as f:
                    f.write("".join(f"    - name: {ref}\n" for ref in new))
                t0 = time.monotonic()
                all_present = presence.wait_all(new, timeout=120)
                if all_present is None:
                    raise RuntimeError(f"round {r}: not all present after 120 s:\n{shim.log_tail()}")
                starts = [rec.start for rec in registry.proxy.records() if rec.kind == "manifest"]
                pulled = {key[0] + ":" + key[1] for key in registry.proxy.stats().manifests_by_image}
                results.append({"first_pull_seconds": round(min(starts) - t0, 3) if starts else None,
                                "all_present_seconds": round(all_present, 3),
                                "images_requested_from_registry": len(pulled)})
        total_pulls = image_fleet.metric(port, "cri_shim_pull_requests_total", {"priority": "background"}) or 0
        return {
            "images_present": images, "added_per_round": add, "rounds": results, "max_parallel": max_parallel,
            "load_seconds": round(load_seconds, 1), "shim_startup_to_all_present_seconds": round(startup_seconds, 3),
            "background_pulls_at_startup": startup_pulls, "background_pulls_total": total_pulls,
            "median_first_pull_seconds": statistics.median(x["first_pull_seconds"] for x in results),
            "median_all_present_seconds": statistics.median(x["all_present_seconds"] for x in results),
            "kube_fledged_177": KUBE_FLEDGED,
        }
    finally:
        if shim is not None:
            shim.stop()
        if containerd is not None:
            containerd.stop()
        registry.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--add", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-parallel", type=int, default=4)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    out = run(a.images, a.add, a.rounds, a.max_parallel)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['images_present']} images present and declared (loaded in {out['load_seconds']} s); "
          f"shim start to all reported present: {out['shim_startup_to_all_present_seconds']} s, "
          f"{out['background_pulls_at_startup']:.0f} pulls")
    for i, r in enumerate(out["rounds"]):  # type: ignore[arg-type]
        print(f"  +{out['added_per_round']} round {i + 1}: first pull after {r['first_pull_seconds']} s, "
              f"all present after {r['all_present_seconds']} s "
              f"({r['images_requested_from_registry']} images requested from the registry)")
    print(f"median: first pull {out['median_first_pull_seconds']} s, all present {out['median_all_present_seconds']} s"
          f" (kube-fledged #177, 1,676 present +10: 157 s before the first pull, ~180 s overall)")


if __name__ == "__main__":
    main()
