"""kubelet's endpoint flags where kubeadm and the packages keep them: a ``VAR="--flag=value ..."``
line of a systemd environment file (``EnvironmentFile=`` of kubelet.service) whose ``$VAR``
kubelet's ``ExecStart=`` passes on, split at whitespace.

``locate`` finds the one place a flag on kubelet's command line comes from, and refuses (naming
the places) when that is not one value in one assignment of one of ``kubelet.FLAG_FILES``:
the unit's ``ExecStart=`` itself, an ``Environment=`` of a drop-in, several places, a value with
escapes, ``$`` or backquotes (expansion) that this does not parse. ``replace`` changes that value
and no other byte of the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .kubelet import FLAG_FILES, UNIT, Refused, parse_flags

_ASSIGNMENT = re.compile(r"[ \t]*([A-Za-z_][A-Za-z0-9_]*)[ \t]*=[ \t]*")
_VAR = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)|\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: characters a value written into a flags file may have: nothing a quote, a space or expansion changes
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_./:@%+,=-]+")
_UNPARSED = ("\\", "$", "`")


@dataclass(frozen=True)
class Assignment:
    """``NAME=value`` on one line of an environment file."""

    name: str
    value: str | None  #: as systemd reads it; None: escapes, expansion or quoting this does not parse
    start: int  #: offset in the file's text of the value's first character (inside its quotes)


@dataclass(frozen=True)
class Place:
    """One value of ``flag`` in a flags file: ``text[start:end]`` of the file is ``value``."""

    path: str
    var: str
    flag: str
    value: str
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.path} ({self.var})"


def decode(data: bytes) -> str:
    """The file's text; ``encode`` gives its bytes back, whatever they are."""
    return data.decode("utf-8", "surrogateescape")


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def assignments(text: str) -> list[Assignment]:
    """The assignments of an environment file, in order (comments, blank lines and lines that are
    not an assignment left out; a later one of a name wins, as in systemd)."""
    out = []
    pos = 0
    for line in text.splitlines(keepends=True):
        at, pos = pos, pos + len(line)
        body = line.rstrip("\r\n")
        stripped = body.lstrip()
        if not stripped or stripped[0] in "#;":
            continue
        m = _ASSIGNMENT.match(body)
        if m is None:
            continue
        out.append(Assignment(m.group(1), *_value(body, m.end(), at)))
    return out


def _value(body: str, i: int, at: int) -> tuple[str | None, int]:
    rest = body[i:]
    if rest.endswith("\\"):
        return None, at + i  # continued on the next line
    if rest[:1] in ("'", '"'):
        end = rest.find(rest[0], 1)
        if end < 0 or rest[end + 1:].strip():
            return None, at + i + 1
        value = rest[1:end]
        start = at + i + 1
    else:
        value = rest.rstrip()
        start = at + i
        if "'" in value or '"' in value:
            return None, start
    if any(c in value for c in _UNPARSED):
        return None, start
    return value, start


def places(path: str, text: str, names: Sequence[str], flag: str) -> tuple[list[Place], list[str]]:
    """The values of ``flag`` in the assignments of ``names`` (the last assignment of each) in
    ``text``, and the names among them whose value could not be parsed but mentions ``flag``."""
    last: dict[str, Assignment] = {}
    for a in assignments(text):
        last[a.name] = a
    found: list[Place] = []
    unparsed: list[str] = []
    for name in names:
        got = last.get(name)
        if got is None:
            continue
        if got.value is None:
            line_end = text.find("\n", got.start)
            if flag in text[got.start:line_end if line_end >= 0 else len(text)]:
                unparsed.append(name)
            continue
        found += [Place(path, name, flag, v, got.start + s, got.start + e)
                  for v, s, e in _flag_values(got.value, flag)]
    return found, unparsed


def _flag_values(value: str, flag: str) -> list[tuple[str, int, int]]:
    """(value, start, end) of each ``--flag=value`` / ``--flag value`` among whitespace-split words."""
    words = [(m.group(), m.start(), m.end()) for m in re.finditer(r"\S+", value)]
    out = []
    for i, (word, s, e) in enumerate(words):
        if word.startswith(flag + "="):
            out.append((word[len(flag) + 1:], s + len(flag) + 1, e))
        elif word == flag and i + 1 < len(words):
            out.append(words[i + 1])
    return out


def count(argv: Sequence[str], flag: str) -> int:
    return sum(1 for a in argv[1:] if a == flag or a.startswith(flag + "="))


def exec_words(show: str) -> list[str]:
    """The words of ``ExecStart=`` as configured (``$VAR`` not expanded), from
    ``systemctl show -p ExecStart --value``: ``{ path=... ; argv[]=WORDS ; ... }``."""
    m = re.search(r"argv\[\]=(.*?) ; ", show)
    return m.group(1).split() if m else []


def env_files(show: str) -> list[str]:
    """The ``EnvironmentFile=`` files, in order, from ``systemctl show -p EnvironmentFiles --value``
    (one ``PATH (ignore_errors=yes|no)`` a line)."""
    return [re.sub(r" \(ignore_errors=\w+\)$", "", line.strip()) for line in show.splitlines() if line.strip()]


def locate(root: Path, flag: str, argv: Sequence[str], exec_start: Sequence[str], files: Sequence[str],
           ours: str | None = None) -> Place:
    """The one place ``flag`` on kubelet's command line ``argv`` comes from, which install can
    edit; Refused, naming what it found, otherwise. ``exec_start``: the unit's ExecStart= words;
    ``files``: its EnvironmentFile= files in order (the last one setting a name wins); ``ours``:
    the value an earlier install wrote there (the file may have it while kubelet, not restarted
    since a run cut short, still runs with the value before)."""
    on_line = count(argv, flag)
    split_vars = [m.group(1) for w in exec_start if (m := _VAR.fullmatch(w)) and m.group(1)]
    joined_vars = [m.group(1) or m.group(2) for w in exec_start for m in _VAR.finditer(w)
                   if not _VAR.fullmatch(w) or m.group(2)]
    where: list[str] = []
    if any(flag in w for w in exec_start):
        where.append(f"{UNIT}'s ExecStart=")
    last: dict[str, str] = {}  # name -> the file that sets it last
    texts: dict[str, str] = {}
    for f in files:
        try:
            texts[f] = decode((root / f.lstrip("/")).read_bytes())
        except OSError:
            continue
        for a in assignments(texts[f]):
            last[a.name] = f
    found: list[Place] = []
    for f, text in texts.items():
        names = [n for n in split_vars if last.get(n) == f]
        got, unparsed = places(f, text, names, flag)
        found += got
        where += [f"{p} (not one of the flags files install edits: {', '.join(FLAG_FILES)})"
                  for p in got if f not in FLAG_FILES]
        where += [f"{f} ({n}: escapes, $ or quotes install does not parse)" for n in unparsed]
        joined, _ = places(f, text, [n for n in joined_vars if last.get(n) == f], flag)
        where += [f"{p} (passed as one argument, not split)" for p in joined]
    where += [str(p) for p in found if p.path in FLAG_FILES]
    value = parse_flags(argv).get(flag, "")  # an endpoint flag is one of kubelet.VALUE_FLAGS
    shown = f"kubelet runs with {flag}={value}"
    if not where:
        raise Refused(f"{shown}, and it is not in a flags file install can edit ({', '.join(files) or 'none'} "
                      f"for {UNIT}'s ExecStart= {' '.join(exec_start) or '(unknown)'}): it comes from an "
                      f"Environment= of {UNIT} or a drop-in (`systemctl cat {UNIT}`). Set it there to the "
                      f"shim's socket by hand, or move it into a flags file, restart kubelet and run install again")
    if len(where) > 1 or on_line != 1:
        raise Refused(f"{shown}, set in {len(where)} places: {'; '.join(where)} (kubelet's command line has it "
                      f"{on_line} time(s)): install edits one place only. Leave it in one flags file, restart "
                      f"kubelet and run install again")
    if len(found) != 1 or found[0].path not in FLAG_FILES:
        raise Refused(f"{shown}, set in {where[0]}: install does not edit that. Move it into a flags file "
                      f"({', '.join(FLAG_FILES)}) or kubelet's config file, restart kubelet and run install again")
    place = found[0]
    if place.value != value and place.value != ours:
        raise Refused(f"{shown}, but {place} says {flag}={place.value}: the file changed since kubelet started. "
                      f"Restart kubelet (or put the file back) and run install again")
    return place


def writable(value: str) -> bool:
    """Whether ``value`` reads the same in any quoting of a flags file (no quote, space, $ or escape)."""
    return _SAFE_VALUE.fullmatch(value) is not None


def replace(text: str, edits: Sequence[tuple[Place, str]]) -> str:
    """``text`` with each place's value set to the value given (only those characters changed)."""
    for place, value in sorted(edits, key=lambda e: e[0].start, reverse=True):
        assert text[place.start:place.end] == place.value, place
        text = text[:place.start] + value + text[place.end:]
    return text


def every_place(path: str, text: str, flag: str) -> list[Place]:
    """The values of ``flag`` in every name's (last) assignment in ``text``."""
    return places(path, text, sorted({a.name for a in assignments(text)}), flag)[0]
