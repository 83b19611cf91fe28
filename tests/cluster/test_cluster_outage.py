"""After a 30 s API server outage, a set change reaches the registry soon after the API server
answers again, with the default backoff (1 s doubling to 60 s, so every watch had backed off
far beyond that): the /readyz probe resumes every watch, and custom resources' ``429 storage is
(re)initializing`` after a restart is waited out (Retry-After), not backed off. Three runs.

The change is an image added to a set, written by the admin as soon as the API server accepts
it (the same 429s delay that write too); measured until the registry sees its manifest request.
"""

from __future__ import annotations

import time

from kubernetes_asyncio.client.exceptions import ApiException

from .test_cluster_sets import SHIM, delete, image_set, pinned, shim_config, shim_status, wait_for

OUTAGE = 30.0
RUNS = 3
LIMIT = 3.0  # seconds from the API server answering (accepting the change) to the registry request


def _apply_when_accepted(admin, body) -> float:
    """Write the set as soon as the API server accepts it; the time it was accepted."""
    deadline = time.monotonic() + 120
    while True:
        try:
            admin.apply_custom(*SHIM, "imagesets", body)
            return time.monotonic()
        except ApiException as e:
            if e.status not in (429, 500, 503) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def test_set_change_after_an_outage_reaches_the_registry_within_3_s(control_plane, admin, make_image, proxy,
                                                                    shim_factory, tmp_path, short_tmp) -> None:
    first = make_image()
    later = [make_image() for _ in range(RUNS)]
    admin.set_node_labels("node-a", {"t9": "yes"})
    refs = [first.ref]
    admin.apply_custom(*SHIM, "imagesets", image_set("t9-outage", refs, {"t9": "yes"}))
    admin_sock = str(short_tmp / "admin.sock")
    cfg = shim_config(control_plane, tmp_path, "node-a", server={"admin_socket": admin_sock})
    cfg["cluster"].update({"backoff_initial_seconds": 1, "backoff_max_seconds": 60, "watch_timeout_seconds": 300})
    results = []
    try:
        shim = shim_factory(cfg, log_level="info")
        wait_for(lambda: pinned(shim).get(first.image_id), 60, "the first image pulled and pinned")
        for img in later:
            control_plane.stop_apiserver()
            time.sleep(OUTAGE)
            control_plane.start_apiserver()  # returns once /readyz answers 200
            ready = time.monotonic()
            refs.append(img.ref)
            accepted = _apply_when_accepted(admin, image_set("t9-outage", refs, {"t9": "yes"}))
            seen = wait_for(lambda img=img: (img.repository, img.tag) in proxy.stats().manifests_by_image and
                            time.monotonic(), 120, "the added image's manifest requested", interval=0.02)
            results.append((round(accepted - ready, 2), round(seen - accepted, 2)))
        st = shim_status(admin_sock)
        print(f"\nafter a {OUTAGE:.0f} s outage: (change accepted s after /readyz, registry request s after that): "
              f"{results}; the shim's API readers: {st['api']}; 429s waited out per watch: "
              f"{ {n: w.get('throttled', 0) for n, w in st['watches'].items()} }; errors now: "
              f"{ {n: w['error'] for n, w in st['watches'].items() if w.get('error')} }")
        assert all(after <= LIMIT for _, after in results), results
        wait_for(lambda: all(pinned(shim).get(i.image_id) for i in later), 60, "every added image pinned")
    finally:
        if control_plane.apiserver is None:
            control_plane.start_apiserver()
        delete(admin, *SHIM, "imagesets", "t9-outage")
