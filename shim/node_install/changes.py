"""Every change ``cri-shim node install``/``uninstall`` makes to the node, in one place: each is
printed as it is made (with a diff for a file that changes), made only without ``--dry-run``,
and remembered so that a failed run can put back every file as it found it.

Paths are the node's (``/etc/...``), under ``root`` (``/`` on a node; a directory in tests).
A file is replaced atomically (a temp file beside it, fsync, rename) and keeps the mode and
owner of the file it replaces.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .host import Done, Host, HostError

Say = Callable[[str], None]
#: the abstract socket name a running install or uninstall holds, so that two never interleave
LOCK = "cri-shim-node-install"


@dataclass(frozen=True)
class _Before:
    path: str
    data: bytes | None  #: None: there was no file
    mode: int
    uid: int
    gid: int


def diff(old: bytes | None, new: bytes | None, path: str) -> list[str]:
    """A unified diff of two versions of a text file, as lines to print."""
    a = (old or b"").decode(errors="replace").splitlines(keepends=True)
    b = (new or b"").decode(errors="replace").splitlines(keepends=True)
    lines = difflib.unified_diff(a, b, f"{path} (now)" if old is not None else "/dev/null",
                                 f"{path} (new)" if new is not None else "/dev/null")
    return [line.rstrip("\r\n") for line in lines]


class Changes:
    def __init__(self, root: Path, host: Host, say: Say, dry_run: bool) -> None:
        self.root = root
        self.host = host
        self.say = say
        self.dry_run = dry_run
        self._before: list[_Before] = []
        self._dirs: list[str] = []  #: directories made, in the order made
        self._lock: socket.socket | None = None

    def at(self, path: str) -> Path:
        """The node's ``path`` under ``root``."""
        return self.root / path.lstrip("/")

    def read(self, path: str) -> bytes | None:
        try:
            return self.at(path).read_bytes()
        except FileNotFoundError:
            return None

    # -- files ---------------------------------------------------------------------

    def write(self, path: str, data: bytes, what: str, *, mode: int = 0o644, show: bool = True,
              bookkeeping: bool = False) -> bool:
        """Put ``data`` at ``path`` (what it is: ``what``) unless it is there already. A file replaced
        keeps its mode and owner; a new one gets ``mode``. ``show``: print the diff; ``bookkeeping``
        (the state file): say so only when it is made. True: it changed."""
        p = self.at(path)
        if p.is_symlink():
            raise HostError(f"{path} is a symbolic link: not replaced; change it by hand")
        old = self.read(path)
        if old == data:
            return False
        verb = "would write" if self.dry_run else "write"
        if old is None or not bookkeeping:
            self.say(f"{verb} {path}: {what}" + ("" if old is not None else f" (new, {len(data)} bytes)"))
        if show and old is not None and not bookkeeping:
            for line in diff(old, data, path):
                self.say("    " + line)
        if self.dry_run:
            return True
        st = p.stat() if old is not None else None
        self._before.append(_Before(path, old, st.st_mode & 0o7777 if st else mode, st.st_uid if st else -1,
                                    st.st_gid if st else -1))
        self.makedirs(os.path.dirname(path))
        _replace(p, data, st.st_mode & 0o7777 if st else mode, st.st_uid if st else -1, st.st_gid if st else -1)
        return True

    def remove(self, path: str, what: str) -> bool:
        p = self.at(path)
        if not p.exists() and not p.is_symlink():
            return False
        self.say(f"{'would remove' if self.dry_run else 'remove'} {path}: {what}")
        if not self.dry_run:
            p.unlink()
        return True

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """Make ``path`` and its missing parents (remembered, for ``put_back``)."""
        missing = []
        d = path
        while d not in ("", "/") and not self.at(d).exists():
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            if not self.dry_run:
                self.at(d).mkdir(mode=mode)
                os.chmod(self.at(d), mode)  # whatever the umask
            self._dirs.append(d)

    @property
    def made_dirs(self) -> list[str]:
        return list(self._dirs)

    def remove_dir(self, path: str, *, recursive: bool = False) -> None:
        """Remove a directory install made: if it is empty (what else is there stays), or with
        everything in it (``recursive``)."""
        p = self.at(path)
        if not p.is_dir():
            return
        verb = "would remove" if self.dry_run else "remove"
        self.say(f"{verb} {path}/" + (" and what is in it" if recursive else ""))
        if self.dry_run:
            return
        try:
            shutil.rmtree(p) if recursive else p.rmdir()
        except OSError as e:
            self.say(f"left {path}: {e.strerror}")

    def put_back(self, path: str | None = None, *, purge: tuple[str, ...] = ()) -> None:
        """The file ``path`` as it was before this run wrote it; without ``path``, every file
        written here, newest first, then the directories made here removed (those in ``purge``
        with what is in them). Raises OSError."""
        first: dict[str, _Before] = {}  # a file written twice is put back as it was before the first
        for b in self._before:
            first.setdefault(b.path, b)
        for b in reversed(list(first.values())):
            if path is not None and b.path != path:
                continue
            if b.data is None:
                self.at(b.path).unlink(missing_ok=True)
                self.say(f"remove {b.path}")
            else:
                _replace(self.at(b.path), b.data, b.mode, b.uid, b.gid)
                self.say(f"put back {b.path}")
            self._before = [x for x in self._before if x.path != b.path]
        if path is not None:
            return
        for d in reversed(self._dirs):
            self.remove_dir(d, recursive=d in purge)
        self._dirs.clear()

    def lock(self) -> None:
        """One install or uninstall at a time on a node: an abstract unix socket name held while
        this runs (no file left behind; gone with the process). HostError when another holds it."""
        if self.dry_run:
            return
        name = LOCK if self.root == Path("/") else f"{LOCK}:{hashlib.sha256(bytes(self.root)).hexdigest()[:16]}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
        except OSError:
            sock.close()
            raise HostError("another `cri-shim node install` or `uninstall` is running on this node") from None
        self._lock = sock

    def unlock(self) -> None:
        sock, self._lock = self._lock, None
        if sock is not None:
            sock.close()

    # -- systemd -------------------------------------------------------------------

    def systemctl(self, *args: str, timeout: float = 120.0) -> None:
        """A systemctl call that changes something: printed, run unless dry-run; HostError if it fails."""
        self.say(f"{'would run' if self.dry_run else 'run'} systemctl {' '.join(args)}")
        if self.dry_run:
            return
        r = self.host.run(["systemctl", *args], timeout)
        if r.rc != 0:
            raise HostError(f"systemctl {' '.join(args)} failed ({r.rc}): {(r.err or r.out).strip()}")

    def query(self, *args: str) -> Done:
        """A systemctl call that changes nothing (show, is-active, is-enabled): run in a dry run too."""
        return self.host.run(["systemctl", *args], 30.0)


def _replace(p: Path, data: bytes, mode: int, uid: int, gid: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if uid >= 0:
            os.chown(tmp, uid, gid)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
