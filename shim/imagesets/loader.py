"""Image-set files: parsing, validation, and a directory of them.

A file holds one or more YAML documents. Two kinds are understood:

* ``kind: PinnedImageSet`` (``apiVersion: machineconfiguration.openshift.io/v1`` or
  ``v1alpha1``), taken as is: ``spec.pinnedImages[].name``; kept present and pinned.
* ``kind: ImageSet`` (``apiVersion: cri-shim.io/v1``): ``spec.images[].name`` and
  ``spec.pin`` (default false); kept present, pinned only when ``pin: true``.
  ``spec.runtimeHandler`` and ``spec.images[].runtimeHandler`` (the image's wins)
  name the runtime handler the image is pulled for.
* A PinnedImageSet's schema is OpenShift's, so its handler is an annotation:
  ``metadata.annotations["cri-shim.io/runtime-handler"]``, for every image of the set.

``metadata.name`` is required and names the set node-wide. ``metadata.labels``
(MachineConfigPool selection) and ``spec.nodeSelector`` are ignored: on a single node
every set applies. Other fields (``status``, annotations, ...) are ignored too. Empty
documents are skipped. References are normalized like the runtime does
(``nginx`` = ``docker.io/library/nginx:latest``); a digest reference matches by digest.

A bad file (unreadable, over ``image_sets.max_file_bytes``, invalid YAML, YAML with an
alias or deep nesting (see shim/safeyaml.py), invalid set) is reported and its previous
content stays in force; the other files are unaffected. Across a restart the previous content
is the one saved in ``image_sets.state_file`` (``SetDirectory.restore``, shim/imagesets/state.py).
A directory that cannot be read (other than missing) keeps every file's content in force.
Error messages quote at most a short part of an offending value (``logs.shown``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import yaml

from .. import reference, safeyaml
from ..image_patterns import normalize_pattern
from ..observability.logs import QUOTE_MAX_CHARS, cut, shown

MCO_GROUP = "machineconfiguration.openshift.io"
MCO_VERSIONS = (f"{MCO_GROUP}/v1", f"{MCO_GROUP}/v1alpha1")
OWN_VERSIONS = ("cri-shim.io/v1",)
SUFFIXES = (".yaml", ".yml", ".json")
HANDLER_ANNOTATION = "cri-shim.io/runtime-handler"
DEFAULT_MAX_FILE_BYTES = 1 << 20  # image_sets.max_file_bytes
EMPTY: Mapping[str, str] = MappingProxyType({})
NAME_MAX_LENGTH = 253  # metadata.name: a Kubernetes object name (DNS subdomain) has at most 253


class SetFileError(ValueError):
    """A set file cannot be used; the message names the file, document and key."""


@dataclass(frozen=True)
class ImageSet:
    name: str
    kind: str  # PinnedImageSet | ImageSet
    pin: bool
    refs: tuple[str, ...]  # normalized, unique, in file order
    spelled: tuple[str, ...]  # the reference as written, parallel to refs (what is pulled)
    generation: str  # metadata.generation when given, else a content hash
    source: str  # file path
    ignored: tuple[str, ...] = ()  # fields present but not applicable on a single node
    handlers: tuple[str, ...] = ()  # runtime handler per image, parallel to refs ("" = none declared)


def normalize_ref(ref: str) -> str:
    """Normalized form used for presence and pins; raises ValueError if invalid or a glob."""
    if any(c in ref for c in "*?["):
        raise ValueError("globs are not allowed in an image set")
    if reference.is_image_id(ref):
        raise ValueError("an image ID cannot be pulled; use repository@sha256:<digest>")
    return normalize_pattern(ref)


def known_names(sets: Sequence[ImageSet]) -> dict[str, str]:
    """spelled -> normalized for every image of ``sets`` (for parse_text: a re-read of a file of
    10,000 names normalizes only the ones it adds; built per read, kept nowhere)."""
    out: dict[str, str] = {}
    for s in sets:
        out.update(zip(s.spelled, s.refs))
    return out


def _content_hash(kind: str, pin: bool, refs: tuple[str, ...], handlers: tuple[str, ...]) -> str:
    h = hashlib.sha256(f"{kind}\0{pin}\0".encode())
    for r, handler in zip(refs, handlers):
        h.update(r.encode() + b"\0" + (handler.encode() + b"\1" if handler else b""))
    return "sha256:" + h.hexdigest()[:16]


def _handler(key: str, v: Any) -> str:
    if v is None:
        return ""
    if not isinstance(v, str) or not v.strip() or v != v.strip():
        raise SetFileError(f"{key}: expected a runtime handler name, got {shown(v)}")
    return v


def _images(where: str, items: Any, default_handler: str = "", *, per_image_handler: bool = False,
            known: Mapping[str, str] = EMPTY) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    if items is None:
        items = []
    if not isinstance(items, list):
        raise SetFileError(f"{where}: expected a list of {{name: <image>}}, got {type(items).__name__}")
    refs: list[str] = []
    spelled: list[str] = []
    handlers: list[str] = []
    seen: set[tuple[str, str]] = set()
    for i, item in enumerate(items):
        key = f"{where}[{i}].name"
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise SetFileError(f"{key}: expected an image reference string, got {shown(name)}")
        ref = known.get(name.strip(), "")
        if not ref:
            try:
                ref = normalize_ref(name.strip())
            except ValueError as e:
                raise SetFileError(f"{key}: {e}") from None
        handler = default_handler
        if per_image_handler:
            extra = set(item) - {"name", "runtimeHandler"}
            if extra:
                raise SetFileError(f"{where}[{i}].{cut(sorted(map(str, extra))[0], QUOTE_MAX_CHARS)}: unknown key "
                                   "(known: name, runtimeHandler)")
            handler = _handler(f"{where}[{i}].runtimeHandler", item.get("runtimeHandler")) or default_handler
        if (ref, handler) not in seen:
            seen.add((ref, handler))
            refs.append(ref)
            spelled.append(name.strip())
            handlers.append(handler)
    return tuple(refs), tuple(spelled), tuple(handlers)


def parse_document(doc: Mapping[str, Any], where: str, source: str, known: Mapping[str, str] = EMPTY) -> ImageSet:
    """``known``: spelled name -> normalize_ref(name) from a previous version (an edit normalizes only what it adds)."""
    api, kind = doc.get("apiVersion"), doc.get("kind")
    meta = doc.get("metadata") or {}
    spec = doc.get("spec") or {}
    if not isinstance(meta, dict):
        raise SetFileError(f"{where}.metadata: expected a map")
    if not isinstance(spec, dict):
        raise SetFileError(f"{where}.spec: expected a map")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise SetFileError(f"{where}.metadata.name: required")
    if len(name) > NAME_MAX_LENGTH:
        raise SetFileError(f"{where}.metadata.name: longer than {NAME_MAX_LENGTH} characters: {shown(name)}")
    ignored = ["metadata.labels"] if meta.get("labels") else []
    if spec.get("nodeSelector"):
        ignored.append("spec.nodeSelector")
    if kind == "PinnedImageSet" and api in MCO_VERSIONS:
        # taken as is: whatever else a newer API version adds to spec is noted, not refused
        extra = sorted(map(str, set(spec) - {"pinnedImages", "nodeSelector"}))
        ignored += [f"spec.{cut(k, QUOTE_MAX_CHARS)}" for k in extra]
        annotations = meta.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise SetFileError(f"{where}.metadata.annotations: expected a map")
        handler = _handler(f"{where}.metadata.annotations[{HANDLER_ANNOTATION}]", annotations.get(HANDLER_ANNOTATION))
        refs, spelled, handlers = _images(f"{where}.spec.pinnedImages", spec.get("pinnedImages"), handler,
                                           known=known)
        pin = True
    elif kind == "ImageSet" and api in OWN_VERSIONS:
        unknown = set(spec) - {"images", "pin", "nodeSelector", "runtimeHandler"}
        if unknown:
            raise SetFileError(f"{where}.spec.{cut(sorted(map(str, unknown))[0], QUOTE_MAX_CHARS)}: unknown key "
                               "(known: images, nodeSelector, pin, runtimeHandler)")
        pin = spec.get("pin", False)
        if not isinstance(pin, bool):
            raise SetFileError(f"{where}.spec.pin: expected true or false, got {shown(pin)}")
        handler = _handler(f"{where}.spec.runtimeHandler", spec.get("runtimeHandler"))
        refs, spelled, handlers = _images(f"{where}.spec.images", spec.get("images"), handler, per_image_handler=True,
                                           known=known)
    else:
        raise SetFileError(
            f"{where}: unsupported kind {shown(kind)} / apiVersion {shown(api)} (expected PinnedImageSet in "
            f"{' or '.join(MCO_VERSIONS)}, or ImageSet in {', '.join(OWN_VERSIONS)})")
    gen = meta.get("generation")
    generation = (str(gen) if isinstance(gen, int) and not isinstance(gen, bool)
                  else _content_hash(kind, pin, refs, handlers))
    return ImageSet(name, kind, pin, refs, spelled, generation, source, tuple(ignored), handlers)


def parse_text(text: str, source: str, known: Mapping[str, str] = EMPTY) -> list[ImageSet]:
    """Every set in a file's text; raises SetFileError naming file, document and key. ``known``: see
    parse_document (``known_names`` of the file's previous sets)."""
    try:
        docs = safeyaml.load_all(text)
    except safeyaml.UnsafeYaml as e:
        raise SetFileError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise SetFileError(f"{source}: not valid YAML: {e}") from None
    out: list[ImageSet] = []
    names: set[str] = set()
    for i, doc in enumerate(docs):
        if doc is None:
            continue
        where = f"{source}: document {i}"
        if not isinstance(doc, dict):
            raise SetFileError(f"{where}: expected a map, got {type(doc).__name__}")
        s = parse_document(doc, where, source, known)
        if s.name in names:
            raise SetFileError(f"{where}.metadata.name: set {shown(s.name)} is declared twice in this file")
        names.add(s.name)
        out.append(s)
    return out


def parse_here(text: str, source: str, previous: Sequence[ImageSet] = ()) -> list[ImageSet]:
    """``parse_text`` in the calling thread; ``previous``: the file's sets in force (their names are
    not normalized again)."""
    return parse_text(text, source, known_names(previous))


Parse = Callable[[str, str, Sequence[ImageSet]], list[ImageSet]]  # parse_here, or ParseProcess.parse


Stamp = tuple[int, int, int]  # (mtime_ns, size, inode) of the file (symlinks followed)
UNREAD: Stamp = (0, 0, 0)  # a file in force from the state file while the directory cannot be read


@dataclass
class FileState:
    stamp: Stamp
    sets: list[ImageSet]  # what is in force (the last good content)
    error: str = ""  # why the current content is not used; "" when it is
    text: str | None = None  # the text of what is in force (None: nothing)
    note: str = ""  # where what is in force came from, when not from this run (the state file)


@dataclass
class ScanResult:
    changed: bool
    sets: dict[str, ImageSet]
    errors: dict[str, str]  # file -> error
    new_errors: list[str] = field(default_factory=list)  # errors first seen in this scan
    accepted_changed: bool = False  # the text in force of some file changed (what the state file keeps)


class SetDirectory:
    """The files of one directory; re-reads only files whose stamp changed.

    Hidden files (``.x``, ConfigMap's ``..data`` links) and other suffixes are skipped.
    A file that turns bad keeps its previous sets in force; a removed file's sets go.
    ``restore`` (before the first scan) gives the previous content of each file across a restart.
    ``parse``: how a file's text becomes sets (the shim's ImageSets uses a child process,
    shim/imagesets/parse_process.py).
    """

    def __init__(self, path: str, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, parse: Parse = parse_here) -> None:
        self.path = path
        self.max_file_bytes = max_file_bytes
        self._parse = parse
        self.files: dict[str, FileState] = {}
        self.dir_error = ""
        self.dir_missing = False
        self.scans = 0
        self._restored: dict[str, str] = {}  # path -> its last valid text, from the state file (first scan only)
        self._restored_from = ""
        self._dup_errors: dict[str, str] = {}

    def configure(self, max_file_bytes: int) -> None:
        """A reload (image_sets.max_file_bytes): the next scan reads files within the new cap."""
        self.max_file_bytes = max_file_bytes

    def restore(self, files: dict[str, str], where: str) -> None:
        """The last valid text of each file, saved before a restart (``where``: the state file).
        Used by the first scan for a file that is invalid or unreadable then; a file that is gone is gone."""
        assert self.scans == 0, "restore before the first scan"
        self._restored, self._restored_from = dict(files), where

    def accepted(self) -> dict[str, str]:
        """path -> the text in force, for every file that has one (what the state file keeps)."""
        return {p: f.text for p, f in sorted(self.files.items()) if f.text is not None}

    def stamps(self) -> dict[str, Stamp]:
        out: dict[str, Stamp] = {}
        try:
            entries = os.scandir(self.path)
        except FileNotFoundError:
            self.dir_error, self.dir_missing = f"{self.path}: no such directory", True
            return out
        except OSError as exc:
            self.dir_error, self.dir_missing = f"{self.path}: {exc.strerror}", False
            return out
        self.dir_error, self.dir_missing = "", False
        with entries:
            for e in entries:
                if e.name.startswith(".") or not e.name.endswith(SUFFIXES):
                    continue
                try:
                    st = e.stat()  # follows symlinks: a ConfigMap swap changes the target
                except OSError:
                    continue
                if not e.is_file():
                    continue
                out[e.path] = (st.st_mtime_ns, st.st_size, st.st_ino)
        return out

    def _previous(self, path: str) -> tuple[list[ImageSet], str | None, str]:
        """What stays in force when ``path`` cannot be used: (sets, their text, what to add to the error)."""
        old = self.files.get(path)
        if old is not None:
            return old.sets, old.text, old.note
        text = self._restored.get(path) if self.scans == 0 else None
        if text is None:
            return [], None, ""
        try:
            sets = self._parse(text, path, ())
        except SetFileError as e:
            return [], None, f"; its saved version in {self._restored_from} is not valid either ({e})"
        return sets, text, f"; its last valid version, saved in {self._restored_from}, is in force"

    def scan(self) -> ScanResult:
        """Blocking (file I/O and YAML): call from a thread."""
        stamps = self.stamps()
        changed = accepted_changed = False
        new_errors: list[str] = []
        if self.dir_error and not self.dir_missing:  # unreadable, not gone: every file keeps what it has
            for path in sorted(self._restored) if self.scans == 0 else ():
                sets, text, note = self._previous(path)
                self.files[path] = FileState(UNREAD, sets, f"{self.dir_error}{note}", text, note)
                changed = True
        for path in list(self.files) if not self.dir_error or self.dir_missing else ():
            if path not in stamps:
                accepted_changed |= self.files.pop(path).text is not None
                changed = True
        for path, stamp in sorted(stamps.items()):
            old = self.files.get(path)
            if old is not None and old.stamp == stamp:
                continue
            try:
                text = safeyaml.read_capped(path, self.max_file_bytes)
                sets = self._parse(text, path, old.sets if old is not None else ())
            except (safeyaml.TooBig, OSError, UnicodeDecodeError, SetFileError) as e:
                err = (f"{path}: {e} (image_sets.max_file_bytes)" if isinstance(e, safeyaml.TooBig)
                       else str(e) if isinstance(e, SetFileError) else f"{path}: cannot read: {e}")
                previous, previous_text, note = self._previous(path)
                self.files[path] = FileState(stamp, previous, err + note, previous_text, note)
                new_errors.append(err + note)
                changed |= old is None and bool(previous)
                continue
            accepted_changed |= old is None or old.text != text
            self.files[path] = FileState(stamp, sets, "", text)
            changed = True
        if self.scans == 0:
            accepted_changed = self.accepted() != self._restored
            self._restored = {}
        self.scans += 1
        merged, dup_errors = self._merge()
        new_errors += [err for p, err in dup_errors.items() if self._dup_errors.get(p) != err]
        self._dup_errors = dup_errors
        errors = {p: f.error for p, f in self.files.items() if f.error}
        for p, err in dup_errors.items():
            errors.setdefault(p, err)
        return ScanResult(changed or bool(new_errors), merged, errors, new_errors, accepted_changed)

    def _merge(self) -> tuple[dict[str, ImageSet], dict[str, str]]:
        """All sets by name; a name taken by an earlier file (path order) is refused in later ones."""
        out: dict[str, ImageSet] = {}
        errors: dict[str, str] = {}
        for path in sorted(self.files):
            for s in self.files[path].sets:
                if s.name in out:
                    errors[path] = (f"{path}: set {shown(s.name)} is already declared in {out[s.name].source}; "
                                    "ignoring it here")
                    continue
                out[s.name] = s
        return out, errors
