"""Bad config: every key with a wrong type or value is rejected naming the key.

The cases are generated from the config dataclasses (``shim.config.Config`` and
everything under it), so a new key is covered as soon as it is declared: a value of
the wrong type for its annotation, a negative / NaN / infinite number, a string with
a NUL byte, a section that is not a map or has an unknown key. Keys whose strings
have a grammar (endpoints, modes, choices, patterns...) get explicit wrong values too.

Each case is checked where an operator meets it:
* ``cri-shim check-config`` exits 1 with one line naming the key;
* ``cri-shim serve`` exits non-zero with one line naming the key, no traceback
  (in-process for every case; as a real process for a sample: tests/process/test_bad_config.py);
* a reload (SIGHUP or file change) keeps the running config and logs a line naming the key.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from shim import cli
from shim import config as config_mod
from shim.config import Config, ConfigError
from tests.support.fake_runtime import FakeRuntime, socket_in
from tests.support.inproc import running_shim
from tests.support.logcapture import Lines

Path_ = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Case:
    path: Path_  # where the bad value goes (an int is a list index)
    value: Any
    why: str
    key: str  # the key the error must name (or a key under it)

    @property
    def id(self) -> str:
        return f"{self.key}={self.why}"

    def data(self) -> dict[str, Any]:
        """The config mapping with the bad value in place (list items get the other required keys)."""
        return _build(self.path, self.value, ())


def _build(rest: Path_, value: Any, prefix: Path_) -> Any:
    if not rest:
        return value
    part = rest[0]
    if isinstance(part, int):  # ``prefix`` is a list: items before ``part`` are valid ones
        items = [_minimal_item(prefix) for _ in range(part)]
        if len(rest) == 1:
            return items + [value]
        item = _minimal_item(prefix)
        item.update(_build(rest[1:], value, prefix + (part,)))
        return items + [item]
    return {part: _build(rest[1:], value, prefix + (part,))}


def key_of(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


# --------------------------------------------------------------------------- generation from the dataclasses


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _minimal(cls: type) -> dict[str, Any]:
    """A valid mapping for a dataclass: just its required fields."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            out[f.name] = _valid(_hints(cls)[f.name])
    return out


def _minimal_item(list_path: Path_) -> Any:
    tp = _type_at(list_path)
    return _minimal(typing.get_args(tp)[0])


def _type_at(path: Path_) -> Any:
    tp: Any = Config
    for part in path:
        if isinstance(part, int):
            tp = typing.get_args(tp)[0]
        else:
            tp = _hints(tp)[part]
    return tp


def _valid(tp: Any) -> Any:
    return {str: "x", int: 1, float: 1.0, bool: True}[tp]


NEGATIVE_ALLOWED = {"pulls.priority_rules[0].priority"}  # a Kubernetes pod priority may be below 0

WRONG_TYPE = {
    int: [("string", "lots"), ("bool", True), ("float", 1.5), ("list", [1]), ("map", {"a": 1})],
    float: [("string", "soon"), ("bool", True), ("list", [1.0]), ("map", {"a": 1})],
    bool: [("string", "yes"), ("int", 1), ("list", [True]), ("map", {"a": True})],
    # (a number for a string key can be meant as a string, e.g. a numeric group: not "wrong")
    str: [("bool", True), ("float", 1.5), ("list", ["a"]), ("map", {"a": "b"})],
}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def generated(cls: type = Config, path: Path_ = ()) -> Iterator[Case]:
    for f in dataclasses.fields(cls):
        yield from _field_cases(path + (f.name,), _hints(cls)[f.name], f)


def _field_cases(path: Path_, tp: Any, f: dataclasses.Field | None) -> Iterator[Case]:
    key = key_of(path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_dataclass_type(tp):  # a section
        for why, v in (("string", "x"), ("list", [1]), ("int", 5)):
            yield Case(path, v, why, key)
        yield Case(path + ("no_such_key",), 1, "unknown-key", key_of(path + ("no_such_key",)))
        yield from generated(tp, path)
        return
    if origin is tuple:  # a list (of strings, of (key, value) pairs = a map, or of sections)
        item = args[0]
        if typing.get_origin(item) is tuple:  # a map of strings
            for why, v in (("string", "x"), ("list", ["a"]), ("int", 5)):
                yield Case(path, v, why, key)
            yield Case(path + ("k",), 1, "int-value", key_of(path + ("k",)))
            yield Case(path + ("k",), ["v"], "list-value", key_of(path + ("k",)))
            return
        for why, v in (("string", "x"), ("map", {"a": "b"}), ("int", 5)):
            yield Case(path, v, why, key)
        if _is_dataclass_type(item):
            yield Case(path + (0,), "x", "item-string", key_of(path + (0,)))
            yield Case(path + (0, "no_such_key"), 1, "unknown-key", key_of(path + (0, "no_such_key")))
            for sub in dataclasses.fields(item):
                yield from _field_cases(path + (0, sub.name), _hints(item)[sub.name], sub)
            return
        if item is int:  # a list of numbers (uids)
            for why, v in (("item-string", "root"), ("item-bool", True), ("item-negative", -1)):
                yield Case(path + (0,), v, why, key_of(path + (0,)))
        else:
            yield Case(path + (0,), 1, "item-int", key_of(path + (0,)))
        yield Case(path + (0,), ["a"], "item-list", key_of(path + (0,)))
        yield Case(path + (0,), "bad\x00value", "item-nul", key_of(path + (0,)))
        return
    for why, v in WRONG_TYPE[tp]:
        yield Case(path, v, why, key)
    if tp in (int, float) and key not in NEGATIVE_ALLOWED:
        yield Case(path, -1, "negative", key)
    if tp is float:
        yield Case(path, math.nan, "nan", key)
        yield Case(path, math.inf, "inf", key)
    if tp is str:
        default = f.default if f is not None and isinstance(f.default, str) and f.default else "value"
        yield Case(path, default[:3] + "\x00" + default[3:], "nul", key)


# Keys whose strings have a grammar, or whose numbers have a range: explicit wrong values.
EXPLICIT = [
    (("listen",), "/run/cri-shim.sock", "no-scheme"),
    (("listen",), "tcp://0.0.0.0:5000", "tcp"),
    (("listen",), "unix:///" + "d" * 120 + ".sock", "path-too-long"),
    (("upstream",), "http://localhost", "http"),
    (("upstream",), "unix://", "empty"),
    (("server", "socket_mode"), "0999", "not-octal"),
    (("server", "socket_mode"), "rw-rw----", "symbolic"),
    (("server", "socket_mode"), 0o1000, "too-big"),
    (("server", "socket_group"), "no-such-group-cri-shim", "unknown-group"),
    (("server", "max_message_bytes"), "16 parsecs", "bad-unit"),
    (("server", "max_message_bytes"), 0, "zero"),
    (("server", "max_concurrent_streams"), 0, "zero"),
    (("server", "shutdown_grace_seconds"), "10 fortnights", "bad-unit"),
    (("server", "engine"), "fast", "unknown"),
    (("server", "max_request_bytes", "PullImagee"), "1MiB", "unknown-method"),
    (("server", "max_request_bytes", "PullImage"), "32MiB", "above-max-message-bytes"),
    (("server", "max_request_bytes", "PullImage"), 100, "below-minimum"),
    (("server", "max_intercepted_calls"), 1, "one"),
    (("server", "max_connections_per_uid"), 0, "zero"),
    (("server", "trusted_uids", 0), 2**32 - 1, "not-a-uid"),
    (("pulls", "untrusted_share"), 0, "zero"),
    (("pulls", "untrusted_share"), 1.5, "above-one"),
    (("pulls", "max_parallel_per_uid"), 0, "zero"),
    (("server", "stream_stall_seconds"), 0, "zero"),
    (("log", "level"), "verbose", "unknown"),
    (("log", "format"), "xml", "unknown"),
    (("pins", "images"), ["nginx@sha256:abc"], "short-digest"),
    (("pins", "images"), ["docker.io/UPPER/case"], "uppercase-path"),
    (("pins", "images"), ["quay.io/*@sha256:" + "a" * 64], "glob-with-digest"),
    (("pins", "images"), [""], "empty"),
    (("pins", "mode"), "warn", "unknown"),
    (("image_sets", "max_parallel"), 0, "zero"),
    (("image_sets", "min_free_bytes"), "lots", "not-a-size"),
    (("image_sets", "retry_max_seconds"), 1, "below-initial"),  # the default initial is 5
    (("runtime_handlers", "rules", 0, "handler"), "", "empty"),
    (("pulls", "priority_rules", 0, "priority"), "very-important", "unknown-name"),
    (("pulls", "priority_rules", 0, "priority"), 3_000_000_000, "above-system-node-critical"),
    (("pulls", "priority_aging_seconds"), 0, "zero"),
    (("pulls", "critical_slots"), "one", "not-a-number"),
    (("runtime_handlers", "pod_cache_size"), 0, "zero"),
    (("metrics", "address"), "9464", "no-host"),
    (("metrics", "address"), "127.0.0.1:99999", "port-range"),
    (("metrics", "address"), "127.0.0.1:0", "port-zero"),
]


def all_cases() -> list[Case]:
    cases = list(generated())
    cases.append(Case(("no_such_key",), 1, "unknown-key", "no_such_key"))
    cases += [Case(p, v, why, key_of(p)) for p, v, why in EXPLICIT]
    cases.append(Case(("runtime_handlers", "rules", 0), {"namespaces": ["a"]}, "no-handler",
                      "runtime_handlers.rules[0].handler"))
    return cases


CASES = all_cases()


def names_key(err_key: str, key: str) -> bool:
    return err_key == key or err_key.startswith((key + ".", key + "["))


def test_generation_covers_every_key() -> None:
    """Every leaf key of every config dataclass has a wrong-type case (so new keys are covered)."""
    def leaves(cls: type, prefix: str) -> Iterator[str]:
        for f in dataclasses.fields(cls):
            tp = _hints(cls)[f.name]
            name = f"{prefix}.{f.name}" if prefix else f.name
            if _is_dataclass_type(tp):
                yield from leaves(tp, name)
            elif typing.get_origin(tp) is tuple and _is_dataclass_type(typing.get_args(tp)[0]):
                yield from leaves(typing.get_args(tp)[0], f"{name}[0]")
            else:
                yield name
    covered = {c.key for c in CASES}
    missing = [k for k in leaves(Config, "") if k not in covered]
    assert missing == []
    assert len(CASES) > 150


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rejected_by_the_parser_naming_the_key(case: Case) -> None:
    with pytest.raises(ConfigError) as e:
        config_mod.from_dict(case.data())
    assert names_key(e.value.key, case.key), f"{e.value.key!r}: {e.value}"
    assert str(e.value).startswith(e.value.key + ": ")


def write(tmp_path: Path, case: Case) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(case.data()))
    assert yaml.safe_load(p.read_text()) == case.data() or case.why in ("nan",)  # survives YAML
    return p


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_check_config_and_serve_refuse_it(tmp_path: Path, capsys, case: Case) -> None:
    path = write(tmp_path, case)
    with pytest.raises(ConfigError):  # never start serving in this test process
        config_mod.load(path)
    assert cli.main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and case.key in err, err
    code = cli.main(["serve", "--config", str(path), "--listen", f"unix://{tmp_path}/s.sock",
                     "--upstream", f"unix://{tmp_path}/rt.sock"])
    err = capsys.readouterr().err
    assert code != 0
    assert err.count("\n") == 1 and case.key in err and "Traceback" not in err, err






async def test_reload_keeps_the_running_config(tmp_path: Path) -> None:
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    path = tmp_path / "config.yaml"
    good = {"pulls": {"max_parallel": 3}, "pins": {"images": ["nginx"]}}
    path.write_text(yaml.safe_dump(good))
    lines = Lines()
    log = logging.getLogger("cri_shim.server")
    log.addHandler(lines)
    try:
        async with running_shim(rt.endpoint, good, config_path=str(path)) as shim:
            running = shim.server.cfg
            for case in CASES:
                path.write_text(yaml.safe_dump(case.data()))
                await shim.server.reload(shim.app, "test")
                rejected = [r for r in lines.records if r.getMessage().startswith("config reload rejected")]
                assert rejected, case
                error = rejected[-1].fields["error"]  # type: ignore[attr-defined]
                assert error.startswith(case.key), (case, error)
                assert rejected[-1].levelno == logging.ERROR
                assert shim.server.cfg is running and shim.app.cfg.pulls.max_parallel == 3
                assert shim.app.scheduler.max_parallel == 3 and shim.app.images.pin_patterns == ("nginx",)
                lines.records.clear()
    finally:
        log.removeHandler(lines)
        await rt.stop()


BAD_YAML = [
    ("pulls:\n  max_parallel: [1\n", "not valid YAML at line 3"),
    ("a: b\n c: d\n", "not valid YAML at line 2"),
    ("\t- x", "not valid YAML at line 1"),
    ("- just\n- a list\n", "expected a map"),
    ("pulls: 3\n", "pulls: expected a map"),
]


@pytest.mark.parametrize("text, message", BAD_YAML)
def test_malformed_yaml_is_one_line(tmp_path: Path, capsys, text: str, message: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert cli.main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err




async def test_reload_names_keys_that_need_a_restart(tmp_path: Path) -> None:
    """A valid reload that changes the socket, the engine or the metrics address: logged by key, not applied."""
    rt = await FakeRuntime(socket_in(str(tmp_path))).start()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"pulls": {"max_parallel": 3}}))
    lines = Lines()
    log = logging.getLogger("cri_shim.server")
    log.addHandler(lines)
    try:
        async with running_shim(rt.endpoint, {"pulls": {"max_parallel": 3}}, config_path=str(path)) as shim:
            running = shim.server.cfg
            path.write_text(yaml.safe_dump({
                "listen": running.listen, "upstream": running.upstream, "pulls": {"max_parallel": 5},
                "metrics": {"address": "127.0.0.1:9464"},
                "server": {"socket_mode": "0600", "engine": "grpc", "admin_socket": ""}}))
            await shim.server.reload(shim.app, "test")
            restart = {r.fields["key"]: r.fields["configured"] for r in lines.records  # type: ignore[attr-defined]
                       if r.getMessage().startswith("config key needs a restart")}
            assert restart == {"server.socket_mode": 0o600, "server.engine": "grpc",
                               "metrics.address": "127.0.0.1:9464"}
            assert shim.app.scheduler.max_parallel == 5  # the rest is applied
            assert shim.server.cfg.server.socket_mode == 0o660 and shim.server.cfg.metrics.address == ""
            assert stat_mode(shim.path) == 0o660
    finally:
        log.removeHandler(lines)
        await rt.stop()


def stat_mode(path: str) -> int:
    import os
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)
