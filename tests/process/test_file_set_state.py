"""image_sets.state_file across a restart of the shim process: a set declared in a file of
image_sets.dir, the file made invalid while the shim was down, the shim started again: the
set's pinned image is refused removal from the first RemoveImage, and `cri-shim status` names
the file's error and says its saved version is in force. Without a state file the pin ledger
(pins.ledger_file) still keeps the pin, though the set is not in force (nothing is prefetched);
without either, the same restart loses the set and the image is removed (what they are for)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import pytest

from shim.proto.runtime.v1 import api_pb2
from tests.support.fake_images import FakeImageStore, StoredImage, image_id
from tests.support.fake_runtime import FakeRuntime
from tests.support.shim import new_shim
from tests.support.wait import wait_for

REMOVE = "/runtime.v1.ImageService/RemoveImage"
PINNED = "registry.local/app:1"
OTHER = "registry.local/other:1"
BROKEN = "apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\nspec: [broken\n"
SET = f"""apiVersion: machineconfiguration.openshift.io/v1
kind: PinnedImageSet
metadata: {{name: release}}
spec:
  pinnedImages:
    - name: {PINNED}
"""


async def remove(ch: grpc.aio.Channel, name: str) -> tuple[grpc.StatusCode, str]:
    req = api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=name)).SerializeToString()
    try:
        await ch.unary_unary(REMOVE)(req, timeout=20)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def cri_shim_status(admin: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "shim", "status", "--admin-socket", str(admin),
                                                *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


@pytest.mark.parametrize("keep_state,keep_ledger", [(True, True), (False, True), (False, False)],
                         ids=["state-file", "ledger-only", "neither"])
async def test_restart_with_the_set_file_made_invalid_keeps_its_pins_from_the_first_call(
        runtime: FakeRuntime, short_tmp: Path, keep_state: bool, keep_ledger: bool) -> None:
    store = FakeImageStore([StoredImage(image_id(1), [PINNED]), StoredImage(image_id(2), [OTHER])])
    store.install(runtime)
    sets, admin = short_tmp / "sets", short_tmp / "admin.sock"
    sets.mkdir()
    declared = sets / "release.yaml"
    declared.write_text(SET)
    state_file = short_tmp / "state" / "file-sets.json"  # its directory made by the shim
    settings = {"image_sets": {"dir": str(sets), "debounce_seconds": 0.05,
                               "state_file": str(state_file) if keep_state else ""},
                "server": {"admin_socket": str(admin)}, **({} if keep_ledger else {"pins": {"ledger_file": ""}})}
    shim = new_shim(runtime.endpoint, short_tmp / "w", settings)
    await shim.astart()
    try:
        await shim.await_log("msg=\"image set progress\" set=release", timeout=20)
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            code, details = await remove(ch, PINNED)
            assert code is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'release'" in details
        if keep_state:
            await wait_for(lambda: state_file.exists())
            assert json.loads(state_file.read_text())["files"] == {str(declared): SET}
        await shim.astop()

        declared.write_text(BROKEN)  # made invalid while the shim is down
        await shim.astart()
        async with grpc.aio.insecure_channel(shim.endpoint) as ch:
            code, details = await remove(ch, PINNED)  # the first call after the start
            if not keep_ledger:  # the gap they close: the set is gone, its image removed
                assert code is grpc.StatusCode.OK and store.resolve(PINNED) is None
                return
            if not keep_state:  # the ledger keeps the pin; the set itself is not in force
                assert code is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'release'" in details
                doc = json.loads(await cri_shim_status(admin, "--json"))["image_sets"]
                assert "release" not in doc["sets"] and doc["pin_ledger"]["pinned_not_in_force"] == ["release"]
                return
            assert code is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'release'" in details
            assert (await remove(ch, image_id(1)))[0] is grpc.StatusCode.FAILED_PRECONDITION  # by ID too
            assert (await remove(ch, OTHER))[0] is grpc.StatusCode.OK  # a removal the shim lets through
        assert store.resolve(PINNED) is not None and store.resolve(OTHER) is None

        doc = json.loads(await cri_shim_status(admin, "--json"))["image_sets"]
        err = doc["file_errors"][str(declared)]
        assert "not valid YAML" in err and f"its last valid version, saved in {state_file}, is in force" in err
        assert doc["loaded_from_state"] == 1 and "state_error" not in doc
        assert doc["sets"]["release"]["pinned"] == 1
        text = await cri_shim_status(admin)
        assert f"file {declared}: " in text and "is in force" in text
        assert "image set file rejected" in shim.log_text() and f"saved in {state_file}" in shim.log_text()
        assert json.loads(state_file.read_text())["files"] == {str(declared): SET}  # kept, not the invalid text
    finally:
        await shim.astop()
