"""Which registry credentials go with an image: kubelet's credential keyring rules.

An entry's key is what a docker ``config.json`` ``auths`` map is keyed by: a host,
optionally with a port and a path (``registry.example.com:5000/team``), optionally
with a scheme (``https://index.docker.io/v1/``: the scheme goes, and a leading
``/v1/`` or ``/v2/`` path counts as no path). An image matches a key when

* the ports are equal (a key without a port matches only images without one),
* the hosts have the same number of dot-separated parts and each key part matches
  the image's as a glob (``*.example.com`` matches ``a.example.com``, not
  ``a.b.example.com`` or ``example.com``),
* the key's path is a prefix of the image's repository path (string prefix, as kubelet
  has it: ``quay.io/org`` also matches ``quay.io/organization/x``).

Every matching entry's credentials are returned, the most specific key first (keys in
reverse lexical order, so ``quay.io/org/team`` before ``quay.io/org`` before
``quay.io``); the caller tries them in that order. A Docker Hub image with no match
uses the entry for ``index.docker.io`` (``https://index.docker.io/v1/``), if any.
Hosts compare in lower case (the image's via ``shim/reference.py``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable

from .. import reference
from ..proto.runtime.v1 import api_pb2

DEFAULT_REGISTRY_HOST = "index.docker.io"


@dataclass(frozen=True)
class Credential:
    """One set of registry credentials. ``source`` says where it came from (no secret)."""

    source: str
    username: str = field(default="", repr=False)
    password: str = field(default="", repr=False)
    identity_token: str = field(default="", repr=False)
    registry_token: str = field(default="", repr=False)

    def auth_config(self) -> api_pb2.AuthConfig:
        """As kubelet sends it to the runtime (``auth`` decoded into username and password)."""
        return api_pb2.AuthConfig(username=self.username, password=self.password,
                                  identity_token=self.identity_token, registry_token=self.registry_token)


def key_of(location: str) -> str:
    """A config.json ``auths`` key in keyring form: ``host[:port][/path]``, no scheme."""
    s = location.strip()
    for scheme in ("https://", "http://"):
        if s.lower().startswith(scheme):
            s = s[len(scheme):]
            break
    host, slash, path = s.partition("/")
    path = "/" + path if slash else ""
    if path.startswith(("/v1/", "/v2/")):
        path = path[3:]
    if path == "/":
        path = ""
    return host.lower() + path


def _split(location: str) -> tuple[list[str], str, str]:
    """(host parts, port, path) of ``host[:port][/path]``."""
    host, slash, path = location.partition("/")
    path = "/" + path if slash else ""
    port = ""
    if host.startswith("["):  # [ipv6]:port
        end = host.find("]")
        if end != -1:  # brackets off, as Go's net.SplitHostPort does
            host, port = host[1:end], host[end + 2:] if host[end + 1:end + 2] == ":" else ""
    elif host.count(":") == 1:
        host, port = host.split(":")
    return host.split("."), port, path


def matches(key: str, target: str) -> bool:
    """kubelet's URLsMatch for schemeless ``key`` and ``target`` (``host[:port]/path``)."""
    key_parts, key_port, key_path = _split(key)
    parts, port, path = _split(target)
    if key_port != port or len(key_parts) != len(parts):
        return False
    if not path.startswith(key_path):
        return False
    return all(fnmatch.fnmatchcase(t, k) for k, t in zip(key_parts, parts))


def _is_default_registry(repo: str) -> bool:
    first, slash, _ = repo.partition("/")
    if not first:
        return False
    if not slash or first in ("docker.io", DEFAULT_REGISTRY_HOST):
        return True
    return not any(c in first for c in ".:")


class Keyring:
    """Immutable; build a new one when a credential file changes."""

    def __init__(self, entries: Iterable[tuple[str, Credential]] = ()) -> None:
        self._creds: dict[str, list[Credential]] = {}
        for location, cred in entries:
            self._creds.setdefault(key_of(location), []).append(cred)
        self._index = sorted(self._creds, reverse=True)

    def __len__(self) -> int:
        return sum(len(v) for v in self._creds.values())

    def lookup(self, image: str) -> list[Credential]:
        """The credentials to try for ``image``, most specific first; [] for none (pull anonymously)."""
        try:
            ref = reference.parse(image)
        except reference.InvalidReference:
            return []
        target = ref.name
        out: list[Credential] = []
        for key in self._index:
            if matches(key, target):
                out += self._creds[key]
        if not out and _is_default_registry(target):
            out = list(self._creds.get(DEFAULT_REGISTRY_HOST, ()))
        return out
