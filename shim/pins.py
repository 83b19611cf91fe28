"""Pinned-image patterns and matching.

A pattern is one of:
- an image reference, normalized (``nginx`` = ``docker.io/library/nginx:latest``);
- a digest reference, ``repo@sha256:...`` (``repo:tag@sha256:...`` pins the digest);
- an image ID, ``sha256:<64 hex>``;
- a glob over normalized references: ``registry.k8s.io/pause:*``, ``quay.io/org/*``.

An image matches when any of its names (ID, repo tags, repo digests) matches a
pattern. Exact patterns are a set lookup; globs are one combined regex, so marking
20,000 images stays cheap.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable

from . import reference
from .reference import ReferenceError

_GLOB_CHARS = frozenset("*?[")


def _is_glob(p: str) -> bool:
    return any(c in _GLOB_CHARS for c in p)


def _normalize_glob(p: str) -> str:
    """Apply docker.io defaults to a glob's repository part, like reference.normalize."""
    first, slash, rest = p.partition("/")
    if first == "index.docker.io" and slash:
        first = "docker.io"
    if slash and (first == "localhost" or "." in first or ":" in first):
        domain, remainder = first, rest
    else:
        domain, remainder = "docker.io", p
    if domain == "docker.io" and "/" not in remainder:
        remainder = "library/" + remainder
    return f"{domain}/{remainder}"


def normalize_pattern(p: str) -> str:
    """The canonical form a pattern is matched in; raises ValueError if it can't be one."""
    p = p.strip()
    if not p:
        raise ValueError("empty pin pattern")
    if _is_glob(p):
        if "@" in p:
            raise ValueError("a glob cannot contain a digest")
        return _normalize_glob(p)
    if reference.is_image_id(p):
        return reference.normalize(p)
    try:
        ref = reference.parse(p)
    except ReferenceError as e:
        raise ValueError(str(e)) from None
    if ref.digest is not None:
        return f"{ref.name}@{ref.digest}"
    return str(ref.with_default_tag())


def validate_pattern(p: str) -> None:
    normalize_pattern(p)


def image_names(image_id: str, repo_tags: Iterable[str], repo_digests: Iterable[str]) -> list[str]:
    """Every normalized name an image is known by (unparseable names kept as they are)."""
    names = [image_id] if image_id else []
    for n in (*repo_tags, *repo_digests):
        try:
            names.append(reference.normalize(n))
        except ReferenceError:
            names.append(n)
    return names


@dataclass(frozen=True)
class PinSet:
    """Immutable; build a new one on reload. ``source`` maps canonical pattern -> where it came from."""

    exact: frozenset[str]
    globs: tuple[str, ...]
    source: dict[str, str]
    _regex: re.Pattern[str] | None

    @classmethod
    def build(cls, patterns: Iterable[str], declared: Iterable[tuple[str, str]] = ()) -> "PinSet":
        """``patterns`` from config (pins.images); ``declared``: (image ref, set name) from image sets."""
        exact: set[str] = set()
        globs: list[str] = []
        source: dict[str, str] = {}
        for p in patterns:
            canon = normalize_pattern(p)
            if _is_glob(canon):
                globs.append(canon)
            else:
                exact.add(canon)
            source.setdefault(canon, f"pins.images {p}")
        for ref, set_name in declared:
            try:
                canon = normalize_pattern(ref)
            except ValueError:
                continue
            exact.add(canon)
            source.setdefault(canon, f"image set {set_name}")
        regex = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs)) if globs else None
        return cls(frozenset(exact), tuple(globs), source, regex)

    def __bool__(self) -> bool:
        return bool(self.exact or self.globs)

    def match(self, names: Iterable[str]) -> str | None:
        """The pin (canonical pattern) protecting an image known by ``names``, or None."""
        for n in names:
            if n in self.exact:
                return n
        if self._regex is not None:
            for n in names:
                if self._regex.match(n):
                    for g in self.globs:
                        if fnmatch.fnmatchcase(n, g):
                            return g
        return None

    def describe(self, pin: str) -> str:
        return self.source.get(pin, pin)
