"""image_sets.state_file: a file of image_sets.dir that is invalid or unreadable when the shim
starts keeps its last valid version (its sets and pins), as it would have without the restart;
a deleted file is a deletion; the state file is written only when a file's accepted content
changes, and a state file that cannot be read or written is reported, never fatal."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from shim.imagesets import state
from shim.imagesets.loader import SetDirectory
from tests.unit.test_imagesets import image_sets, pinned, reconciled, store, write  # noqa: F401 (fixture)
from tests.support.wait import wait_for

A1 = "registry.local/a:1"
B1 = "registry.local/b:1"
BROKEN = "apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\nspec: [broken\n"


def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


# ---------------------------------------------------------------------- the directory


def test_first_scan_uses_the_saved_version_of_an_invalid_file_only(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text(BROKEN)  # invalid now, valid when saved
    b.write_text(pinned("beta", [B1, "registry.local/b:2"]))  # valid now: the file wins over the saved text
    saved = {str(a): pinned("alpha", [A1]), str(b): pinned("beta", [B1]),
             str(c): pinned("gamma", ["registry.local/c:1"])}  # c was deleted meanwhile
    d = SetDirectory(str(tmp_path))
    d.restore(saved, "/var/lib/cri-shim/file-sets.json")
    r = d.scan()
    assert set(r.sets) == {"alpha", "beta"}  # gamma's file is gone: a deletion
    assert r.sets["alpha"].refs == (A1,) and r.sets["alpha"].pin
    assert r.sets["beta"].refs == (B1, "registry.local/b:2")
    err = r.errors[str(a)]
    assert "not valid YAML" in err and "last valid version, saved in /var/lib/cri-shim/file-sets.json, is in force" in err
    assert r.new_errors == [err] and list(r.errors) == [str(a)]
    assert r.accepted_changed  # b's text and c's deletion differ from what was saved
    assert d.accepted() == {str(a): saved[str(a)], str(b): b.read_text()}

    _touch(a, BROKEN + "\n")  # still invalid: still the saved version, still said
    r = d.scan()
    assert r.sets["alpha"].refs == (A1,) and "is in force" in r.errors[str(a)] and not r.accepted_changed

    # the saved version is only for the start: later, a's own next valid content replaces it
    _touch(a, pinned("alpha", [A1, "registry.local/a:2"]))
    r = d.scan()
    assert r.sets["alpha"].refs == (A1, "registry.local/a:2") and not r.errors and r.accepted_changed


def test_a_file_deleted_and_recreated_invalid_after_start_has_nothing_in_force(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    d = SetDirectory(str(tmp_path))
    d.restore({str(a): pinned("alpha", [A1])}, "state.json")
    r = d.scan()  # a is gone at start
    assert r.sets == {} and r.accepted_changed
    a.write_text(BROKEN)
    r = d.scan()
    assert r.sets == {} and "saved" not in r.errors[str(a)]


def test_a_saved_version_that_is_no_longer_valid_is_said(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text(BROKEN)
    d = SetDirectory(str(tmp_path))
    d.restore({str(a): "kind: Nothing\n"}, "state.json")
    r = d.scan()
    assert r.sets == {} and "its saved version in state.json is not valid either" in r.errors[str(a)]


def test_accepted_content_changes_only_when_the_text_in_force_changes(tmp_path: Path) -> None:
    a = tmp_path / "a.yaml"
    a.write_text(pinned("alpha", [A1]))
    d = SetDirectory(str(tmp_path))
    d.restore({str(a): a.read_text()}, "state.json")
    assert not d.scan().accepted_changed  # the same as saved
    _touch(a, a.read_text())
    assert not d.scan().accepted_changed  # touched: re-read, same text
    _touch(a, BROKEN)
    r = d.scan()
    assert not r.accepted_changed and r.sets["alpha"].refs == (A1,)  # an invalid edit keeps the saved text
    assert "saved" not in r.errors[str(a)]  # this run's own version is in force
    _touch(a, pinned("alpha", [B1]))
    assert d.scan().accepted_changed
    a.unlink()
    assert d.scan().accepted_changed


def test_an_unreadable_directory_keeps_what_is_in_force(tmp_path: Path, monkeypatch) -> None:
    a = tmp_path / "a.yaml"
    a.write_text(pinned("alpha", [A1]))
    real = os.scandir

    def denied(path):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied")

    # at start: the saved versions are in force
    monkeypatch.setattr(os, "scandir", denied)
    d = SetDirectory(str(tmp_path))
    d.restore({str(a): a.read_text()}, "state.json")
    r = d.scan()
    assert r.sets["alpha"].refs == (A1,) and "Permission denied" in r.errors[str(a)] and not r.accepted_changed
    monkeypatch.setattr(os, "scandir", real)
    r = d.scan()
    assert r.sets["alpha"].refs == (A1,) and not r.errors

    # later: what is in force stays
    monkeypatch.setattr(os, "scandir", denied)
    r = d.scan()
    assert r.sets["alpha"].refs == (A1,) and "Permission denied" in d.dir_error


def test_the_state_file_rejects_foreign_content(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    p.write_text('{"version": 1, "files": ["x"]}')
    with pytest.raises(ValueError, match="not a cri-shim image-set file state file"):
        state.load(str(p))
    p.write_text('{"version": 1, "labels": {}}')
    with pytest.raises(ValueError, match="not a map of path to text"):
        state.load(str(p))
    assert state.load(str(tmp_path / "missing.json")) is None


def test_the_state_file_is_the_json_of_every_text_in_force(tmp_path: Path) -> None:
    """Saved one file's text at a time; read back exactly (quotes, newlines, non-ASCII, none at all)."""
    p = tmp_path / "s.json"
    files = {"/sets/a.yaml": 'kind: ImageSet\n  - name: "x"\n', "/sets/\u00e9 \"q\".yaml": "\u00e9\\\t\n" * 3,
             "/sets/big.yaml": "".join(f"  - name: r.io/a:{i}\n" for i in range(20_000))}
    for saved in (files, {}, {"/sets/a.yaml": ""}):
        state.save(str(p), saved)
        assert state.load(str(p)) == saved
        assert json.loads(p.read_text()) == {"version": state.VERSION, "files": saved}


# ---------------------------------------------------------------------- the manager


async def test_restart_with_an_invalid_file_keeps_its_pins_from_the_first_update(runtime, store, tmp_path,
                                                                                 caplog, monkeypatch) -> None:
    sets, path = tmp_path / "sets", tmp_path / "file-sets.json"
    sets.mkdir()
    a = sets / "a.yaml"
    a.write_text(pinned("alpha", [A1]))
    saves: list[dict[str, str]] = []
    real_save = state.save
    monkeypatch.setattr(state, "save", lambda p, files: (real_save(p, files), saves.append(files)))  # written, then counted
    async with image_sets(runtime, sets, state_file=str(path), load_state=True) as h:
        await reconciled(h, "alpha", 1)
        await wait_for(lambda: len(saves) == 1)
        assert json.loads(path.read_text())["files"] == {str(a): a.read_text()}
        write(a, a.read_text())  # touched, same text: no write
        await wait_for(lambda: h.sets.scans >= 2)
        write(a, pinned("alpha", [A1, B1]))
        await reconciled(h, "alpha", 2)
        await wait_for(lambda: len(saves) == 2)
        write(a, BROKEN)  # an invalid edit: the state keeps the last valid text
        await wait_for(lambda: str(a) in h.status()["file_errors"])
    assert len(saves) == 2 and "a:1" in saves[-1][str(a)] and "b:1" in saves[-1][str(a)]

    caplog.set_level(logging.ERROR, logger="cri_shim")
    async with image_sets(runtime, sets, state_file=str(path), load_state=True) as h:
        await wait_for(lambda: bool(h.pin_updates))
        assert sorted(h.pin_updates[0].items()) == [(A1, "alpha"), (B1, "alpha")]  # the first pins include alpha's
        st = h.status()
        assert st["loaded_from_state"] == 1 and "last valid version, saved in " + str(path) in st["file_errors"][str(a)]
        assert "state_error" not in st
        assert h.metrics.registry.get_sample_value("cri_shim_image_sets_state_file_error") == 0
        await reconciled(h, "alpha", 2)
    rejected = [r for r in caplog.records if r.getMessage().startswith("image set file rejected")]
    assert rejected and "is in force" in rejected[-1].fields["error"]  # type: ignore[attr-defined]
    assert len(saves) == 2  # nothing to save: what is in force is what was saved

    a.unlink()  # deleted while the shim was down: a deletion
    async with image_sets(runtime, sets, state_file=str(path), load_state=True) as h:
        await wait_for(lambda: bool(h.pin_updates))
        assert h.pin_updates[0] == {} and "alpha" not in h.status().get("sets", {})
        await wait_for(lambda: len(saves) == 3)
    assert json.loads(path.read_text())["files"] == {}


async def test_a_corrupt_state_file_is_reported_and_replaced(runtime, store, tmp_path, caplog) -> None:
    sets, path = tmp_path / "sets", tmp_path / "file-sets.json"
    sets.mkdir()
    a = sets / "a.yaml"
    a.write_text(pinned("alpha", [A1]))
    path.write_text("{not json")
    caplog.set_level(logging.ERROR, logger="cri_shim")
    async with image_sets(runtime, sets, state_file=str(path), load_state=True) as h:
        assert "not valid JSON" in h.status()["state_error"]
        assert h.metrics.registry.get_sample_value("cri_shim_image_sets_state_file_error") == 1
        await reconciled(h, "alpha", 1)  # the files as they are
        await wait_for(lambda: "state_error" not in h.status())  # saved: the file is ours again
        assert h.metrics.registry.get_sample_value("cri_shim_image_sets_state_file_error") == 0
    assert "image-set state file unusable" in caplog.text
    assert json.loads(path.read_text())["files"] == {str(a): a.read_text()}


async def test_a_state_file_that_cannot_be_written_is_an_error_until_a_save_succeeds(runtime, store, tmp_path,
                                                                                    caplog) -> None:
    sets, blocker = tmp_path / "sets", tmp_path / "state"
    sets.mkdir()
    blocker.write_text("a file where the state directory should be")
    path = blocker / "file-sets.json"
    (sets / "a.yaml").write_text(pinned("alpha", [A1]))
    caplog.set_level(logging.INFO, logger="cri_shim")
    async with image_sets(runtime, sets, state_file=str(path), load_state=True) as h:
        st = h.status()
        assert st["state_error"].startswith(f"{path}: cannot write") and st["state_write_failures"] == 1
        assert "image-set state file cannot be written" in caplog.text
        await reconciled(h, "alpha", 1)  # the sets apply all the same
        await wait_for(lambda: h.status().get("state_write_failures", 0) >= 3)  # every save, retried
        assert "cannot save the image-set state file" in caplog.text
        assert h.metrics.registry.get_sample_value("cri_shim_image_sets_state_write_failures_total") >= 3
        assert h.metrics.registry.get_sample_value("cri_shim_image_sets_state_file_error") == 1
        blocker.unlink()  # fixed: the next retry saves
        await wait_for(lambda: "state_error" not in h.status())
        assert h.metrics.registry.get_sample_value("cri_shim_image_sets_state_file_error") == 0
    assert "image-set state file saved again" in caplog.text
    assert list(json.loads(path.read_text())["files"]) == [str(sets / "a.yaml")]


def test_the_two_state_files_must_differ(tmp_path: Path) -> None:
    from shim.config import ConfigError, from_dict

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}")
    same = str(tmp_path / "state.json")
    with pytest.raises(ConfigError, match="image_sets.state_file.*must differ from cluster.state_file"):
        from_dict({"image_sets": {"dir": str(tmp_path), "state_file": same},
                   "cluster": {"kubeconfig": str(kubeconfig), "state_file": same}})
    cfg = from_dict({"image_sets": {"dir": str(tmp_path)}, "cluster": {"kubeconfig": str(kubeconfig)}})
    assert (cfg.image_sets.state_file, cfg.cluster.state_file) == ("/var/lib/cri-shim/file-sets.json",
                                                                   "/var/lib/cri-shim/cluster-sets.json")
    assert from_dict({"image_sets": {"dir": str(tmp_path), "state_file": ""}}).image_sets.state_file == ""


async def test_a_corrupt_state_file_with_nothing_to_keep_is_rewritten_at_start(runtime, store, tmp_path) -> None:
    sets, path = tmp_path / "sets", tmp_path / "file-sets.json"
    sets.mkdir()
    path.write_text('{"version": 1, "files": 3}')
    async with image_sets(runtime, sets, state_file=str(path), load_state=True) as h:
        assert "not a map of path to text" in h.status()["state_error"]
        await wait_for(lambda: "state_error" not in h.status())
    assert json.loads(path.read_text()) == {"version": 1, "files": {}}
