"""scripts/check_imports.py: a cycle closed under TYPE_CHECKING or inside a function fails the
lint, and so does a private name imported from another package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "check_imports", Path(__file__).resolve().parents[2] / "scripts" / "check_imports.py")
assert _SPEC is not None and _SPEC.loader is not None
check_imports = importlib.util.module_from_spec(_SPEC)
sys.modules["check_imports"] = check_imports
_SPEC.loader.exec_module(check_imports)


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"shim/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def run(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = check_imports.main(["--root", str(root)])
    return rc, capsys.readouterr().out


def test_clean_tree_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path, {"shim/low/__init__.py": "", "shim/low/grammar.py": "def _helper() -> None: ...\n",
                           "shim/high/__init__.py": "", "shim/high/user.py": "from ..low.grammar import *\n",
                           "shim/low/inner.py": "from .grammar import _helper\n"})
    rc, out = run(root, capsys)
    assert rc == 0, out
    assert "no import cycle" in out


@pytest.mark.parametrize("closing", [
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import one\n",
    "def later() -> None:\n    from ..a import one\n",
])
def test_a_cycle_fails_even_when_it_never_runs_at_load(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       closing: str) -> None:
    root = tree(tmp_path, {"shim/a/__init__.py": "", "shim/a/one.py": "from ..b import two\n",
                           "shim/b/__init__.py": "", "shim/b/two.py": closing})
    rc, out = run(root, capsys)
    assert rc == 1
    assert "shim.a.one" in out and "shim.b.two" in out and "cycle" in out


def test_a_private_name_from_another_package_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path, {"shim/a/__init__.py": "", "shim/a/one.py": "_secret = 1\n",
                           "shim/a/_hidden.py": "x = 1\n",
                           "shim/b/__init__.py": "",
                           "shim/b/two.py": "from ..a.one import _secret\nfrom ..a import _hidden\n"})
    rc, out = run(root, capsys)
    assert rc == 1
    assert "shim/b/two.py:1: shim.a.one._secret" in out
    assert "shim/b/two.py:2: shim.a._hidden" in out


def test_a_test_reading_another_modules_private_attribute_fails(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path, {"tests/test_a.py": "from shim.a import thing\nassert thing._cache == {}\n",
                           "tests/test_b.py": ("class Own:\n    def __init__(self):\n        self._x = 1\n\n"
                                               "def test(o: Own) -> None:\n    assert o._x == 1\n")})
    rc, out = run(root, capsys)
    assert rc == 1
    assert "tests/test_a.py:2: ._cache" in out and "test_b.py" not in out  # its own class's private is its own
