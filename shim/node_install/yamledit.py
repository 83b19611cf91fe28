"""A YAML file edited in a few top-level lines, every other byte kept: kubelet's config file
(kubeadm: ``/var/lib/kubelet/config.yaml``), where ``cri-shim node install`` switches the
endpoints, and the shipped config.example.yaml, where it sets ``upstream``.

Such a file has the operator's comments, key order and quoting. Nothing is re-serialised:
each edit replaces the characters of one top-level scalar value (``imageServiceEndpoint: ""``
-> ``imageServiceEndpoint: unix:///run/cri-shim/cri-shim.sock``), appends a missing key as one
line after the last entry, or removes the one line a key was added on. Every other byte stays
as it was. The result is parsed again and must equal the original document with exactly those
keys changed; anything this cannot do safely (a flow-style or JSON mapping, a key written
twice, a value over several lines) is refused with the reason, for the operator to edit by hand.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

from .. import safeyaml

#: Kubelet reads at most this much config; a bigger file is not a kubelet config.
MAX_BYTES = 1 << 20
#: libyaml's marks count characters, as Python's str does
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class EditError(ValueError):
    """The file cannot be read or edited safely; the message says why."""


@dataclass(frozen=True)
class Entry:
    """One top-level ``key: value`` whose value is a scalar on the key's line."""

    key: str
    value: Any  #: as YAML reads it
    raw: str  #: the value's characters as written ("" for ``key:`` with nothing after it)
    start: int  #: offset of the value's first character (just after the colon when empty)
    end: int  #: offset after its last character
    after_colon: int  #: offset just after the key's colon
    line_start: int  #: offset of the first character of the key's line
    line_end: int  #: offset after the line's newline (or the end of the text)


def decode(data: bytes, where: str) -> str:
    if len(data) > MAX_BYTES:
        raise EditError(f"{where}: larger than {MAX_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EditError(f"{where}: not UTF-8 ({e})") from None


def _root(text: str, where: str) -> yaml.MappingNode | None:
    try:
        safeyaml.check(text)
        node = yaml.compose(text, Loader=_LOADER)
    except (yaml.YAMLError, safeyaml.UnsafeYaml) as e:
        raise EditError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    if node is None:
        return None
    if not isinstance(node, yaml.MappingNode):
        raise EditError(f"{where}: not a KubeletConfiguration (the document is not a mapping)")
    return node


def parse(text: str, where: str) -> dict[str, Any]:
    """The document as kubelet reads it (an empty file: {})."""
    try:
        doc = safeyaml.load(text)
    except (yaml.YAMLError, safeyaml.UnsafeYaml) as e:
        raise EditError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise EditError(f"{where}: not a KubeletConfiguration (the document is not a mapping)")
    return doc


def entries(text: str, where: str) -> dict[str, Entry]:
    """The top-level entries whose value is a scalar on one line, by key."""
    root = _root(text, where)
    out: dict[str, Entry] = {}
    if root is None:
        return out
    seen: set[str] = set()
    for key, value in root.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        name = str(key.value)
        if name in seen:
            raise EditError(f"{where}: key {name} is written twice")
        seen.add(name)
        if not isinstance(value, yaml.ScalarNode) or value.start_mark.line != value.end_mark.line \
                or key.start_mark.line != value.start_mark.line:
            continue
        line_start = text.rfind("\n", 0, key.start_mark.index) + 1
        nl = text.find("\n", value.end_mark.index)
        line_end = len(text) if nl < 0 else nl + 1
        raw = text[value.start_mark.index:value.end_mark.index]
        out[name] = Entry(name, yaml.safe_load(raw or "null"), raw, value.start_mark.index, value.end_mark.index,
                          text.index(":", key.end_mark.index) + 1, line_start, line_end)
    return out


_PLAIN = re.compile(r"[A-Za-z0-9_./@][A-Za-z0-9_./:@+-]*")


def render(value: str | bool | int) -> str:
    """A scalar as one line of YAML that reads back as ``value``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if _PLAIN.fullmatch(value) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)  # a JSON string is a YAML double-quoted scalar


def _append_at(text: str, root: yaml.MappingNode | None) -> int:
    """Where new keys go: after the last entry, before a ``...`` document end marker if there is
    one; when the text does not end with a newline, before the first entry instead (so that
    removing the added lines gives back every byte)."""
    end_marker = re.search(r"(?m)^\.\.\.[ \t]*(#.*)?$", text)
    if end_marker is not None:
        return end_marker.start()
    if text.endswith("\n") or root is None or not root.value:
        return len(text)
    first = root.value[0][0].start_mark.index
    return text.rfind("\n", 0, first) + 1


#: ``edit``'s value for "remove the line this key is on".
REMOVE = None


def edit(text: str, changes: Mapping[str, str | None], where: str) -> str:
    """``text`` with each ``key: raw`` of ``changes`` set (``raw``: the value's characters, from
    ``render``, or "" for ``key:`` with no value), appended when missing, or the key's line
    removed when ``raw`` is ``REMOVE``.
    Raises EditError when that cannot be done without touching anything else."""
    root = _root(text, where)
    if root is not None and root.flow_style:
        raise EditError(f"{where}: a flow-style (JSON) mapping; edit it by hand")
    before = parse(text, where)
    found = entries(text, where)
    present = {str(k.value) for k, _ in root.value if isinstance(k, yaml.ScalarNode)} if root is not None else set()
    spans: list[tuple[int, int, str]] = []  # (start, end, replacement), applied from the end
    appended: list[str] = []
    expected = dict(before)
    newline = "\r\n" if "\r\n" in text else "\n"
    for key, raw in changes.items():
        if key in present and key not in found:
            raise EditError(f"{where}: {key} is not a one-line value; edit it by hand")
        entry = found.get(key)
        if raw is REMOVE:
            if entry is None:
                continue
            spans.append((entry.line_start, entry.line_end, ""))
            expected.pop(key, None)
            continue
        expected[key] = yaml.safe_load(raw or "null")
        if entry is None:
            appended.append(f"{key}:{' ' if raw else ''}{raw}{newline}")
        elif entry.raw != raw:
            # ``key:`` with nothing after it: the value needs its space, and loses it again
            spans.append((entry.start, entry.end, raw) if entry.raw and raw else
                         (entry.after_colon, entry.end, " " + raw if raw else ""))
    if appended:
        at = _append_at(text, root)
        if at == len(text) and text and not text.endswith("\n"):
            appended.insert(0, newline)  # comments only, and no newline at the end
        spans.append((at, at, "".join(appended)))
    out = text
    for start, end, new in sorted(spans, reverse=True):
        out = out[:start] + new + out[end:]
    if parse(out, where) != expected:
        raise EditError(f"{where}: editing {', '.join(changes)} would change more than those keys; "
                        f"edit it by hand")
    return out
