"""The pin ledger, with the shim as a process: the paths issue 44 found that unpinned, each
ended by a RemoveImage of the pinned image, which must be refused (and one that must not).

- A restart while another set is refused for ``image_sets.max_images``: the set in force
  keeps its pins and its room; the newcomer stays refused.
- A SIGHUP that changes ``image_sets.state_file`` while a set's file is invalid.
- An image listed twice in one set (two runtime handlers) and in another set: an edit of the
  first and the deletion of the second unpin it (nothing stale stays pinned).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import yaml

from tests.process.test_file_set_state import BROKEN, remove
from tests.support.fake_images import FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import new_shim

PINNED = "registry.local/app:1"
OTHER = "registry.local/other:1"


def image_set(name: str, images: list[dict[str, str]], pin: bool = True) -> str:
    return yaml.safe_dump({"apiVersion": "cri-shim.io/v1", "kind": "ImageSet", "metadata": {"name": name},
                           "spec": {"pin": pin, "images": images}})


def settings(sets: Path, **extra: Any) -> dict[str, Any]:
    return {"image_sets": {"dir": str(sets), "debounce_seconds": 0.05, "retry_initial_seconds": 30, **extra}}


async def test_a_restart_keeps_the_set_in_force_and_refuses_the_newcomer(runtime: FakeRuntime,
                                                                         short_tmp: Path) -> None:
    store = FakeImageStore([StoredImage(image_id(1), [PINNED]), StoredImage(image_id(2), [OTHER])])
    store.install(runtime)
    sets = short_tmp / "sets"
    sets.mkdir()
    (sets / "z.yaml").write_text(image_set("z", [{"name": PINNED}]))
    shim = new_shim(runtime.endpoint, short_tmp / "w", settings(sets, max_images=3))
    await shim.astart()
    try:
        await shim.await_log('msg="pin ledger: set pinned" set=z', timeout=20)
        # "a" sorts first and takes all the room there is: refused while z is in force
        (sets / "a.yaml").write_text(image_set("a", [{"name": f"registry.local/a{i}:1"} for i in range(3)]))
        await shim.await_log('msg="image set refused: too many images declared on this node" set=a', timeout=20)
        await shim.astop()

        await shim.astart()
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            code, details = await remove(ch, PINNED)  # the first call after the start
            assert code is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'z'" in details
            mark = await shim.await_log('msg="image set refused: too many images declared on this node" set=a',
                                        timeout=20)
            assert 'msg="image set refused: too many images declared on this node" set=z' not in shim.log_text()
            assert (await remove(ch, image_id(1)))[0] is grpc.StatusCode.FAILED_PRECONDITION  # by ID
            assert (await remove(ch, OTHER))[0] is grpc.StatusCode.OK
        assert store.resolve(PINNED) is not None and store.resolve(OTHER) is None
        ledger = json.loads((short_tmp / "w" / "pins.json").read_text())
        assert [(e["name"], e["refs"]) for e in ledger["entries"]] == [("z", [PINNED])]
        assert mark
    finally:
        await shim.astop()


async def test_a_reload_that_changes_the_state_file_keeps_an_invalid_files_pins(runtime: FakeRuntime,
                                                                                short_tmp: Path) -> None:
    store = FakeImageStore([StoredImage(image_id(1), [PINNED])])
    store.install(runtime)
    sets = short_tmp / "sets"
    sets.mkdir()
    declared = sets / "release.yaml"
    declared.write_text(image_set("release", [{"name": PINNED}]))
    shim = new_shim(runtime.endpoint, short_tmp / "w", settings(sets, state_file=""))
    await shim.astart()
    try:
        await shim.await_log('msg="pin ledger: set pinned" set=release', timeout=20)
        declared.write_text(BROKEN)
        mark = await shim.await_log('msg="image set file rejected', timeout=20)
        shim.write_config(settings(sets, state_file=str(short_tmp / "file-sets.json")))  # "" -> a path
        shim.reload()
        await shim.await_log('msg="config reloaded" reason=SIGHUP', after=mark, timeout=20)
        await shim.await_log('msg="image set file rejected', after=mark + 1, timeout=20)  # the new image sets' scan
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            code, details = await remove(ch, PINNED)
            assert code is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'release'" in details
            assert (await remove(ch, image_id(1)))[0] is grpc.StatusCode.FAILED_PRECONDITION
        assert store.resolve(PINNED) is not None
    finally:
        await shim.astop()


async def test_an_image_pinned_twice_is_unpinned_by_the_edit_and_the_deletion(runtime: FakeRuntime,
                                                                              short_tmp: Path) -> None:
    later = "registry.local/later:1"
    store = FakeImageStore([StoredImage(image_id(1), [PINNED]), StoredImage(image_id(3), [later])])
    store.install(runtime)
    sets = short_tmp / "sets"
    sets.mkdir()
    (sets / "s.yaml").write_text(image_set("s", [{"name": PINNED}, {"name": PINNED, "runtimeHandler": "kata"}]))
    (sets / "a.yaml").write_text(image_set("a", [{"name": PINNED}]))
    shim = new_shim(runtime.endpoint, short_tmp / "w", settings(sets))
    await shim.astart()
    try:
        mark = await shim.await_log('msg="pin ledger: set pinned" set=s', timeout=20)
        await shim.await_log('msg="pin ledger: set pinned" set=a', timeout=20)
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            assert (await remove(ch, PINNED))[0] is grpc.StatusCode.FAILED_PRECONDITION
            (sets / "s.yaml").write_text(image_set("s", [{"name": later}]))
            mark = await shim.await_log('msg="pin ledger: set pinned" set=s', after=mark + 1, timeout=20)
            (sets / "a.yaml").unlink()
            await shim.await_log('msg="pin ledger: set unpinned" set=a', after=mark, timeout=20)
            code, details = await remove(ch, PINNED)
            assert code is grpc.StatusCode.OK, details  # no set declares it any more
            assert (await remove(ch, later))[0] is grpc.StatusCode.FAILED_PRECONDITION
        assert store.resolve(PINNED) is None and store.resolve(later) is not None
    finally:
        await shim.astop()
