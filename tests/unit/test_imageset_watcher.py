"""The directory watcher: ConfigMap-style symlink swaps, a directory that appears later,
and the debounce that waits for a burst of writes to end."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from shim.imagesets.loader import SetDirectory
from shim.imagesets.watcher import DirWatcher
from tests.unit.test_imagesets import own


def configmap_write(d: Path, version: str, text: str) -> None:
    """What kubelet does for a ConfigMap volume: new timestamped dir, ..data swapped atomically."""
    real = d / f"..{version}"
    real.mkdir()
    (real / "sets.yaml").write_text(text)
    tmp = d / "..data_tmp"
    os.symlink(real.name, tmp)
    os.replace(tmp, d / "..data")
    if not (d / "sets.yaml").is_symlink():
        os.symlink("..data/sets.yaml", d / "sets.yaml")


async def test_configmap_swap_wakes_the_watcher_and_is_read(tmp_path: Path) -> None:
    configmap_write(tmp_path, "2024_01", own("cm", ["nginx:1"]))
    d = SetDirectory(str(tmp_path))
    assert d.scan().sets["cm"].refs == ("docker.io/library/nginx:1",)
    w = DirWatcher(str(tmp_path), d.stamps, safety_poll_seconds=60)  # only inotify can wake it in time
    try:
        waiter = asyncio.ensure_future(w.wait_settled(0.05))
        await asyncio.sleep(0.05)
        assert w.mode == "inotify" and not waiter.done()
        configmap_write(tmp_path, "2024_02", own("cm", ["nginx:2"]))
        await asyncio.wait_for(waiter, 5)
        assert d.scan().sets["cm"].refs == ("docker.io/library/nginx:2",)
    finally:
        w.close()


async def test_a_directory_created_later_is_picked_up(tmp_path: Path) -> None:
    target = tmp_path / "sets"
    d = SetDirectory(str(target))
    w = DirWatcher(str(target), d.stamps, poll_seconds=0.05, safety_poll_seconds=60)
    try:
        waiter = asyncio.ensure_future(w.wait())
        await asyncio.sleep(0.1)
        assert w.mode == "poll" and not waiter.done()
        target.mkdir()
        (target / "a.yaml").write_text(own("late", ["redis:7"]))
        await asyncio.wait_for(waiter, 5)
        assert set(d.scan().sets) == {"late"}
        waiter = asyncio.ensure_future(w.wait())
        await asyncio.sleep(0.05)
        assert w.mode == "inotify"  # watching now that the directory exists
        (target / "b.yaml").write_text(own("later", ["redis:8"]))
        await asyncio.wait_for(waiter, 5)
        assert set(d.scan().sets) == {"late", "later"}
    finally:
        w.close()


async def test_debounce_waits_for_a_burst_to_end(tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text(own("burst", []))
    d = SetDirectory(str(tmp_path))
    w = DirWatcher(str(tmp_path), d.stamps, safety_poll_seconds=60)
    loop = asyncio.get_running_loop()
    try:
        waiter = asyncio.ensure_future(w.wait_settled(0.5))
        await asyncio.sleep(0.05)
        last = 0.0
        for i in range(5):  # a writer appending in steps, 0.05 s apart
            f.write_text(own("burst", [f"app{j}:1" for j in range(i + 1)]))
            last = loop.time()
            await asyncio.sleep(0.05)
            assert not waiter.done()
        await asyncio.wait_for(waiter, 5)
        assert loop.time() - last >= 0.5  # returned only after a quiet debounce period
        assert len(d.scan().sets["burst"].refs) == 5
    finally:
        w.close()
