"""YAML from files the shim reads (its config, image-set files), with bounds.

PyYAML's safe loader still expands aliases (a few hundred bytes of nested ``&a [*b, *b, ...]``
become gigabytes) and recurses once per nesting level (libyaml's composer crashes the
process on some 100,000 nested ``[``). So a document is never given to the composer before
its event stream was read and refused at the first alias or past MAX_DEPTH nesting levels;
and a file is read only up to its size cap, never whole when it is bigger.

``load_all`` (image-set files, up to tens of thousands of lines) builds the documents from
that same event stream in one pass: plain maps, lists and scalars, each scalar resolved and
constructed by PyYAML's own safe resolver and constructors, so the result equals
``yaml.load_all`` with the safe loader. What one pass does not build (an explicit tag other
than map, seq or str, a merge key ``<<``, a map or list used as a key) goes the two-pass way:
the event check, then PyYAML's loader. One pass costs about a third of the two (0.10 against
0.34 s of CPU for 20,000 image names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import ScalarNode
from yaml.resolver import Resolver

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


def _alias(event: Any) -> UnsafeYaml:
    return UnsafeYaml(f"aliases (*name) are not allowed{_where(event)}")


def _too_deep(event: Any) -> UnsafeYaml:
    return UnsafeYaml(f"nested more than {MAX_DEPTH} levels deep{_where(event)}")


def check(text: str) -> None:
    """Raise UnsafeYaml for an alias or nesting deeper than MAX_DEPTH, yaml.YAMLError for bad
    syntax. Stops at the first offending event, so the cost is bounded by the text read."""
    depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.AliasEvent):
            raise _alias(event)
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep(event)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def load_all(text: str) -> list[Any]:
    """Every document of ``text`` (a single-document file gives a list of one). UnsafeYaml and
    yaml.YAMLError as ``check`` raises them, then as PyYAML's safe loader does."""
    try:
        return _one_pass(text)
    except _TwoPasses:
        check(text)
        return list(yaml.load_all(text, Loader=_Loader))


class _TwoPasses(Exception):
    """What _one_pass does not build: the text goes through check and PyYAML's loader."""


_STR = "tag:yaml.org,2002:str"
_COLLECTION_TAGS = (None, "!", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")
_RESOLVERS: dict[Any, list[tuple[str, Any]]] = Resolver.yaml_implicit_resolvers
_CONSTRUCT = SafeConstructor()
_NO_KEY = object()


def _scalar(event: Any) -> Any:  # a yaml.ScalarEvent (libyaml's marks are not typed as yaml.error.Mark)
    """A scalar as PyYAML's composer resolves it and its safe constructor builds it."""
    if event.tag is not None and event.tag != "!":
        raise _TwoPasses  # explicit tag (!!str, !!binary, ...)
    value = event.value
    if not event.implicit[0]:  # quoted, or the non-specific tag "!": a string
        return value
    for tag, regexp in _RESOLVERS.get(value[:1], []) + _RESOLVERS.get(None, []):
        if regexp.match(value):
            if tag == _STR:
                return value
            construct = SafeConstructor.yaml_constructors.get(tag)
            if construct is None or tag == "tag:yaml.org,2002:merge":
                raise _TwoPasses
            return construct(_CONSTRUCT, ScalarNode(tag, value, event.start_mark, event.end_mark, event.style))
    return value


def _one_pass(text: str) -> list[Any]:
    """The documents, built from the event stream while it is checked (see the module docstring)."""
    docs: list[Any] = []
    stack: list[list[Any]] = []  # [the open map or list, the key read for its next value (maps)]
    root: Any = None
    events: Iterator[Any] = yaml.parse(text, Loader=_Loader)
    for event in events:
        kind = event.__class__
        if kind is yaml.ScalarEvent:
            value = _scalar(event)
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            if event.tag not in _COLLECTION_TAGS:
                raise _TwoPasses  # !!omap, !!set, !!pairs, a local tag
            if len(stack) >= MAX_DEPTH:
                raise _too_deep(event)
            stack.append([{} if kind is yaml.MappingStartEvent else [], _NO_KEY])
            continue
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            value = stack.pop()[0]
        elif kind is yaml.AliasEvent:
            raise _alias(event)
        elif kind is yaml.DocumentEndEvent:
            docs.append(root)
            root = None
            continue
        else:  # stream and document start
            continue
        if not stack:
            root = value
            continue
        top = stack[-1]
        if top[0].__class__ is list:
            top[0].append(value)
        elif top[1] is _NO_KEY:
            if isinstance(value, (dict, list)):
                raise _TwoPasses  # PyYAML refuses an unhashable key with its own error
            top[1] = value
        else:
            top[0][top[1]] = value
            top[1] = _NO_KEY
    return docs


def load(text: str) -> Any:
    """The one document of ``text`` (None when empty)."""
    check(text)
    return yaml.load(text, Loader=_Loader)
