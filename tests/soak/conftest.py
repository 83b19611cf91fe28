"""The soak's figures (calls done, RSS and fds before/after) in the terminal summary, so a
plain ``pytest -ra`` run (scripts/test.sh, CI) shows them too, not only ``-s``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_LINES = pytest.StashKey[list[str]]()


@pytest.fixture
def soak_report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    lines = request.config.stash.setdefault(_LINES, [])

    def report(text: str) -> None:
        print(text)
        lines.extend(text.strip("\n").splitlines())

    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(_LINES, [])
    if lines:
        terminalreporter.section("soak report")
        for line in lines:
            terminalreporter.write_line(line)
