"""The pin ledger (shim/pins/ledger.py): edits by the change, its file, what replaces an entry
and what does not; and, with the image sets and the cluster source, a restart from the cluster's
state file while the API server is down and a newcomer does not fit under max_images."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from shim import config
from shim.cluster.source import ClusterSource
from shim.config import ImageSetsConfig
from shim.imagesets.manager import ImageSets
from shim.observability.metrics import Metrics
from shim.pins.ledger import PinLedger
from shim.pulls.scheduler import PullScheduler
from tests.unit.test_cluster_source import fake_informer, node


def test_an_edit_moves_the_index_by_the_names_it_changes() -> None:
    """Two pinning sets share a name: the pins are exactly their names, each protected by a set
    that pins it; an edit changes only what it changes; a snapshot handed out never moves."""
    ledger = PinLedger("")
    big = [f"r/p{i}:1" for i in range(10_000)]
    ledger.put("a", "file", "/s/a.yaml", "", "1", big)
    ledger.put("b", "file", "/s/b.yaml", "", "1", ["r/p7:1", "r/b:1"])
    first = ledger.snapshot()
    assert len(first) == 10_001 and first["r/p7:1"] == "a"
    before = ledger.snapshot().version
    edited = big[10:] + ["r/new0:1", "r/new1:1"]  # 10 dropped (r/p7:1 among them), 2 added
    assert ledger.put("a", "file", "/s/a.yaml", "", "2", edited)
    latest = ledger.snapshot()
    assert latest.version - before == 12  # 10 removed (one moving to b) + 2 added
    assert len(latest) == 10_000 - 10 + 1 + 2 + 1 and latest["r/p7:1"] == "b" and "r/p0:1" not in latest
    assert first["r/p7:1"] == "a" and "r/new1:1" not in first  # handed out earlier: unchanged
    assert not ledger.put("a", "file", "/s/a.yaml", "", "2", edited)  # the same version: no change
    assert ledger.put("a", "file", "/s/a.yaml", "", "3", edited, pin=False)  # a newer version that does not pin
    assert set(ledger.snapshot()) == {"r/p7:1", "r/b:1"}


def test_a_name_twice_in_a_version_is_one_pin_and_goes_with_it() -> None:
    ledger = PinLedger("")
    ledger.put("s", "file", "/s/s.yaml", "", "1", ["r/p:1", "r/p:1"])  # two runtime handlers
    ledger.put("a", "file", "/s/a.yaml", "", "1", ["r/p:1"])
    ledger.put("s", "file", "/s/s.yaml", "", "2", ["r/q:1"])
    assert ledger.drop("a", "file", "file removed")
    assert dict(ledger.snapshot()) == {"r/q:1": "s"}


def test_only_a_newer_version_of_the_same_object_or_its_own_source_changes_an_entry() -> None:
    ledger = PinLedger("")
    ledger.put("web", "cluster", "cluster:ImageSet/web", "u1", "5", ["r/v5:1"])
    assert not ledger.put("web", "cluster", "cluster:ImageSet/web", "u1", "4", ["r/v4:1"])  # a stale state file's
    assert not ledger.drop("web", "file", "file removed")  # another source cannot confirm it gone
    assert ledger.put("web", "cluster", "cluster:ImageSet/web", "u2", "1", ["r/new:1"])  # re-created: a new set
    assert dict(ledger.snapshot()) == {"r/new:1": "web"}
    assert ledger.drop("web", "cluster", "deleted") and len(ledger.snapshot()) == 0


async def test_the_file_round_trip_and_a_failed_save_keeps_every_pin(tmp_path: Path) -> None:
    path = tmp_path / "state" / "pins.json"
    ledger = PinLedger(str(path))
    ledger.load()  # no file yet: nothing, no error
    assert ledger.error == "" and len(ledger) == 0
    ledger.put("a", "file", "/s/a.yaml", "", "1", ["r/a:1", "r/b:1"])
    ledger.put("web", "cluster", "cluster:ImageSet/web", "u1", "3", ["r/w:1"])
    await ledger.flush()
    again = PinLedger(str(path))
    again.load()
    assert dict(again.snapshot()) == dict(ledger.snapshot()) and again.get("web").uid == "u1"  # type: ignore[union-attr]
    assert again.status()["loaded"] == 2

    os.chmod(path.parent, 0o500)  # the directory turns read-only (root ignores modes: a file in the way instead)
    blocker = None
    if os.access(path.parent, os.W_OK):
        os.chmod(path.parent, 0o700)
        path.unlink()
        path.mkdir()  # a directory where the file goes: the rename fails
        blocker = path
    try:
        again.put("b", "file", "/s/b.yaml", "", "1", ["r/c:1"])
        again.schedule_save()
        for _ in range(100):
            if again.error:
                break
            await asyncio.sleep(0.01)
        assert "cannot write" in again.error and again.save_failures >= 1
        assert set(again.snapshot()) == {"r/a:1", "r/b:1", "r/w:1", "r/c:1"}  # every pin still in force
    finally:
        os.chmod(path.parent, 0o700)
        if blocker is not None:
            blocker.rmdir()
    await again.flush()  # the next try succeeds
    assert again.error == "" and {e["name"] for e in json.loads(path.read_text())["entries"]} == {"a", "web", "b"}


@pytest.mark.parametrize("text", ["{not json", '{"version": 9}', '{"version": 1, "entries": [{"name": 3}]}'])
def test_an_unusable_file_is_an_error_and_loads_nothing(tmp_path: Path, text: str) -> None:
    path = tmp_path / "pins.json"
    path.write_text(text)
    ledger = PinLedger(str(path))
    ledger.load()
    assert ledger.error.startswith(str(path)) or "malformed" in ledger.error
    assert len(ledger) == 0 and path.read_text() == text  # not overwritten until a set is pinned


def _obj(name: str, images: list[str], uid: str) -> dict[str, Any]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "ImageSet",
            "metadata": {"name": name, "uid": uid, "generation": 1, "resourceVersion": uid},
            "spec": {"pin": True, "images": [{"name": i} for i in images]}}


def _node(tmp_path: Path) -> tuple[PinLedger, ImageSets, ClusterSource]:
    ledger = PinLedger(str(tmp_path / "pins.json"))
    ledger.load()
    metrics = Metrics()
    sets = ImageSets(ImageSetsConfig(docker_config=(), state_file="", max_images=3), None,  # type: ignore[arg-type]
                     PullScheduler(4, 2, observers=[metrics]), metrics, on_pins=lambda p: None, ledger=ledger)
    src = ClusterSource(config.ClusterConfig(kubeconfig="x", node_name="n1", state_file=str(tmp_path / "c.json")),
                        sets, Metrics())
    src.load_state()
    return ledger, sets, src


async def test_a_restart_from_the_cluster_state_file_keeps_the_set_in_force_first(tmp_path: Path) -> None:
    """z (1 image) is in force, a (3 images, sorting first) is refused for max_images 3; after a
    restart with the API server down, from the state file: z keeps its room, a stays refused."""
    ledger, sets, src = _node(tmp_path)
    z, a = _obj("z", ["reg.local/z:1"], "uz"), _obj("a", [f"reg.local/a{i}:1" for i in range(3)], "ua")
    src.informers = {"node": fake_informer([node({})]), "imagesets": fake_informer([z])}
    src.recompute()
    src.informers = {"node": fake_informer([node({})]), "imagesets": fake_informer([z, a])}
    src.recompute()
    assert set(sets.reconciler.sets) == {"z"} and "a" in sets.snapshot().refused
    src.save_state()  # as the apply loop does
    await ledger.flush()

    ledger, sets, src = _node(tmp_path)  # restarted; the API server is down
    assert dict(ledger.snapshot()) == {"reg.local/z:1": "z"}  # before any source is read
    src.informers = {"node": fake_informer(None), "imagesets": fake_informer(None)}
    assert set(sets.reconciler.sets) == {"z"} and "a" in sets.snapshot().refused
    assert dict(ledger.snapshot()) == {"reg.local/z:1": "z"}
