"""Image-set files parsed in a child process (shim/imagesets/parse_process.py), so that a large
file's YAML never holds the shim's GIL: the same sets and the same refusals as parsing in the
shim, a child that dies or goes idle is replaced, and one that cannot start leaves parsing
in the shim's thread. What a user would notice: an edited file applies as before, a bad one
keeps its last valid version and says why, and a crash of the parser is a reason, not an outage.
(The latency it buys is measured by bench/node_scale.py, not here.)"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from shim.imagesets.loader import SetDirectory, SetFileError, parse_text
from shim.imagesets.parse_process import NICE, ParseProcess
from tests.unit.test_yaml_bounds import alias_bomb, own_set


@pytest.fixture
def parser() -> Iterator[ParseProcess]:
    p = ParseProcess()
    try:
        yield p
    finally:
        p.close()


def many(name: str, n: int, swap: int = 0) -> str:
    names = [f"registry.example/app{i}:1" for i in range(n)]
    names[swap], names[-1 - swap] = names[-1 - swap], names[swap]
    return own_set(name, *names)


def test_the_child_gives_the_sets_and_refusals_parsing_in_the_shim_gives(parser: ParseProcess) -> None:
    texts = {
        "big.yaml": many("big", 2000),
        "two.yaml": own_set("a", "nginx:1") + "---\n" + own_set("b", "busybox@sha256:" + "a" * 64),
        "mco.yaml": ("apiVersion: machineconfiguration.openshift.io/v1\nkind: PinnedImageSet\n"
                     "metadata: {name: p, annotations: {cri-shim.io/runtime-handler: kata}}\n"
                     "spec: {pinnedImages: [{name: quay.io/x/y:1}]}\n"),
    }
    for source, text in texts.items():
        assert parser.parse(text, source) == parse_text(text, source)
    refusals = {
        "bomb.yaml": (alias_bomb(), "bomb.yaml: aliases (*name) are not allowed at line 2"),
        "deep.yaml": ("[" * 100_000, "deep.yaml: nested more than 64 levels deep"),  # libyaml's composer crash
        "glob.yaml": (own_set("g", "nginx:*"), "glob.yaml: document 0.spec.images[0].name: globs are not allowed"),
        "dup.yaml": (own_set("d", "x:1") + "---\n" + own_set("d", "y:1"), "set 'd' is declared twice"),
        "syntax.yaml": ("a: [1,\n", "syntax.yaml: not valid YAML"),
    }
    for source, (text, says) in refusals.items():
        with pytest.raises(SetFileError) as e:
            parser.parse(text, source)
        assert says in str(e.value), str(e.value)
    assert parser.started == 1  # one child answered every one of them
    assert parser.pid is not None and parser.pid != os.getpid()
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, parser.pid) == min(19, ours + NICE)  # the shim's loop runs first


def test_an_edited_file_gives_the_new_order_and_names(parser: ParseProcess) -> None:
    """The child keeps the last file's normalized names: an edit still gives exactly the new content."""
    first = parser.parse(many("s", 3000), "s.yaml")
    edited = many("s", 3000, swap=5).replace("app2999:1", "added:2")
    again = parser.parse(edited, "s.yaml")
    assert again == parse_text(edited, "s.yaml")
    assert "docker.io/library/added:2" not in first[0].refs
    assert again[0].refs[5] == "registry.example/app2994:1" and again[0].generation != first[0].generation


def test_a_dead_child_is_replaced_and_a_file_that_kills_it_twice_is_refused(tmp_path: Path) -> None:
    crash = tmp_path / "crash.py"  # a child that dies on one text, as libyaml would on hostile input
    crash.write_text("import os, sys\nsys.path.insert(0, %r)\nfrom shim.imagesets import parse_process, loader\n"
                     "real = loader.parse_text\n"
                     "def parse(text, source, known=loader.EMPTY):\n"
                     "    if 'CRASH' in text:\n        os.kill(os.getpid(), 9)\n"
                     "    return real(text, source, known)\n"
                     "parse_process.parse_text = parse\nparse_process.serve()\n" % os.getcwd())
    parser = ParseProcess(command=[sys.executable, str(crash)])
    try:
        assert parser.parse(own_set("a", "nginx:1"), "a.yaml")[0].refs == ("docker.io/library/nginx:1",)
        os.kill(parser.pid or 0, signal.SIGKILL)  # killed between two files (the OOM killer, an operator)
        time.sleep(0.05)
        assert parser.parse(own_set("a", "nginx:2"), "a.yaml")[0].refs == ("docker.io/library/nginx:2",)
        with pytest.raises(SetFileError, match=r"^b.yaml: the YAML parser process killed by SIGKILL while "
                                               r"reading this file, twice$"):
            parser.parse(own_set("b", "nginx:1") + "# CRASH\n", "b.yaml")
        assert parser.parse(own_set("c", "nginx:3"), "c.yaml")[0].name == "c"  # the next file: a new child
        assert parser.started == 4  # a, a after the kill, b once more, c
    finally:
        parser.close()


def idle_after(seconds: float) -> list[str]:
    """A child that exits after ``seconds`` without a request."""
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {os.getcwd()!r}); "
            f"from shim.imagesets.parse_process import serve; serve(idle_seconds={seconds})"]


def child_state(pid: int) -> str | None:
    """The state letter (``Z``: a zombie) of our child ``pid``; None once it is no child of ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    state, ppid = stat.rpartition(")")[2].split()[:2]
    return state if int(ppid) == os.getpid() else None


def test_an_idle_child_is_reaped_as_it_exits() -> None:
    """issue 44: the child that exited when idle stayed a zombie until the next file. Nothing here asks
    the parser anything after the first file: the child is gone by itself, its pipes closed."""
    parser = ParseProcess(command=idle_after(0.2))
    fds = len(os.listdir("/proc/self/fd"))
    try:
        assert parser.parse(own_set("a", "nginx:1"), "a.yaml")[0].name == "a"
        child = parser.pid
        assert child is not None and child_state(child) not in (None, "Z")
        deadline = time.monotonic() + 30
        while (state := child_state(child)) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state is None, f"the idle child is still there, state {state}"
        with pytest.raises(ChildProcessError):
            os.waitpid(child, os.WNOHANG)  # no child of ours to reap: reaped already
        assert len(os.listdir("/proc/self/fd")) == fds  # its pipes closed too
    finally:
        parser.close()


def test_an_idle_child_exits_and_the_next_file_starts_another(tmp_path: Path) -> None:
    parser = ParseProcess(command=idle_after(0.2))
    try:
        assert parser.parse(own_set("a", "nginx:1"), "a.yaml")[0].name == "a"
        first = parser.pid
        deadline = time.monotonic() + 30
        while parser.pid is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parser.pid is None, "the idle child did not exit"
        assert parser.parse(own_set("a", "nginx:2"), "a.yaml")[0].refs == ("docker.io/library/nginx:2",)
        assert parser.pid not in (None, first) and parser.started == 2
    finally:
        parser.close()


def test_without_a_child_files_are_parsed_in_the_shim(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="cri_shim")
    parser = ParseProcess(command=[str(tmp_path / "no-such-python")])
    (tmp_path / "a.yaml").write_text(own_set("a", "nginx:1"))
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    r = SetDirectory(str(tmp_path), parse=parser.parse).scan()
    assert set(r.sets) == {"a"} and "aliases (*name) are not allowed" in r.errors[str(tmp_path / "bomb.yaml")]
    assert "cannot start the YAML parser process" in parser.start_error and parser.started == 0
    said = [r for r in caplog.records if r.getMessage().startswith("image-set files are parsed in the shim's threads")]
    assert len(said) == 1  # once, not at every file


def test_a_directory_read_through_the_child_keeps_a_bad_files_last_version(tmp_path: Path,
                                                                          parser: ParseProcess) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(many("s", 500))
    d = SetDirectory(str(tmp_path), parse=parser.parse)
    assert len(d.scan().sets["s"].refs) == 500
    path.write_text(many("s", 500).replace("app7:1", "app7:*"))
    r = d.scan()
    assert len(r.sets["s"].refs) == 500 and "globs are not allowed" in r.errors[str(path)]
    path.write_text(many("s", 501))
    r = d.scan()
    assert len(r.sets["s"].refs) == 501 and not r.errors
    parser.close()
    assert parser.pid is None
