"""Running h2spec (HTTP/2 conformance) against a unix-socket gRPC server, and reading its JUnit report.

h2spec speaks TCP only, so a ``socat`` bridge forwards a loopback port to the socket (one
unix connection per TCP connection). The binary is ``h2spec-grpc``: h2spec v2.2.1 built by
``scripts/setup.d/60-h2spec.sh`` so that its requests carry gRPC headers (``POST``,
``content-type: application/grpc``, ``te: trailers``); ``--path`` picks the method.

The suite's sections run as several h2spec processes at once (each case waits up to the timeout
``-o`` for the answer it expects, and about 50 cases wait out the full timeout against any gRPC
server), so one run takes about the slowest section group instead of the sum.

The JUnit report is parsed, never stdout. h2spec v2.2.1 writes a failed case as ``<error>``
whose text is the accepted outcomes, one per line, then the actual outcome on the last line.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

#: Section groups run in parallel; together they are the whole suite (h2spec --dryrun lists 145 cases).
#: Balanced by the cases that wait out the timeout (against containerd or the shim): at most ~8 per group.
SECTION_GROUPS: tuple[tuple[str, ...], ...] = (
    ("generic/1", "generic/2", "generic/3.1", "generic/3.2"),
    ("generic/3.3", "generic/3.4", "generic/3.5", "generic/3.7", "generic/3.8", "generic/3.9", "generic/3.10"),
    ("generic/4", *(f"generic/5/{i}" for i in range(1, 5))),
    tuple(f"generic/5/{i}" for i in range(5, 11)),
    tuple(f"generic/5/{i}" for i in range(11, 16)),
    ("hpack",),
    ("http2/3", "http2/4"),
    tuple(f"http2/5.1/{i}" for i in range(1, 8)),
    tuple(f"http2/5.1/{i}" for i in range(8, 14)),
    ("http2/5.1.1", "http2/5.1.2", "http2/5.3", "http2/5.4", "http2/5.5"),
    ("http2/6.1", "http2/6.2", "http2/6.3", "http2/6.4"),
    ("http2/6.5",),
    ("http2/6.7", "http2/6.8", "http2/6.9", "http2/6.10"),
    ("http2/7", "http2/8.1/1", "http2/8.1.2/1", "http2/8.1.2.2", "http2/8.1.2.6", "http2/8.2"),
    ("http2/8.1.2.1", "http2/8.1.2.3/1"),
    tuple(f"http2/8.1.2.3/{i}" for i in range(2, 8)),
)


@dataclass(frozen=True)
class CaseFailure:
    expected: tuple[str, ...]  # any one of these would have passed
    actual: str

    def describe(self) -> str:
        return f"expected {' OR '.join(self.expected) or '?'}; actual {self.actual}"


@dataclass
class H2specReport:
    """Outcome of every case, keyed ``"<section> <description>"`` (e.g. ``"http2/6.9 Sends a ..."``)."""

    passed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    failed: dict[str, CaseFailure] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.skipped) + len(self.failed)

    def summary(self) -> str:
        return f"{self.total} cases, {len(self.passed)} passed, {len(self.skipped)} skipped, {len(self.failed)} failed"

    def merge(self, other: H2specReport) -> None:
        overlap = (self.passed | self.skipped | set(self.failed)) & (other.passed | other.skipped | set(other.failed))
        if overlap:
            raise ValueError(f"h2spec section groups overlap: {sorted(overlap)[:3]}")
        self.passed |= other.passed
        self.skipped |= other.skipped
        self.failed.update(other.failed)


_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def xml_text(raw: bytes) -> str:
    """h2spec writes a frame's payload (a PING's opaque data) raw into its XML report: NULs, other
    control bytes and invalid UTF-8 that no XML parser accepts (a run with both cores busy failed
    on ``opaque_data:\\x00...``). Each such byte is written as a ``\\xNN`` escape instead."""
    text = raw.decode("utf-8", errors="backslashreplace")
    return _XML_INVALID.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def parse_junit(path: str | os.PathLike[str]) -> H2specReport:
    report = H2specReport()
    root = ET.fromstring(xml_text(Path(path).read_bytes()))
    for case in root.iter("testcase"):
        key = f"{case.get('package')} {case.get('classname')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            lines = [line.strip() for line in (bad.text or "").strip().splitlines() if line.strip()]
            if lines and lines[0] == "Expect:":  # h2spec's <failure> layout: Expect:\n...\nActual:\n...
                cut = lines.index("Actual:") if "Actual:" in lines else len(lines)
                report.failed[key] = CaseFailure(tuple(lines[1:cut]), " ".join(lines[cut + 1:]))
            else:
                report.failed[key] = CaseFailure(tuple(lines[:-1]), lines[-1] if lines else "")
        elif case.find("skipped") is not None:
            report.skipped.add(key)
        else:
            report.passed.add(key)
    return report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class SocatBridge:
    """``socat`` from 127.0.0.1:<port> to a unix socket, one forked child per connection.

    Its listen backlog is raised from socat's default of 5: h2spec's parallel section groups open
    a connection per case, and under load the forking listener fell behind, so some connections
    were reset ('connection reset by peer' in a random case, through the shim or directly: about
    10 in 700 runs of three sections with 16 h2spec processes; none in 864 with the larger backlog).
    """

    def __init__(self, socat: str, unix_path: str | os.PathLike[str], log_path: Path) -> None:
        self.socat = socat
        self.unix_path = str(unix_path)
        self.log_path = log_path
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> SocatBridge:
        for _ in range(5):  # the free port can be taken between probe and bind: try another
            self.port = _free_port()
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [self.socat, f"TCP-LISTEN:{self.port},bind=127.0.0.1,reuseaddr,fork,backlog=128",
                     f"UNIX-CONNECT:{self.unix_path}"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            deadline = time.monotonic() + timeout
            while self._proc.poll() is None and time.monotonic() < deadline:
                if _port_open(self.port):
                    return self
                time.sleep(0.02)
            self.stop()
        raise RuntimeError(f"socat did not listen for {self.unix_path}: {self.log_path.read_text(errors='replace')}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 15)  # its session: the listener and forked children
            except ProcessLookupError:
                pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(5)

    def __enter__(self) -> SocatBridge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_h2spec(h2spec: str, socat: str, unix_path: str | os.PathLike[str], request_path: str,
               workdir: Path, *, timeout_s: int = 2,
               groups: Sequence[Sequence[str]] = SECTION_GROUPS) -> H2specReport:
    """Run the whole suite (in parallel section groups) against ``unix_path``; the merged report."""
    workdir.mkdir(parents=True, exist_ok=True)
    with SocatBridge(socat, unix_path, workdir / "socat.log") as bridge:

        def one(i: int) -> H2specReport:
            junit = workdir / f"h2spec-{i}.xml"
            with open(workdir / f"h2spec-{i}.out", "wb") as out:
                # exit status 1 just means "some case failed": the report says which
                subprocess.run([h2spec, "-h", "127.0.0.1", "-p", str(bridge.port), "-P", request_path,
                                "-o", str(timeout_s), "-j", str(junit), *groups[i]],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                               timeout=600, check=False)
            if not junit.exists():
                raise RuntimeError(f"h2spec wrote no report for {groups[i]}: "
                                   f"{(workdir / f'h2spec-{i}.out').read_text(errors='replace')[-2000:]}")
            return parse_junit(junit)

        with ThreadPoolExecutor(len(groups)) as pool:
            parts = list(pool.map(one, range(len(groups))))
    report = H2specReport()
    for part in parts:
        report.merge(part)
    return report
