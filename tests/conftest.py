"""Shared test configuration.

* Test kinds live in folders named for what they need, and are marked by folder:
  ``tests/unit`` (no processes), ``tests/process`` (``process``: the shim as a process in front
  of a scripted runtime or none), ``tests/e2e`` (``e2e``: real containerd, registry, crictl),
  ``tests/crio`` (``crio``, marked in its modules; the CRI-O case of a runtime-parametrized
  test in ``tests/e2e`` is marked ``crio`` instead of ``e2e``), ``tests/node`` (``node``: real kubelet,
  systemd), ``tests/cluster`` (``cluster``), ``tests/soak`` (``soak``).
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
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from tests.support import cri

_PROCESS_DIR = Path(__file__).parent / "process"
_E2E_DIR = Path(__file__).parent / "e2e"
_NODE_DIR = Path(__file__).parent / "node"
_CLUSTER_DIR = Path(__file__).parent / "cluster"

#: Longest unix socket path (``sun_path`` is 108 bytes with its NUL).
SUN_PATH_MAX = 107


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
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
