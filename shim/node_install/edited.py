"""A file of kubelet's that ``cri-shim node install`` edits in place (its config file, a flags
file): what install records of its edit, and how ``cri-shim node uninstall`` puts the file back.
Defined once here for every kind of such file; the kind only says how its values are read and
written (``yamledit`` keys, ``flagfile`` flags) and how it is named.

Install keeps a copy of the file's bytes the first time it edits it, and records, per value it
sets, the value before and the value it wrote, and the file's digest before and after its edit.
Uninstall then puts the file back:

* as it was before install already: nothing to do;
* as install left it (or gone), with the copy being the file install's edit was made on: the
  copy, byte for byte;
* else (someone, or ``kubeadm upgrade``, changed it since): only the values that are still what
  install wrote go back, the rest stays as it is, and what stays is said.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, TypeVar

from . import state
from .changes import Changes
from .host import HostError

V = TypeVar("V")


class Edit(Protocol):
    """What install recorded of its edit of one file (state.KubeletRecord, state.FlagRecord)."""

    backup: str  #: the file's bytes before install
    sha256_before: str
    sha256_after: str  #: of the bytes install wrote ("" until it wrote any)
    exact: bool  #: the copy is the file install's edit was made on: uninstall may put the copy back


@dataclass(frozen=True)
class Kind:
    """How uninstall names a kind of edited file in what it says."""

    file: str  #: the file: "kubelet's flags file"
    contents: str  #: what is in it: "kubelet's flags"
    were: str  #: "they were" (or "it was")
    values: str  #: what install sets in it: "flags"


def keep_copy(ch: Changes, path: str, data: bytes) -> str:
    """Keep ``data``, the bytes of ``path`` before install's first edit, for uninstall: where the copy is."""
    backup = state.backup_path(path)
    ch.write(backup, data, f"copy of {path} as it is, for uninstall", mode=0o600, show=False)
    return backup


def record(rec: Edit, values: dict[str, list[V]], now: bytes, new: bytes, sets: Mapping[str, tuple[V, V]]) -> None:
    """Install edits the file from ``now`` to ``new``, setting each name of ``sets`` from its value now
    to the value it writes (``sets[name]``); ``values`` (the record's own: name -> [before, written])
    keeps, per name, the value before install's first edit of it."""
    if state.sha256(now) != (rec.sha256_after or rec.sha256_before):
        # changed since install wrote it (kubeadm upgrade node rewrites it): the copy is no longer
        # the file this edit is made on, so uninstall puts back the values, not the copy
        rec.exact = False
    for name, (current, written) in sets.items():
        if name not in values or current != values[name][1]:
            values[name] = [current, written]  # its value before is the one it has now
        values[name][1] = written
    rec.sha256_after = state.sha256(new)


def put_back(ch: Changes, path: str, rec: Edit, kind: Kind, values_back: Callable[[bytes], bytes]) -> bool:
    """``path`` as it was before install (see the module's doc); ``values_back``: the file's bytes now
    -> its bytes with each value install set that it still has back as before (saying what stays).
    True unless the file is as it was before install: kubelet may run on what install wrote (a file
    changed since is read by kubelet only when it starts), so it is to be restarted."""
    current = ch.read(path)
    digest = state.sha256(current) if current is not None else None
    if digest == rec.sha256_before:
        ch.say(f"{kind.file} {path} is as it was before install")
        return False
    original = ch.read(rec.backup)
    if original is not None and rec.exact and digest in (rec.sha256_after, None):
        return ch.write(path, original, f"{kind.contents}, as {kind.were} before install, byte for byte")
    if current is None:
        raise HostError(f"{path} is gone and so is the copy of it at {rec.backup}: put it back by hand")
    ch.write(path, values_back(current), f"{kind.contents} changed since install: the {kind.values} install "
                                         f"set, back as they were (not byte for byte)")
    return True
