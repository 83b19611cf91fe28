"""Pins: which images a set of image patterns protects.

The patterns (``pins.images``, and the images of image sets that pin) follow the grammar
of shim/image_patterns.py. An image matches when any of its names (ID, repo tags, repo
digests) matches a pattern. Exact patterns are a set lookup; globs are one combined regex;
each runtime name's answer is cached per PinSet, so marking a ListImages of 20,000 images
stays cheap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, cast

from .. import reference
from ..image_patterns import globs_regex, is_glob, normalize_pattern
from ..reference import InvalidReference

# Names that ``reference.normalize`` returns unchanged (or rejects): a first component
# normalization keeps as the host (lower case, not index.docker.io; docker.io only with a path
# that needs no library/), and a tag or digest in the last component. Runtimes report
# names in this form, so most names skip the full parse.
_ALREADY_NORMAL = re.compile(
    r"(?!index\.docker\.io/)"
    r"(?:docker\.io/(?=[^/]*/)|(?!docker\.io/)(?:[^/A-Z]*[.:][^/A-Z]*|localhost)/)"
    r"(?:.*/)?[^/]*[:@][^/]*",
    re.DOTALL,
)


def _normal(n: str) -> str:
    if _ALREADY_NORMAL.fullmatch(n):
        return n
    try:
        return reference.normalize(n)
    except InvalidReference:
        return n


def image_names(image_id: str, repo_tags: Iterable[str], repo_digests: Iterable[str]) -> list[str]:
    """Every normalized name an image is known by (unparseable names kept as they are)."""
    names = [_normal(n) for n in repo_tags]
    names += [_normal(n) for n in repo_digests]
    if image_id:
        names.append(reference.normalize_image_id(image_id) or image_id)  # CRI-O: bare hex
    return names


_MISSING = object()
_NAME_CACHE_SIZE = 1 << 17


@dataclass(frozen=True)
class PinSet:
    """Immutable; build a new one on reload. ``source`` maps canonical pattern -> where it came from
    (pins.images); ``declared``: the image sets' pins, normalized ref -> set name, a snapshot the
    image-set reconciler keeps up to date by the change (shim/imagesets/declared_pins.py), used as
    it is: a PinSet for 100,000 declared pins costs no pass over them."""

    exact: frozenset[str]
    globs: tuple[str, ...]
    source: dict[str, str]
    _regex: re.Pattern[str] | None  # every glob at once
    declared: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    # runtime name -> the pin it matches, or None. A node's image names change slowly, so
    # repeated ListImages calls mostly hit; the cache lives and dies with this PinSet.
    _by_name: dict[str, str | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, patterns: Iterable[str],
              declared: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> PinSet:
        """``patterns`` from config (pins.images); ``declared``: the image sets' pins, either a
        Mapping of normalized ref -> set name (kept as it is, not copied or normalized again) or
        (image ref, set name) pairs (normalized here; an invalid ref is skipped, the loader reports it)."""
        exact: set[str] = set()
        globs: list[str] = []
        source: dict[str, str] = {}
        for p in patterns:
            canon = normalize_pattern(p)
            if is_glob(canon):
                globs.append(canon)
            else:
                exact.add(canon)
            source.setdefault(canon, f"pins.images entry {p!r}")
        if not isinstance(declared, Mapping):
            normalized: dict[str, str] = {}
            for ref, set_name in declared:
                try:
                    normalized.setdefault(normalize_pattern(ref), set_name)
                except ValueError:
                    continue
            declared = normalized
        regex = globs_regex(globs, "pin")  # the outer group that matched names the glob: pin<i>
        return cls(frozenset(exact), tuple(globs), source, regex, declared)

    def __bool__(self) -> bool:
        return bool(self.exact or self.globs or self.declared)

    def _exact(self, name: str) -> bool:
        return name in self.exact or name in self.declared

    def match(self, names: Iterable[str]) -> str | None:
        """The pin (canonical pattern) protecting an image known by ``names``, or None."""
        for n in names:
            if self._exact(n):
                return n
        if self._regex is not None:
            for n in names:
                m = self._regex.match(n)
                if m is not None and m.lastgroup is not None:  # the outer group that matched: pin<i>
                    return self.globs[int(m.lastgroup[3:])]
        return None

    def _match_name(self, name: str) -> str | None:
        pin = self._by_name.get(name, _MISSING)
        if pin is _MISSING:
            n = _normal(name)
            pin = n if self._exact(n) else None
            if (pin is None and self._regex is not None and (m := self._regex.match(n)) is not None
                    and m.lastgroup is not None):
                pin = self.globs[int(m.lastgroup[3:])]
            if len(self._by_name) >= _NAME_CACHE_SIZE:
                self._by_name.clear()
            self._by_name[name] = pin
        return cast("str | None", pin)  # not _MISSING: a miss was replaced above

    def match_image(self, image_id: str, repo_tags: Iterable[str], repo_digests: Iterable[str]) -> str | None:
        """The pin protecting an image as a runtime reports it (ID, repo tags, repo digests), or None.

        Same answer as ``match(image_names(...))``, with each name looked at once per PinSet.
        """
        if image_id:
            canon_id = reference.normalize_image_id(image_id) or image_id  # CRI-O reports bare hex
            if self._exact(canon_id):
                return canon_id
        for n in repo_tags:
            if (pin := self._match_name(n)) is not None:
                return pin
        for n in repo_digests:
            if (pin := self._match_name(n)) is not None:
                return pin
        return None

    def describe(self, pin: str) -> str:
        """Where ``pin`` comes from: the pins.images entry first, else the image set (names are
        253 characters at most, the loader checks)."""
        if pin in self.source:
            return self.source[pin]
        set_name = self.declared.get(pin)
        return f"image set {set_name!r}" if set_name is not None else pin
