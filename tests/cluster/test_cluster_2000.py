"""A 2,000-image ImageSet from the API: all present at start (nothing pulled), then +10 appended
by an API write are requested from the registry and pulled (only those), the status reaches
generation 2, and status writes stay within cluster.status_interval_seconds (plus one per set
turning current).

How soon the registry sees them is printed, not asserted: it is a speed figure, and speed
targets are measured in bench/ (``bench/node_scale.py``: +10 to a large set until the first
registry request; docs/performance.md), never asserted in a test that runs on a loaded CI
machine. What this test asserts is what a user notices whatever the load: the new images are
requested and present, nothing else is pulled, and the status says so."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.e2e.test_image_sets import EXTRA, PRESENT, fleet  # noqa: F401  (the 2,000-image containerd)
from tests.support.image_fleet import Presence

from .test_cluster_sets import SHIM, current, delete, image_set, set_row, shim_config, wait_for

INTERVAL = 2  # cluster.status_interval_seconds in this test


def test_2000_image_set_plus_10_pulled_and_reported(control_plane, admin, fleet, proxy, shim_factory, tmp_path,  # noqa: F811
                                               short_tmp) -> None:
    admin.set_node_labels("node-a", {"t6": "yes"})
    admin.apply_custom(*SHIM, "imagesets", image_set("t6-big", fleet.refs, {"t6": "yes"}))
    admin_sock = str(short_tmp / "admin.sock")
    cfg = shim_config(control_plane, tmp_path, "node-a", server={"admin_socket": admin_sock},
                      cluster={"status_interval_seconds": INTERVAL}, pulls={"max_parallel": 5},
                      image_sets={"max_parallel": 4})
    presence = Presence(str(fleet.containerd.socket))
    try:
        shim = shim_factory(cfg, upstream=fleet.containerd.socket, log_level="info")
        started = time.monotonic()
        wait_for(lambda: current(admin, "node-a", "t6-big"), 90, "2,000 present, status current", interval=0.5)
        assert set_row(admin, "node-a", "t6-big")["images"]["present"] == PRESENT
        assert not proxy.stats().manifests_by_image  # nothing pulled

        new = [p.ref for p in fleet.extra]
        t0 = time.monotonic()
        admin.apply_custom(*SHIM, "imagesets", image_set("t6-big", fleet.refs + new, {"t6": "yes"}))
        wanted = {(p.repository, p.tag) for p in fleet.extra}
        wait_for(lambda: wanted & set(proxy.stats().manifests_by_image), 30, "a new image requested", interval=0.005)
        first = time.monotonic() - t0
        seen = wait_for(lambda: wanted <= set(proxy.stats().manifests_by_image), 30, "10 new images requested",
                        interval=0.005)
        all_requested = time.monotonic() - t0
        took = presence.wait_all(new, timeout=60)
        assert seen and took is not None, shim.log_tail()
        print(f"\n+{EXTRA} at {PRESENT}: first at the registry {first:.3f} s after the API write, all requested "
              f"{all_requested:.3f} s, all present {time.monotonic() - t0:.3f} s")
        assert set(proxy.stats().manifests_by_image) <= wanted  # the 2,000 present: none requested
        wait_for(lambda: current(admin, "node-a", "t6-big") and set_row(admin, "node-a", "t6-big")["images"]
                 ["present"] == PRESENT + EXTRA, 30, "status current at generation 2", interval=0.5)

        out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket", admin_sock],
                             capture_output=True, text=True, timeout=30)
        writes = json.loads(out.stdout)["cluster"]["status_object"]["writes"]
        elapsed = time.monotonic() - started
        # at most one per interval, plus one each time the set turns current (generation 1, then 2:
        # written at once, docs/image-sets.md)
        print(f"status writes: {writes} in {elapsed:.1f} s (at most one per {INTERVAL} s, plus 2 turning current)")
        assert 2 <= writes <= elapsed / INTERVAL + 1 + 2
    finally:
        presence.close()
        delete(admin, *SHIM, "imagesets", "t6-big")
