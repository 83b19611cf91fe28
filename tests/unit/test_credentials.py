"""Registry credentials for image sets: kubelet's keyring matching, docker config.json
files (re-read on change, bad files keep their previous content), and no secret in
any repr, log line or status."""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path

import pytest

from shim.credentials import Credential, DockerConfigFiles, Keyring
from shim.credentials.dockerconfig import ConfigFileError, parse
from shim.credentials.keyring import key_of, matches

SECRET = "pw-c0ffee-9d1e"


def cred(name: str) -> Credential:
    return Credential(name, username=name, password=SECRET)


@pytest.mark.parametrize("location, key", [
    ("https://index.docker.io/v1/", "index.docker.io"),
    ("http://Registry.Example.com:5000", "registry.example.com:5000"),
    ("registry.example.com/v2/team", "registry.example.com/team"),
    ("quay.io/org/", "quay.io/org/"),
    ("quay.io/org", "quay.io/org"),
])
def test_keys_are_schemeless_lower_case_hosts(location: str, key: str) -> None:
    assert key_of(location) == key


@pytest.mark.parametrize("key, target, expected", [
    ("registry.example.com", "registry.example.com/app", True),
    ("registry.example.com", "registry.example.com:5000/app", False),  # the port must match
    ("registry.example.com:5000", "registry.example.com:5000/app", True),
    ("registry.example.com:5000", "registry.example.com:5001/app", False),
    ("*.example.com", "a.example.com/app", True),
    ("*.example.com", "a.b.example.com/app", False),  # one glob, one dot-separated part
    ("*.example.com", "example.com/app", False),
    ("*.*.com", "a.example.com/app", True),
    ("quay.io/org", "quay.io/org/app", True),
    ("quay.io/org", "quay.io/other/app", False),
    ("quay.io/org", "quay.io/organization/app", True),  # kubelet's string prefix
    ("quay.io/org/", "quay.io/organization/app", False),
    ("127.0.0.1:5000", "127.0.0.1:5000/app", True),
    ("[::1]:5000", "[::1]:5000/app", True),
])
def test_matching_follows_kubelets_urls_match(key: str, target: str, expected: bool) -> None:
    assert matches(key, target) is expected


def test_most_specific_first_then_docker_hub_default() -> None:
    ring = Keyring([("quay.io", cred("host")), ("quay.io/org/team", cred("team")), ("quay.io/org", cred("org")),
                    ("https://index.docker.io/v1/", cred("hub")), ("*.example.com", cred("glob")),
                    ("Reg.Example.com", cred("exact"))])
    assert [c.source for c in ring.lookup("quay.io/org/team/app:1")] == ["team", "org", "host"]
    assert [c.source for c in ring.lookup("quay.io/other/app")] == ["host"]
    assert [c.source for c in ring.lookup("nginx")] == ["hub"]
    assert [c.source for c in ring.lookup("docker.io/user/app@sha256:" + "a" * 64)] == ["hub"]
    assert [c.source for c in ring.lookup("REG.example.com/app")] == ["exact", "glob"]
    assert ring.lookup("ghcr.io/org/app") == []
    assert ring.lookup("not a reference") == []


def test_docker_io_key_matches_hub_images_directly() -> None:
    ring = Keyring([("docker.io", cred("d"))])
    assert [c.source for c in ring.lookup("library/busybox")] == ["d"]


def test_config_json_entries() -> None:
    doc = {"auths": {
        "reg.local:5000": {"auth": base64.b64encode(f"robot:{SECRET}".encode()).decode()},
        "quay.io": {"username": "u", "password": SECRET},
        "gcr.io": {"identitytoken": "idtok-1"},
        "both.io": {"auth": base64.b64encode(b"a:b").decode(), "username": "x", "password": "y"},
    }, "credHelpers": {"ecr.aws": "ecr-login"}}
    entries = dict(parse(json.dumps(doc), "/cfg.json"))
    assert (entries["reg.local:5000"].username, entries["reg.local:5000"].password) == ("robot", SECRET)
    assert entries["quay.io"].auth_config().password == SECRET
    assert entries["gcr.io"].auth_config().identity_token == "idtok-1"
    assert (entries["both.io"].username, entries["both.io"].password) == ("a", "b")  # auth wins, as in kubelet
    assert SECRET not in repr(entries) and "idtok-1" not in repr(entries)


@pytest.mark.parametrize("text, says", [
    ("{", "not valid JSON"),
    ("[]", "expected a JSON object"),
    ('{"auths": []}', "auths: expected an object"),
    ('{"auths": {"r": {"auth": "not-base64!"}}}', "not base64 of user:password"),
    ('{"auths": {"r": {"password": 5}}}', "auths['r'].password: expected a string"),
])
def test_bad_files_are_named_without_their_content(text: str, says: str) -> None:
    with pytest.raises(ConfigFileError) as e:
        parse(text, "/etc/x.json")
    assert says in str(e.value) and str(e.value).startswith("/etc/x.json: ")


def write(path: Path, doc: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    os.replace(tmp, path)


def test_files_are_merged_and_reread_on_change(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="cri_shim")
    a, b, missing = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "none.json"
    write(a, {"auths": {"reg.local": {"username": "one", "password": SECRET}}})
    files = DockerConfigFiles((str(missing), str(a), str(b)))
    assert [c.username for c in files.keyring().lookup("reg.local/app")] == ["one"]
    write(b, {"auths": {"reg.local": {"username": "two", "password": SECRET}}})
    assert [c.username for c in files.keyring().lookup("reg.local/app")] == ["one", "two"]
    write(a, {"auths": {"other.local": {"username": "three", "password": SECRET}}})  # rotated
    assert [c.username for c in files.keyring().lookup("reg.local/app")] == ["two"]
    write(b, "{ broken")
    assert [c.username for c in files.keyring().lookup("reg.local/app")] == ["two"]  # previous content stays
    assert "not valid JSON" in files.status()[str(b)]["error"]
    assert files.status()[str(missing)] == {"state": "missing"}
    b.unlink()
    assert files.keyring().lookup("reg.local/app") == []
    assert SECRET not in caplog.text and SECRET not in json.dumps(files.status())
    ring = files.keyring()
    assert files.keyring() is ring  # nothing changed: the same keyring, no re-read
