"""Docker ``config.json`` files as kubelet reads them, re-read when they change.

``{"auths": {"<registry>": {"auth": "<base64 user:password>", "username": …,
"password": …, "identitytoken": …}}}``: ``auth``, when it decodes, wins over
``username``/``password`` (as in kubelet). ``credsStore``/``credHelpers`` are not
run (kubelet does not run them either). Every listed file is read and their entries
merged, in list order; a missing file is no credentials. A file that turns bad
(unreadable, not JSON, wrong shape) is logged, naming the file and why, never its
content, and its previous entries stay in force.

``keyring()`` costs one ``stat`` per file when nothing changed, so it is called
before every prefetch: a rotated secret is used by the next pull.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..observability import logs
from .keyring import Credential, Keyring

_log = logs.get("credentials")

Stamp = tuple[int, int, int]


class ConfigFileError(ValueError):
    """A config.json cannot be used; the message names the file and the key, never a secret."""


def _decode_auth(value: str) -> tuple[str, str] | None:
    try:
        user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return (user, password) if sep else None


def parse(text: str, path: str) -> list[tuple[str, Credential]]:
    """The ``auths`` entries of a config.json's text; raises ConfigFileError."""
    try:
        doc = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno})") from None
    if not isinstance(doc, dict):
        raise ConfigFileError(f"{path}: expected a JSON object")
    auths: Any = doc.get("auths", {})
    if not isinstance(auths, dict):
        raise ConfigFileError(f"{path}: auths: expected an object")
    out: list[tuple[str, Credential]] = []
    for location, entry in auths.items():
        if not isinstance(entry, dict):
            raise ConfigFileError(f"{path}: auths[{logs.shown(location)}]: expected an object")
        fields: dict[str, str] = {}
        for name in ("auth", "username", "password", "identitytoken", "registrytoken"):
            v = entry.get(name, "")
            if not isinstance(v, str):
                raise ConfigFileError(f"{path}: auths[{logs.shown(location)}].{name}: expected a string")
            fields[name] = v
        user, password = fields["username"], fields["password"]
        if fields["auth"]:
            decoded = _decode_auth(fields["auth"])
            if decoded is None:
                raise ConfigFileError(f"{path}: auths[{logs.shown(location)}].auth: not base64 of user:password")
            user, password = decoded
        out.append((location, Credential(f"{path} auths[{logs.shown(location)}]", user, password,
                                         fields["identitytoken"], fields["registrytoken"])))
    return out


@dataclass
class _File:
    stamp: Stamp | None  # None: missing
    entries: list[tuple[str, Credential]]
    error: str = ""


class DockerConfigFiles:
    """The configured config.json files and the keyring they make."""

    def __init__(self, paths: tuple[str, ...] = ()) -> None:
        self.paths = tuple(paths)
        self._files: dict[str, _File] = {}
        self._keyring = Keyring()
        self._entries: list[tuple[str, Credential]] = []

    def configure(self, paths: tuple[str, ...]) -> None:
        if tuple(paths) != self.paths:
            self.paths = tuple(paths)
            self._files = {p: f for p, f in self._files.items() if p in self.paths}
            self._rebuild()

    def entries(self) -> list[tuple[str, Credential]]:
        """Every (auths key, credential) in force, files re-read as for :meth:`keyring`."""
        self.keyring()
        return list(self._entries)

    def keyring(self) -> Keyring:
        """The current keyring; files that changed since the last call are re-read."""
        changed = False
        for path in self.paths:
            try:
                st = os.stat(path)
                stamp: Stamp | None = (st.st_mtime_ns, st.st_size, st.st_ino)
            except FileNotFoundError:
                stamp = None
            except OSError as e:
                stamp = None
                self._bad(path, f"{path}: cannot stat: {e.strerror}")
                continue
            old = self._files.get(path)
            if old is not None and old.stamp == stamp:
                continue
            changed = True
            if stamp is None:
                if old is not None and old.entries:
                    logs.log(_log, logging.INFO, "registry credential file gone; its credentials are dropped",
                             file=path)
                self._files[path] = _File(None, [])
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    entries = parse(f.read(), path)
            except (OSError, UnicodeDecodeError) as e:
                self._bad(path, f"{path}: cannot read: {getattr(e, 'strerror', None) or type(e).__name__}", stamp)
                continue
            except ConfigFileError as e:
                self._bad(path, str(e), stamp)
                continue
            self._files[path] = _File(stamp, entries)
            logs.log(_log, logging.INFO, "registry credentials read", file=path, registries=len(entries))
        if changed:
            self._rebuild()
        return self._keyring

    def _bad(self, path: str, error: str, stamp: Stamp | None = None) -> None:
        old = self._files.get(path)
        if old is None or old.error != error:
            logs.log(_log, logging.WARNING, "registry credential file rejected; its previous content stays in force",
                     error=error)
        self._files[path] = _File(stamp, old.entries if old is not None else [], error)

    def _rebuild(self) -> None:
        self._entries = [e for p in self.paths if p in self._files for e in self._files[p].entries]
        self._keyring = Keyring(self._entries)

    def status(self) -> dict[str, Any]:
        """Per file: registries it has credentials for (keys only) and any error."""
        out: dict[str, Any] = {}
        for p in self.paths:
            f = self._files.get(p)
            if f is None:
                out[p] = {"state": "not read yet"}
            elif f.stamp is None and not f.error:
                out[p] = {"state": "missing"}
            else:
                row: dict[str, Any] = {"registries": sorted({loc for loc, _ in f.entries})}
                if f.error:
                    row["error"] = f.error
                out[p] = row
        return out
