"""YAML the shim reads (config file, image-set files, credential provider config) cannot make it
use unbounded time, memory or log: aliases and deep nesting are refused, files have a size cap,
and error messages quote at most a short, escaped part of an offending value.

Where an operator meets it: a bad config at start exits with one short line; at reload the
running config stays and one short line says why; a bad image-set file is rejected with a
clear reason while the other files' sets stay in force. (Start and reload of a shim process:
tests/process/test_yaml_bounds.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shim import cli, safeyaml
from shim.config import ConfigError, load
from shim.credentials.plugins import ProviderConfigError, parse_config
from shim.imagesets.loader import SetDirectory, SetFileError, parse_text

SHORT = 600  # an error line's length bound in these tests (file path and the list of known keys included)


def alias_bomb(levels: int = 8) -> str:
    """The issue's file: each level holds ten aliases of the one before (10**levels strings)."""
    lines = ['a0: &a0 "xxxxxxxxxxxxxxxx"']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def own_set(name: str, *images: str) -> str:
    items = ", ".join(f"{{name: '{i}'}}" for i in images)
    return f"apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {{name: {name}}}\nspec: {{images: [{items}]}}\n"


def test_aliases_and_deep_nesting_are_refused_before_anything_is_built() -> None:
    assert len(alias_bomb()) < 700
    t = time.monotonic()
    with pytest.raises(safeyaml.UnsafeYaml, match=r"aliases \(\*name\) are not allowed at line 2, column"):
        safeyaml.load(alias_bomb())
    with pytest.raises(safeyaml.UnsafeYaml, match="nested more than 64 levels deep"):
        safeyaml.load("[" * 200_000 + "]" * 200_000)  # libyaml's composer crashes the process on this
    assert time.monotonic() - t < 10  # generous: the refusal stops at the first offending event
    assert safeyaml.load("a: &anchor [1, 2]\n") == {"a": [1, 2]}  # an anchor alone is harmless


@pytest.mark.parametrize("text, says", [
    (alias_bomb(), "aliases (*name) are not allowed"),
    ("[" * 100_000, "nested more than 64 levels deep"),
    ("pulls:\n  max_parallel: " + "9" * 100 + "x" * 500_000 + "\n", "pulls.max_parallel: expected an integer, got '999"),
    ("pulls:\n  ? " + "k" * 500_000 + "\n  : 1\n", "pulls.kkkk"),
    ("# padding\n" * 110_000, f"larger than {safeyaml.CONFIG_MAX_BYTES} bytes"),
])
def test_bad_config_file_is_one_short_line(tmp_path: Path, capsys, text: str, says: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(path)
    assert says in str(e.value) and len(str(e.value)) < SHORT, str(e.value)[:1000]
    assert cli.main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and len(err) < SHORT






def test_a_bad_image_set_file_is_rejected_and_the_others_stay(tmp_path: Path) -> None:
    (tmp_path / "good.yaml").write_text(own_set("good", "nginx:1"))
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    (tmp_path / "deep.yaml").write_text("[" * 100_000)
    (tmp_path / "big.yaml").write_text(own_set("big", *[f"app{i}:1" for i in range(60_000)]))
    (tmp_path / "longname.yaml").write_text(own_set("longname", "n" * 300_000))
    (tmp_path / "longset.yaml").write_text(own_set("s" * 300, "nginx:2"))
    d = SetDirectory(str(tmp_path))
    r = d.scan()
    assert set(r.sets) == {"good"} and r.sets["good"].refs == ("docker.io/library/nginx:1",)
    errors = {Path(p).name: e for p, e in r.errors.items()}
    assert set(errors) == {"bomb.yaml", "deep.yaml", "big.yaml", "longname.yaml", "longset.yaml"}
    assert "metadata.name: longer than 253 characters" in errors["longset.yaml"]
    assert "longer than 526 characters" in errors["longname.yaml"]
    assert "aliases (*name) are not allowed" in errors["bomb.yaml"]
    assert "nested more than 64 levels deep" in errors["deep.yaml"]
    assert "larger than 1048576 bytes (image_sets.max_file_bytes)" in errors["big.yaml"]
    assert all(len(e) < SHORT for e in errors.values()), errors


def test_set_file_errors_quote_a_short_prefix() -> None:
    with pytest.raises(SetFileError) as e:
        parse_text("apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: s}\n"
                   f"spec: {{pin: '{'y' * 100_000}\\n'}}\n", "/sets/x.yaml")
    msg = str(e.value)
    assert msg.startswith("/sets/x.yaml: document 0.spec.pin: expected true or false, got 'yyy")
    assert len(msg) < SHORT and "..." in msg


def test_credential_provider_config_refuses_aliases() -> None:
    with pytest.raises(ProviderConfigError, match=r"aliases \(\*name\) are not allowed"):
        parse_config(alias_bomb(), "/etc/providers.yaml")
