"""image_sets.state_file end to end, in front of real containerd (1.6): a set declared in a file,
the shim stopped, the file made invalid, the shim started again: the first RemoveImage of the
set's image is refused and the image stays; `cri-shim status` names the file's error and the
saved version in force."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc

from tests.support import cri
from tests.support.image_fleet import pinned_set
from tests.e2e.test_pins import present, pull, remove
from tests.support.wait import wait_for_blocking as wait_for

# (marked e2e by the folder)


def test_a_set_file_made_invalid_while_the_shim_is_down_keeps_its_pins(containerd, make_image, shim_factory,
                                                                       tmp_path: Path) -> None:
    img, other = make_image(), make_image()
    pull(containerd, img)
    pull(containerd, other)
    sets = tmp_path / "sets"
    sets.mkdir()
    declared = sets / "release.yaml"
    declared.write_text(pinned_set("release", [img.ref]))
    shim = shim_factory({"image_sets": {"dir": str(sets), "debounce_seconds": 0.05}})
    state_file = shim.workdir / "file-sets.json"  # the test shims' image_sets.state_file (tests/support/shim.py)
    res = remove(shim, img.ref)
    assert res.code is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'release'" in res.details, res
    assert wait_for(state_file.exists)
    shim.stop()

    declared.write_text("apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\nspec: [oops\n")
    shim.start()
    for name in (img.ref, img.image_id):  # the first calls after the start
        res = remove(shim, name)
        assert res.code is grpc.StatusCode.FAILED_PRECONDITION and "pinned by image set 'release'" in res.details, res
    assert present(containerd, img.ref)
    assert remove(shim, other.ref).ok and not present(containerd, other.ref)  # removals still go through

    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--admin-socket", shim.admin_socket],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)["image_sets"]
    err = doc["file_errors"][str(declared)]
    assert "not valid YAML" in err and f"its last valid version, saved in {state_file}, is in force" in err
    assert doc["sets"]["release"]["pinned"] == 1
    listed = {i.id: i.pinned for i in cri.decode_list_images_response(
        cri.call(shim.socket, "ListImages", cri.list_images_request()).unwrap())}
    assert listed[img.image_id] is True
