"""Shared test configuration.

* Test kinds live in folders named for what they need, and are marked by folder:
  ``tests/unit`` (no processes), ``tests/process`` (``process``: the shim as a process in front
  of a scripted runtime or none), ``tests/e2e`` (``e2e``: real containerd, registry, crictl),
  ``tests/crio`` (``crio``, marked in its modules; the CRI-O case of a runtime-parametrized
  test in ``tests/e2e`` is marked ``crio`` instead of ``e2e``), ``tests/node`` (``node``: real kubelet,
  systemd), ``tests/cluster`` (``cluster``), ``tests/package`` (``package``: the OCI image and
  the .deb, built and checked), ``tests/soak`` (``soak``).
* When a test fails, the log tails of the fixtures it used (containerd,
  registry, shims: anything with ``log_tail()`` or ``log_tails()``) are
  attached to its report.
* ``cri_call`` fixture: raw generic unary CRI calls (see ``tests/support/cri.py``).
* Temp dirs: every ``tempfile`` call of the test process lands in one short private
  directory (``/tmp/cs-XXXXXXXX``), which must be empty again when the session ends;
  anything left there fails the run, names the leftovers and is removed.  pytest's own
  ``tmp_path`` keeps its usual place and is removed for passing tests
  (``tmp_path_retention_policy = "failed"``).
* ``short_tmp`` fixture: a short directory for unix sockets (``sun_path`` holds 107
  bytes), removed after the test whatever its outcome.
* A hung test fails with a stack: pytest-timeout (``timeout``, ``timeout_method = "signal"``
  in pyproject.toml; ``@pytest.mark.timeout(N)`` for a longer test) fails it with every
  thread's stack (an async test: also every pending asyncio task's; its own task is cancelled)
  and the run goes on. Past that, the run always ends: a test still running
  ``FAULTHANDLER_GRACE_SECONDS`` after its timeout (stuck where no signal handler runs), or a
  run whose exit takes longer than ``EXIT_GRACE_SECONDS`` after the summary (pytest's last
  garbage collection finalizing a gRPC channel a test left open, a non-daemon thread), has
  every thread's stack dumped by faulthandler and the process exits 1 (docs/testing.md).
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import io
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from tests.support import cri

_PROCESS_DIR = Path(__file__).parent / "process"
_E2E_DIR = Path(__file__).parent / "e2e"
_NODE_DIR = Path(__file__).parent / "node"
_CLUSTER_DIR = Path(__file__).parent / "cluster"
_PACKAGE_DIR = Path(__file__).parent / "package"

#: Longest unix socket path (``sun_path`` is 108 bytes with its NUL).
SUN_PATH_MAX = 107

#: How long a test may outlive its pytest-timeout before faulthandler dumps every stack and exits.
FAULTHANDLER_GRACE_SECONDS = 60
#: How long pytest's cleanup and the interpreter's exit may take after the summary.
EXIT_GRACE_SECONDS = 120


_stderr_fd = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # faulthandler writes to a file descriptor: a copy of the terminal's stderr taken now, while
    # pytest's capture is not active (during a test, fd 2 is its capture file, lost on exit).
    config.stash[_stderr_fd] = os.dup(sys.__stderr__.fileno() if sys.__stderr__ else 2)


def _test_timeout(item: pytest.Item) -> float:
    """The item's pytest-timeout: its ``timeout`` mark, else ``--timeout`` / the ini value (0: none)."""
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        value = mark.kwargs.get("timeout", mark.args[0] if mark.args else None)
        if value is not None:
            return float(value)
    try:
        return float(item.config.getoption("timeout", None) or item.config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout is not installed: no ini key "timeout"
        return 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """The backstop behind pytest-timeout's signal: a test it could not interrupt ends the run."""
    timeout = _test_timeout(item)
    if timeout > 0:
        faulthandler.dump_traceback_later(timeout + FAULTHANDLER_GRACE_SECONDS, exit=True,
                                          file=item.config.stash[_stderr_fd])
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After the summary: name the threads that could hold the exit up, and make sure it ends."""
    # executor workers (asyncio's to_thread, concurrent.futures) are told to stop by the exit itself
    waited_for = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
                  and not t.name.startswith(("asyncio_", "ThreadPoolExecutor-"))]
    if waited_for:
        with os.fdopen(os.dup(config.stash[_stderr_fd]), "w") as stderr:
            print(f"conftest: non-daemon threads still running after the run: {', '.join(waited_for)}; the exit "
                  f"is given {EXIT_GRACE_SECONDS} s, then every stack is dumped and the run exits 1", file=stderr)
    faulthandler.dump_traceback_later(EXIT_GRACE_SECONDS, exit=True, file=config.stash[_stderr_fd])


@pytest.fixture(scope="session", autouse=True)
def _temp_dirs_are_cleaned_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Point ``tempfile`` at a private directory for the session and fail if a test leaves anything in it."""
    tmp_path_factory.getbasetemp()  # pytest's tmp_path stays under /tmp/pytest-of-<user>
    base = tempfile.mkdtemp(prefix="cs-")
    previous = tempfile.tempdir
    tempfile.tempdir = base
    try:
        yield
    finally:
        tempfile.tempdir = previous
        left = sorted(os.listdir(base))
        shutil.rmtree(base, ignore_errors=True)
    if left:
        pytest.fail(f"tests left {len(left)} temp entries behind (removed now): {', '.join(left[:20])}",
                    pytrace=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for unix sockets, removed after the test (passed or failed)."""
    path = Path(tempfile.mkdtemp(prefix="t-"))
    assert len(str(path)) + len("/") + 40 <= SUN_PATH_MAX, f"{path}: too long for a 40-byte socket name"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _PROCESS_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.process)
        elif _E2E_DIR in Path(str(item.path)).parents:
            if item.get_closest_marker("crio") is None:  # a runtime-parametrized test's CRI-O case
                item.add_marker(pytest.mark.e2e)
        elif _NODE_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.node)
        elif _CLUSTER_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.cluster)
        elif _PACKAGE_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.package)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and "from pytest-timeout" in str(report.longrepr):
        tasks = _pending_task_stacks(getattr(item, "originalname", item.name))
        if tasks:  # an async test's thread stack ends in the event loop: where its tasks wait
            report.sections.append(("asyncio tasks pending at the timeout", tasks))
    if not report.failed or report.when == "teardown":
        return
    funcargs = getattr(item, "funcargs", {}) or {}
    seen: set[int] = set()
    for name, value in funcargs.items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        try:
            if hasattr(value, "log_tails"):
                tails = value.log_tails()
            elif hasattr(value, "log_tail") and callable(value.log_tail):
                tails = {name: value.log_tail()}
            else:
                continue
        except Exception as exc:  # never break reporting
            tails = {name: f"<could not read log: {exc!r}>"}
        for title, text in tails.items():
            if text:
                report.sections.append((f"log tail: {title}", text))


def _pending_task_stacks(test: str) -> str:
    """The stack of every asyncio task not done (found by the garbage collector: the loop is
    stopped when pytest-timeout's signal failed the test). The test's own task is cancelled:
    its ``finally`` blocks then run (closing its channels, stopping its processes) when the
    loop runs next, in the teardown of its fixtures, instead of it going on in later tests."""
    out = io.StringIO()
    for obj in gc.get_objects():
        if isinstance(obj, asyncio.Task) and not obj.done():
            try:
                obj.print_stack(file=out)
            except Exception as exc:  # a frame without a line number (a generator mid-close): never break reporting
                out.write(f"{obj!r}: <cannot print its stack: {exc!r}>\n")
            if getattr(obj.get_coro(), "__name__", None) == test:
                obj.cancel()
    return out.getvalue()


CriCall = Callable[..., cri.CallResult]


@pytest.fixture
def cri_call() -> CriCall:
    """``cri_call(socket, method, request_bytes, timeout=30, metadata=None) -> CallResult``.

    ``method`` is a short name (``"PullImage"``, ``"Version"``...) or a full
    path (``"/runtime.v1.ImageService/PullImage"``).  The result has
    ``code``, ``details``, ``response`` (bytes or None), ``initial_metadata``,
    ``trailing_metadata``.  Blocking; use ``tests.support.cri.acall`` in
    async code.
    """
    return cri.call
