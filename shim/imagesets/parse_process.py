"""Image-set files parsed in a child process: re-reading a large file never holds the shim's GIL.

Parsing a 10,000-image file is 100-500 ms of CPU, much of it in libyaml's C composer, which
holds the GIL for a whole document: in a thread of the shim it stalls the event loop (and
with it every relayed call) for tens of milliseconds at a time. So ``SetDirectory`` hands
the text (read by the shim, within ``image_sets.max_file_bytes``) to a child process,
``python -c`` running ``serve`` below, started with subprocess (fork then exec, nothing run
in between) and talking on its stdin and stdout: ``(source, text)`` in (or, for an object of
the API server, ``(source, where, document)``: shim/cluster/parses.py), the sets as plain
tuples or the ``SetFileError`` message out, each a marshal blob with a 4-byte length.

The child imports only the loader (about 21 MiB RSS), runs ``NICE`` levels below the shim (on a
busy node the CPU goes to the event loop first, so relayed calls do not queue behind a parse),
keeps the normalized names of the last file it parsed (an edit of it normalizes only the names
it adds), and exits after ``IDLE_SECONDS`` without a request (it is started again for the next
changed file). A thread of the shim waits for each child (one, while it lives) and reaps it as it
exits, closing its pipes: an idle exit (or any other) leaves no zombie and no open pipe behind.
If it cannot be started, files are parsed in the calling thread, as without it. If it dies
while parsing (libyaml's crash on hostile input, the OOM killer), the text is tried once more
in a new child; a second death refuses the file with the reason (its previous content stays
in force, see loader.py).
"""

from __future__ import annotations

import logging
import marshal
import os
import select
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from ..observability import logs
from .loader import EMPTY, ImageSet, SetFileError, known_names, parse_document, parse_here, parse_text

_log = logs.get("imagesets")
IDLE_SECONDS = 30.0  # the child exits after this long without a request
NICE = 10  # the child's niceness above the shim's: on a busy node the event loop (kubelet's calls) runs first
_LEN = struct.Struct(">I")
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the shim package
_CHILD = f"import sys; sys.path.insert(0, {_ROOT!r}); from shim.imagesets.parse_process import serve; serve()"


class ChildDied(Exception):
    """The child exited or closed its pipe before answering."""


def _send(out: IO[bytes], blob: bytes) -> None:
    out.write(_LEN.pack(len(blob)) + blob)
    out.flush()


def _recv(inp: IO[bytes]) -> bytes | None:
    """One message; None at a clean end of input. Raises ChildDied when cut short."""
    head = inp.read(_LEN.size)
    if not head:
        return None
    if len(head) < _LEN.size:
        raise ChildDied("cut short")
    (n,) = _LEN.unpack(head)
    body = inp.read(n)
    if len(body) < n:
        raise ChildDied("cut short")
    return body


def _as_tuple(s: ImageSet) -> tuple[object, ...]:
    return (s.name, s.kind, s.pin, s.refs, s.spelled, s.generation, s.source, s.ignored, s.handlers)


def serve(idle_seconds: float = IDLE_SECONDS) -> None:
    """The child: answer requests until stdin closes or stays idle for ``idle_seconds``."""
    try:
        os.nice(NICE)
    except OSError:  # best effort: a sandbox may refuse it
        pass
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the answers
    inp = sys.stdin.buffer
    last_source, known = "", EMPTY
    while True:
        ready, _, _ = select.select([inp], [], [], idle_seconds)
        if not ready:
            return
        req = _recv(inp)
        if req is None:
            return
        msg = marshal.loads(req)
        source = msg[0]
        try:
            names = known if source == last_source else EMPTY
            if len(msg) == 3:  # (source, where, document): one API object's document (parse_document)
                sets = [parse_document(msg[2], msg[1], source, names)]
            else:  # (source, text): a file
                sets = parse_text(msg[1], source, names)
        except SetFileError as e:
            _send(out, marshal.dumps((False, str(e))))
            continue
        _send(out, marshal.dumps((True, [_as_tuple(s) for s in sets])))
        last_source, known = source, known_names(sets)


def _died(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}" if code is not None else "closed its pipe"


class ParseProcess:
    """The parsing child, started on first use; ``parse`` is blocking (call it from a thread)."""

    def __init__(self, *, command: Sequence[str] | None = None) -> None:
        self._command = list(command) if command is not None else [sys.executable, "-c", _CHILD]
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.started = 0  # children started so far
        self.start_error = ""  # why the last start failed ("" when it did not): files are parsed in-thread

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def parse(self, text: str, source: str, previous: Sequence[ImageSet] = ()) -> list[ImageSet]:
        """The sets of ``text`` as ``loader.parse_text`` gives them; raises SetFileError.
        ``previous`` (the file's sets in force) serves the in-thread fallback; the child keeps
        the names of the last file it parsed itself."""
        return self._ask(marshal.dumps((source, text)), source, lambda: parse_here(text, source, previous))

    def parse_document(self, doc: dict[str, Any], where: str, source: str,
                       previous: Sequence[ImageSet] = ()) -> ImageSet:
        """One API object's document (plain JSON values) as ``loader.parse_document`` gives it;
        raises SetFileError. As ``parse``: the child keeps the names of the last source it read."""
        def here() -> list[ImageSet]:
            return [parse_document(doc, where, source, known_names(previous))]
        return self._ask(marshal.dumps((source, where, doc)), source, here)[0]

    def _ask(self, request: bytes, source: str, here: Callable[[], list[ImageSet]]) -> list[ImageSet]:
        with self._lock:
            for attempt in (1, 2):
                proc = self._running()
                if proc is None:
                    return here()
                try:
                    assert proc.stdin is not None and proc.stdout is not None
                    _send(proc.stdin, request)
                    answer = _recv(proc.stdout)
                    if answer is None:
                        raise ChildDied("no answer")
                except (OSError, ChildDied):
                    code = self._reap()
                    if attempt == 1 or code == 0:  # 0: it went idle as the request came; else once more
                        continue
                    raise SetFileError(f"{source}: the YAML parser process {_died(code)} while reading this "
                                       "file, twice") from None
                ok, body = marshal.loads(answer)
                if not ok:
                    raise SetFileError(body)
                return [ImageSet(*t) for t in body]
        raise SetFileError(f"{source}: the YAML parser process exits at once")  # idle exits twice in a row

    def _running(self) -> subprocess.Popen[bytes] | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._reap()
        try:
            self._proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          close_fds=True)
        except OSError as e:
            error = f"cannot start the YAML parser process: {e.strerror or e}"
            if error != self.start_error:
                logs.log(_log, logging.WARNING, "image-set files are parsed in the shim's threads (relayed calls "
                         "may wait while a large file is read)", error=error)
            self.start_error = error
            return None
        self.start_error = ""
        self.started += 1
        try:
            threading.Thread(target=self._reap_when_it_exits, args=(self._proc,), name="yaml-parser-reaper",
                             daemon=True).start()
        except RuntimeError:  # no thread to spare: reaped at its next use or at close, as a dead child is
            pass
        return self._proc

    def _reap_when_it_exits(self, proc: subprocess.Popen[bytes]) -> None:
        """(The child's own thread.) Wait for it to exit (idle, killed, crashed), which reaps it; then
        close its pipes, unless a parse or ``close`` has already (or a new child has taken its place)."""
        proc.wait()
        with self._lock:
            if self._proc is proc:
                self._reap()

    def _reap(self) -> int | None:
        """Close the pipes of the child (killed if still running); its exit status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        if proc.poll() is None:
            try:
                return proc.wait(timeout=2)  # stdin closed: it ends by itself
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()

    def close(self) -> None:
        with self._lock:
            self._reap()
