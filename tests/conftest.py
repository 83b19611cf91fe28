"""Shared test configuration.

* Tests under ``tests/e2e`` are marked ``e2e`` automatically, those under ``tests/node`` ``node``.
* When a test fails, the log tails of the fixtures it used (containerd,
  registry, shims: anything with ``log_tail()`` or ``log_tails()``) are
  attached to its report.
* ``cri_call`` fixture: raw generic unary CRI calls (see ``tests/support/cri.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from pathlib import Path

import pytest

from tests.support import cri

_E2E_DIR = Path(__file__).parent / "e2e"
_NODE_DIR = Path(__file__).parent / "node"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _E2E_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)
        elif _NODE_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.node)


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
