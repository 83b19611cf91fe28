"""The image-pattern grammar: what a pattern in ``pins.images``, ``runtime_handlers.rules[].images``
or an image set may be, its normal form, and how a glob matches.

A pattern is one of:
- an image reference, normalized (``nginx`` = ``docker.io/library/nginx:latest``);
- a digest reference, ``repo@sha256:...`` (``repo:tag@sha256:...`` stands for the digest);
- an image ID, ``sha256:<64 hex>`` or the bare 64 hex (the same pattern; containerd
  reports IDs with ``sha256:``, CRI-O without);
- a glob over normalized references: ``registry.k8s.io/pause:*``, ``quay.io/org/*``
  (fnmatch rules: ``*`` also crosses ``/``; docker.io defaults apply to the
  repository part, so ``pause:*`` means ``docker.io/library/pause:*``; an IPv6 host
  such as ``[fc00::1]:5000/`` is taken literally, not as a character class).

Below images/ and runtime_handlers/, which both match names against patterns: this module
imports only reference parsing.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable

from . import reference
from .observability.logs import shown
from .reference import InvalidReference

__all__ = ["glob_regex", "globs_regex", "is_glob", "normalize_pattern", "validate_pattern"]

_GLOB_CHARS = frozenset("*?[")
_SHORT_ID = re.compile(r"sha256:[0-9a-f]{1,63}", re.ASCII)
_IPV6_HOST = re.compile(r"\[[0-9a-fA-F:]+\](?::[0-9]+)?/")  # [fc00::1]:5000/ is a host, not a [class]


def _split_ipv6_host(p: str) -> tuple[str, str]:
    m = _IPV6_HOST.match(p)
    return (p[:m.end()], p[m.end():]) if m else ("", p)


def is_glob(p: str) -> bool:
    """The pattern (in normal form) is a glob, not one name."""
    return any(c in _GLOB_CHARS for c in _split_ipv6_host(p)[1])


def glob_regex(g: str) -> str:
    """A glob in normal form as a regex: fnmatch rules (``*`` crosses ``/``), an IPv6 host taken literally."""
    host, rest = _split_ipv6_host(g)
    return re.escape(host) + fnmatch.translate(rest)


def globs_regex(globs: Iterable[str], group: str) -> re.Pattern[str] | None:
    """Every glob at once: one alternation, glob ``i`` in the outer group ``<group><i>`` (so
    ``match.lastgroup`` names the glob that matched). None when there is no glob."""
    alternatives = [f"(?P<{group}{i}>{glob_regex(g)})" for i, g in enumerate(globs)]
    return re.compile("|".join(alternatives)) if alternatives else None


def _normalize_glob(p: str) -> str:
    """Apply docker.io defaults and the lower-case host to a glob, as reference.normalize does."""
    domain, remainder = reference.split_domain(p)
    return f"{domain}/{remainder}"


def normalize_pattern(p: str) -> str:
    """The normal form a pattern is matched in; raises ValueError if it can't be one."""
    p = p.strip()
    if not p:
        raise ValueError("empty pin pattern")
    if is_glob(p):
        if "@" in p:
            raise ValueError("a glob cannot contain a digest")
        return _normalize_glob(p)
    if reference.is_image_id(p):
        return reference.normalize(p)
    if _SHORT_ID.fullmatch(p):  # would parse as the tag of docker.io/library/sha256: never what was meant
        raise ValueError(f"{shown(p)} is a shortened image ID; an ID pin needs all 64 hex digits "
                         "(with or without 'sha256:')")
    try:
        ref = reference.parse(p)
    except InvalidReference as e:
        raise ValueError(str(e)) from None
    if ref.digest is not None:
        return f"{ref.name}@{ref.digest}"
    return str(ref.with_default_tag())


def validate_pattern(p: str) -> None:
    normalize_pattern(p)
