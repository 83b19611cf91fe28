"""YAML from files the shim reads (its config, image-set files), with bounds.

PyYAML's safe loader still expands aliases (a few hundred bytes of nested ``&a [*b, *b, ...]``
become gigabytes) and recurses once per nesting level (libyaml's composer crashes the
process on some 100,000 nested ``[``). So before a document is built, its event stream is
read and refused at the first alias or past MAX_DEPTH nesting levels; and a file is read
only up to its size cap, never whole when it is bigger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_DEPTH = 64  # nesting levels of maps and lists; the shim's files need fewer than 10
CONFIG_MAX_BYTES = 1 << 20  # the config file (fixed: the file cannot set its own cap)

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UnsafeYaml(ValueError):
    """The text is valid YAML but uses what the shim refuses (an alias, deep nesting)."""


class TooBig(ValueError):
    """The file is over its size cap."""


def read_capped(path: str | Path, max_bytes: int) -> str:
    """The file's text; TooBig when it has more than ``max_bytes`` (only that much is read).
    OSError and UnicodeDecodeError as reading raises them."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooBig(f"larger than {max_bytes} bytes")
    return data.decode()


def _where(event: yaml.Event) -> str:
    mark = event.start_mark
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def check(text: str) -> None:
    """Raise UnsafeYaml for an alias or nesting deeper than MAX_DEPTH, yaml.YAMLError for bad
    syntax. Stops at the first offending event, so the cost is bounded by the text read."""
    depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.AliasEvent):
            raise UnsafeYaml(f"aliases (*name) are not allowed{_where(event)}")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise UnsafeYaml(f"nested more than {MAX_DEPTH} levels deep{_where(event)}")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def load_all(text: str) -> list[Any]:
    """Every document of ``text`` (a single-document file gives a list of one)."""
    check(text)
    return list(yaml.load_all(text, Loader=_Loader))


def load(text: str) -> Any:
    """The one document of ``text`` (None when empty)."""
    check(text)
    return yaml.load(text, Loader=_Loader)
