"""Image-set files: what is accepted, how it is normalized, and how bad files are reported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shim.imagesets.loader import SetDirectory, SetFileError, parse_text

DIGEST = "sha256:" + "a" * 64

MCO = f"""
apiVersion: machineconfiguration.openshift.io/v1
kind: PinnedImageSet
metadata:
  name: release
  generation: 7
  labels:
    machineconfiguration.openshift.io/role: worker
spec:
  pinnedImages:
    - name: quay.io/openshift/release@{DIGEST}
    - name: nginx
    - name: docker.io/library/nginx:latest
"""


def test_pinned_image_set_taken_as_is() -> None:
    [s] = parse_text(MCO, "/sets/a.yaml")
    assert s.name == "release" and s.kind == "PinnedImageSet" and s.pin is True
    # normalized like the runtime does, duplicates (nginx == docker.io/library/nginx:latest) once
    assert s.refs == (f"quay.io/openshift/release@{DIGEST}", "docker.io/library/nginx:latest")
    assert s.spelled == (f"quay.io/openshift/release@{DIGEST}", "nginx")
    assert s.generation == "7"
    assert s.ignored == ("metadata.labels",)
    alpha = MCO.replace("openshift.io/v1\n", "openshift.io/v1alpha1\n")
    assert parse_text(alpha, "a.yaml")[0].refs == s.refs


def test_own_kind_keeps_present_without_pinning_and_hashes_content() -> None:
    text = """
apiVersion: cri-shim.io/v1
kind: ImageSet
metadata: {name: warm}
spec:
  images: [{name: "busybox:1.36"}, {name: "registry.local:5000/app:v2"}]
"""
    [s] = parse_text(text, "b.yaml")
    assert s.pin is False
    assert s.refs == ("docker.io/library/busybox:1.36", "registry.local:5000/app:v2")
    assert s.generation.startswith("sha256:")
    [s2] = parse_text(text.replace("v2", "v3"), "b.yaml")
    assert s2.generation != s.generation
    [pinned] = parse_text(text.replace("spec:\n", "spec:\n  pin: true\n"), "b.yaml")
    assert pinned.pin is True


def test_several_documents_and_empty_ones() -> None:
    text = MCO + "---\n---\n" + """
apiVersion: cri-shim.io/v1
kind: ImageSet
metadata: {name: other}
spec: {images: []}
"""
    assert [s.name for s in parse_text(text, "c.yaml")] == ["release", "other"]


@pytest.mark.parametrize("text, where", [
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "unsupported kind 'ConfigMap'"),
    ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nspec: {images: []}\n", "document 0.metadata.name: required"),
    ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: x}\nspec: {images: [{name: 'Nginx'}]}\n",
     "document 0.spec.images[0].name"),
    ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: x}\nspec: {images: [{name: 'quay.io/*'}]}\n",
     "globs are not allowed"),
    ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: x}\nspec: {images: [{name: '" + DIGEST + "'}]}\n",
     "an image ID cannot be pulled"),
    ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: x}\nspec: {pin: 'yes', images: []}\n",
     "spec.pin: expected true or false"),
    ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: x}\nspec: {imgs: []}\n", "spec.imgs: unknown key"),
    ("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: x}\nspec: {images: [nginx]}\n",
     "spec.images[0].name: expected an image reference"),
    ("a: [unclosed\n", "not valid YAML"),
    ("- just\n- a list\n", "expected a map"),
])
def test_bad_files_are_refused_with_file_document_and_key(text: str, where: str) -> None:
    with pytest.raises(SetFileError) as e:
        parse_text(text, "/etc/sets/bad.yaml")
    assert str(e.value).startswith("/etc/sets/bad.yaml")
    assert where in str(e.value)


def _own(name: str, *images: str) -> str:
    items = ", ".join(f"{{name: '{i}'}}" for i in images)
    return f"apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {{name: {name}}}\nspec: {{images: [{items}]}}\n"


def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # make the change visible to a stamp


def test_directory_keeps_a_bad_files_previous_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yml"
    a.write_text(_own("a", "nginx:1"))
    b.write_text(_own("b", "redis:7"))
    (tmp_path / ".a.yaml.swp").write_text("garbage: [")
    (tmp_path / "README.txt").write_text("not a set")
    d = SetDirectory(str(tmp_path))
    r = d.scan()
    assert r.changed and set(r.sets) == {"a", "b"} and not r.errors
    assert not d.scan().changed  # nothing re-read when nothing changed

    _touch(a, "apiVersion: [oops")
    _touch(b, _own("b", "redis:7", "memcached:1"))
    r = d.scan()
    assert r.sets["a"].refs == ("docker.io/library/nginx:1",)  # previous content in force
    assert r.sets["b"].refs == ("docker.io/library/redis:7", "docker.io/library/memcached:1")
    assert list(r.errors) == [str(a)] and "not valid YAML" in r.errors[str(a)]
    assert r.new_errors == [r.errors[str(a)]]

    b.unlink()
    r = d.scan()
    assert set(r.sets) == {"a"} and r.changed


def test_an_edited_file_reads_as_a_fresh_parse(tmp_path: Path) -> None:
    """A re-read reuses the previous version's normalized names: what it declares is exactly
    what a first read of the new text gives, new and rewritten names included."""
    f = tmp_path / "a.yaml"
    f.write_text(_own("a", "nginx", "redis:7", "quay.io/x/y:1"))
    d = SetDirectory(str(tmp_path))
    d.scan()
    text = _own("a", "redis:7", "nginx:1.27", "nginx", f"quay.io/x/y@{DIGEST}", "*bad")
    _touch(f, text)
    r = d.scan()
    assert "images[4].name: globs are not allowed" in r.errors[str(f)]  # a new bad name is still refused
    text = _own("a", "redis:7", "nginx:1.27", "nginx", f"quay.io/x/y@{DIGEST}")
    _touch(f, text)
    r = d.scan()
    assert not r.errors and r.sets["a"] == parse_text(text, str(f))[0]
    assert r.sets["a"].refs == ("docker.io/library/redis:7", "docker.io/library/nginx:1.27",
                                "docker.io/library/nginx:latest", f"quay.io/x/y@{DIGEST}")


def test_directory_refuses_a_set_name_declared_in_two_files(tmp_path: Path) -> None:
    (tmp_path / "1.yaml").write_text(_own("same", "nginx:1"))
    (tmp_path / "2.yaml").write_text(_own("same", "redis:7"))
    r = SetDirectory(str(tmp_path)).scan()
    assert r.sets["same"].refs == ("docker.io/library/nginx:1",)
    assert "already declared in" in r.errors[str(tmp_path / "2.yaml")]


def test_missing_directory_is_reported_not_fatal(tmp_path: Path) -> None:
    d = SetDirectory(str(tmp_path / "nope"))
    r = d.scan()
    assert r.sets == {} and "no such directory" in d.dir_error
