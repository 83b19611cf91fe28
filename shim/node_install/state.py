"""What ``cri-shim node install`` did to this node, kept so that ``cri-shim node uninstall``
undoes exactly that, and only that, however often it runs.

``/var/lib/cri-shim/install/state.json`` (a ``shim/statefile.py`` document) lists every file
install wrote, each with a copy of what was there before (``backup/``) or none when it added
the file, the directories it made, whether it enabled the unit, and kubelet's switch: its
config file, the copy of its bytes before (restored byte for byte), the keys changed (each
key's value as written before and after, for a file someone edited since), the endpoint flags
set in a flags file (the same: a copy, the value before and after) and whether kubelet came
back Ready on the new settings. It is written before each change it covers,
so a run cut short is finished or undone by the next.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import statefile

INSTALL_DIR = "/var/lib/cri-shim/install"
STATE_FILE = f"{INSTALL_DIR}/state.json"
BACKUP_DIR = f"{INSTALL_DIR}/backup"
WHAT = "cri-shim node install state"
VERSION = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def backup_path(path: str) -> str:
    """Where the copy of ``path`` as it was before install is kept."""
    return f"{BACKUP_DIR}/{path.strip('/').replace('/', '__')}"


@dataclass
class FileRecord:
    path: str
    backup: str | None  #: the copy of the file before install; None: install added it
    sha256: str  #: of the bytes install wrote


@dataclass
class FlagRecord:
    """One of kubelet's flags files (kubelet.FLAG_FILES) install set an endpoint flag in."""

    path: str  #: the flags file
    backup: str  #: its bytes before install
    sha256_before: str
    sha256_after: str
    #: flag -> [its value before, its value as install wrote it (the shim's socket)]
    flags: dict[str, list[str]]
    #: as KubeletRecord.exact: the copy is the file install's edit was made on
    exact: bool = True


@dataclass
class KubeletRecord:
    config: str  #: kubelet's config file
    backup: str  #: its bytes before install
    sha256_before: str
    sha256_after: str
    #: key -> [value as written before (None: absent), value as install wrote it]
    keys: dict[str, list[str | None]]
    confirmed: bool = False  #: kubelet came back Ready on the new settings
    #: the copy is the file install's keys were set in (false once the file changed under install
    #: and install set its keys again): uninstall may put the copy back
    exact: bool = True
    #: kubelet's flags files install set an endpoint flag in (a flag beats the config file)
    flag_files: list[FlagRecord] = field(default_factory=list)

    def flag_file(self, path: str) -> FlagRecord | None:
        return next((f for f in self.flag_files if f.path == path), None)


@dataclass
class State:
    mode: str  #: image-only or full
    listen: str  #: the shim's socket, where kubelet is pointed
    upstream: str  #: the runtime endpoint kubelet used before: the shim's upstream
    files: list[FileRecord] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)  #: directories install made, parents first
    enabled: bool = False  #: install ran `systemctl enable cri-shim.service`
    kubelet: KubeletRecord | None = None

    def file(self, path: str) -> FileRecord | None:
        return next((f for f in self.files if f.path == path), None)

    def to_json(self) -> dict[str, Any]:
        return {"kind": WHAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> State:
        try:
            kubelet = doc.get("kubelet")
            return cls(mode=str(doc["mode"]), listen=str(doc["listen"]), upstream=str(doc["upstream"]),
                       files=[FileRecord(**f) for f in doc.get("files", [])],
                       dirs=[str(d) for d in doc.get("dirs", [])], enabled=bool(doc.get("enabled")),
                       kubelet=_kubelet(kubelet) if isinstance(kubelet, dict) else None)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a {WHAT}: {e}") from None


def _kubelet(doc: dict[str, Any]) -> KubeletRecord:
    flag_files = [FlagRecord(**f) for f in doc.get("flag_files", [])]
    return KubeletRecord(**{**doc, "flag_files": flag_files})


def load(path: str) -> State | None:
    """The state at ``path`` (a path on this machine), None when there is none. ValueError when unreadable."""
    doc = statefile.load(path, WHAT, VERSION)
    return None if doc is None else State.from_json(doc)
