"""A node's NodeImageSetStatus as an operator meets it, against the real API server and a real shim
(issue 45): deleted by hand while the shim is at rest, it is back within
``cluster.status_interval_seconds`` + 5 s; a first write that already holds a failure has its
Event (the first server-side apply answers 201, whose body gives the object's uid)."""

from __future__ import annotations

import time
from typing import Any

from tests.cluster.test_cluster_invalid import older_crd
from tests.cluster.test_cluster_sets import SHIM, delete, image_set, shim_config, shim_status, wait_for
from tests.support.kube import Admin

INTERVAL = 2.0  # cluster.status_interval_seconds


def _nis(admin: Admin, node: str) -> dict[str, Any] | None:
    return admin.get_custom(*SHIM, "nodeimagesetstatuses", node)


def at_rest(admin_sock: str) -> bool:
    """No status write for two intervals."""
    before = shim_status(admin_sock)["status_object"]["writes"]
    time.sleep(2 * INTERVAL)
    return bool(before) and shim_status(admin_sock)["status_object"]["writes"] == before


def test_a_deleted_status_object_is_back_within_the_interval(control_plane, admin, shim_factory, tmp_path,
                                                             short_tmp) -> None:
    admin_sock = str(short_tmp / "admin.sock")
    cfg = shim_config(control_plane, tmp_path, "node-b", server={"admin_socket": admin_sock})
    cfg["cluster"]["status_interval_seconds"] = INTERVAL
    shim_factory(cfg, log_level="info")
    wait_for(lambda: _nis(admin, "node-b"), 30, "node-b's status written")
    # at rest: no write for a few intervals
    wait_for(lambda: at_rest(admin_sock), 60, "the shim at rest")
    first = _nis(admin, "node-b")
    assert first is not None
    for _ in range(2):  # twice: the object re-created is watched as the first was
        delete(admin, *SHIM, "nodeimagesetstatuses", "node-b")
        gone = time.monotonic()
        back = wait_for(lambda: _nis(admin, "node-b"), INTERVAL + 10, "node-b's status written again", interval=0.1)
        took = time.monotonic() - gone
        print(f"\ndeleted NodeImageSetStatus back after {took:.2f} s (status_interval_seconds {INTERVAL})")
        assert took <= INTERVAL + 5, took
        assert back["metadata"]["uid"] != first["metadata"]["uid"]
        assert back["status"]["summary"] == first["status"]["summary"]
        assert back["status"]["nodeName"] == "node-b"
        first = back
    st = shim_status(admin_sock)["status_object"]
    assert st["restored"] == 2 and "watch_error" not in st, st


def test_the_first_write_already_failing_has_its_event(control_plane, admin, shim_factory, tmp_path,
                                                     short_tmp) -> None:
    """No status object yet (its first write creates it: 201) and a set refused from the start (an
    image name the shim refuses, through an ImageSet CRD older than its rules): the Event comes
    with that first write."""
    admin_sock = str(short_tmp / "admin.sock")
    delete(admin, *SHIM, "nodeimagesetstatuses", "node-a")
    wait_for(lambda: _nis(admin, "node-a") is None, 30, "no status object for node-a")
    admin.set_node_labels("node-a", {"t45": "yes"})
    try:
        with older_crd(admin):
            admin.apply_custom(*SHIM, "imagesets", image_set("t45-first-bad", ["reg.example.com/Team/App:v1"],
                                                             {"t45": "yes"}))
            cfg = shim_config(control_plane, tmp_path, "node-a", server={"admin_socket": admin_sock})
            cfg["cluster"]["status_interval_seconds"] = INTERVAL
            shim_factory(cfg, log_level="info")
            obj = wait_for(lambda: _nis(admin, "node-a"), 30, "node-a's status written")

            def event() -> Any:
                return next((e for e in admin.events() if e.involved_object.name == "node-a"
                             and e.involved_object.kind == "NodeImageSetStatus" and e.reason == "ImageSetInvalid"
                             and "t45-first-bad" in (e.message or "")), None)
            ev = wait_for(event, 15, "the Event of the first write", interval=0.2)
            assert ev.involved_object.uid == obj["metadata"]["uid"]
            rows = {r["name"]: r for r in obj["status"]["sets"]}
            assert rows["t45-first-bad"]["reason"] == "InvalidSet"  # the first write held the failure
            st = shim_status(admin_sock)["status_object"]
            assert st["writes"] == 1 and st["events"] >= 1, st  # one write, and its Event
    finally:
        delete(admin, *SHIM, "imagesets", "t45-first-bad")
        admin.set_node_labels("node-a", {"t45": None})
