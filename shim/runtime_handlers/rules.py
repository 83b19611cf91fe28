"""``runtime_handlers.rules``: which handler an image request gets from the config.

A rule matches when all its matchers do: namespaces, image patterns (the grammar of
shim/image_patterns.py, matched against the request's normalized names), pod labels and
pod annotations (the pod's value first, then ImageSpec's). A rule with a namespace or
label matcher needs a pod: it never matches ImageStatus, RemoveImage or a prefetch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from .. import reference
from ..config import ConfigError, HandlerRule
from ..image_patterns import globs_regex, is_glob, normalize_pattern
from ..observability.logs import shown


@dataclass(frozen=True, slots=True)
class Rule:
    index: int
    handler: str
    namespaces: frozenset[str]
    exact_images: frozenset[str]
    image_globs: re.Pattern[str] | None  # every glob of the rule at once
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]

    @property
    def needs_pod(self) -> bool:
        """Matches on something only a pod has (namespace, labels)."""
        return bool(self.namespaces or self.labels)

    @property
    def source(self) -> str:
        return f"runtime_handlers.rules[{self.index}]"

    def matches(self, names: list[str], namespace: str | None, labels: Mapping[str, str] | None,
                annotations: Iterable[Mapping[str, str]]) -> bool:
        if self.needs_pod and namespace is None:
            return False
        if self.namespaces and namespace not in self.namespaces:
            return False
        if self.exact_images or self.image_globs is not None:
            globs = self.image_globs
            if not any(n in self.exact_images or (globs is not None and globs.match(n) is not None) for n in names):
                return False
        if labels is None and self.labels:
            return False
        for k, v in self.labels:
            if labels is None or labels.get(k) != v:
                return False
        for k, v in self.annotations:
            if _first(annotations, k) != v:
                return False
        return True


def _first(maps: Iterable[Mapping[str, str]], key: str) -> str | None:
    """The value of ``key`` in the first map that has it."""
    for m in maps:
        if key in m:
            return m[key]
    return None


def compile_rules(rules: Iterable[HandlerRule]) -> tuple[Rule, ...]:
    """Normalize image patterns the way pins do. Raises ConfigError naming the bad pattern."""
    out = []
    for i, r in enumerate(rules):
        exact: set[str] = set()
        globs: list[str] = []
        for j, p in enumerate(r.images):
            try:
                canon = normalize_pattern(p)
            except ValueError as e:
                raise ConfigError(f"runtime_handlers.rules[{i}].images[{j}]", f"{e} (got {shown(p)})") from None
            if is_glob(canon):
                globs.append(canon)
            else:
                exact.add(canon)
        out.append(Rule(i, r.handler, frozenset(r.namespaces), frozenset(exact), globs_regex(globs, "g"),
                        r.pod_labels, r.pod_annotations))
    return tuple(out)


def reference_names(image: str) -> list[str]:
    """The normalized names a rule's image patterns are matched against.

    ``nginx`` -> ``docker.io/library/nginx:latest``; ``repo:tag@digest`` also as
    ``repo@digest`` and ``repo:tag``; an image ID as ``sha256:<hex>``. An unparseable
    string is matched as it is.
    """
    if reference.is_image_id(image):
        return [reference.normalize(image)]
    try:
        ref = reference.parse(image)
    except reference.InvalidReference:
        return [image]
    names = [str(ref.with_default_tag())]
    if ref.digest is not None:
        names.append(f"{ref.name}@{ref.digest}")
        if ref.tag is not None:
            names.append(f"{ref.name}:{ref.tag}")
    return names

