"""The ImageSet CRD's checks on spec.images[].name (pattern and CEL rules) refuse exactly what the
shim refuses, up to the CRD's maxLength (256, below the shim's 526 to fit the CEL cost budget).

The pattern and the rules' regexes are read from deploy/cluster/crds.yaml and run here with
Python's re (ASCII; the constructs used mean the same in RE2) under the rules' control flow;
every name is also given to the shim's own check (loader.normalize_ref). The real API server's answers are checked in
tests/cluster/test_cluster_invalid.py."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import yaml

from shim import reference
from shim.imagesets.loader import normalize_ref
from tests.support.kube import REPO


def _name_schema() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "cluster" / "crds.yaml").read_text()))
    spec = docs[0]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["images"]["items"]["properties"]["name"]  # type: ignore[no-any-return]


SCHEMA = _name_schema()
RULES = [r["rule"] for r in SCHEMA["x-kubernetes-validations"]]
RX = [re.findall(r"r'([^']*)'", rule) for rule in RULES]  # each rule's regexes, in order


_LOWER_ASCII = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _m(s: str, rx: str) -> bool:
    return re.search(rx, s, re.ASCII) is not None  # CEL matches(): unanchored, RE2


def cel_accepts(s: str) -> bool:
    if not SCHEMA["minLength"] <= len(s) <= SCHEMA["maxLength"] or not _m(s, SCHEMA["pattern"]):
        return False
    image_id, glob, lower, digest, length = RX
    domainish = "/" in s and (_m(s, length[1]) or s.startswith("localhost/"))
    found = re.search(length[0], s, re.ASCII)
    prefix = found.group(0) if found else ""
    single, lower_ascii = _m(s, length[2]), s.translate(_LOWER_ASCII)
    adjust = (18 if "/" not in s else 10 if not domainish
              else (2 if single else -6) if lower_ascii.startswith("index.docker.io/")
              else 8 if lower_ascii.startswith("docker.io/") and single else 0)
    return all((
        not _m(s, image_id[0]),
        not _m(s, glob[0]),
        not (_m(s, lower[0]) if "/" in s else _m(s, lower[1])),
        "@" not in s or _m(s, digest[0]),
        len(prefix) + adjust <= 255,
    ))


def shim_accepts(s: str) -> bool:
    """The shim's verdict, within the CRD's maxLength (the CEL cost budget keeps it below the shim's)."""
    if len(s) > SCHEMA["maxLength"]:
        return False
    try:
        normalize_ref(s)
    except ValueError:
        return False
    return True


CORPUS = [
    "nginx", "nginx:1.25", "library/nginx", "docker.io/nginx", "index.docker.io/nginx", "Index.Docker.IO/library/x:1",
    "host:5000/Team/App:v1", "host:5000/team/app:v1", "Foo/bar", "Foo/Bar", "NGINX", "localhost/app",
    "localhost:5000/app", "LOCALDOMAIN/x", "my_host.com/x", "a.b/c", "a__b/c", "a--b/c", "a-/c", "-a/b", "reg.io/a//b",
    "reg.io/a/b:V1", "reg.io/a/b:.v1", "reg.io/a/b:-v", "reg.io/a:" + "t" * 128, "reg.io/a:" + "t" * 129,
    "reg/a@sha256:" + "a" * 64, "reg/a@sha256:" + "A" * 64, "reg/a@sha256:" + "a" * 63, "reg/a:v1@sha512:" + "b" * 128,
    "reg/a@md5:" + "a" * 32, "sha256:" + "a" * 64, "a" * 64, "sha256:abc", "abc123", "reg/*:1", "reg/a?",
    "[::1]:5000/a", "host:5000/" + "a" * 280 + ":v1", "a" * 237, "a" * 238, "docker.io/" + "a" * 237,
    "docker.io/" + "a" * 238, "index.docker.io/" + "a" * 237, "index.docker.io/" + "a" * 238,
    "docker.io/x/" + "a" * 243, "docker.io/x/" + "a" * 244, "r.io/" + "a" * 250, "r.io/" + "a" * 251,
    "x/" + "a" * 243, "x/" + "a" * 244, "nginx:v1/x", "a@b/c", "reg.io:abc/x", "reg.io:80/x", "r-.io/x", "r.io./x",
    "quay.io/openshift-release-dev/ocp-v4.0-art-dev@sha256:" + "d" * 64, "a.b.c:1/d/e_f.g-h:tag_1.2-3",
    "r.io/" + "a" * 250 + ":" + "t" * 128 + "@sha512:" + "e" * 128,
]


def test_max_length_within_the_shims() -> None:
    assert 255 < SCHEMA["maxLength"] <= reference.MAX_LENGTH


@pytest.mark.parametrize("name", CORPUS, ids=lambda n: n[:40])
def test_rules_agree_with_the_shim(name: str) -> None:
    assert cel_accepts(name) == shim_accepts(name)


def test_rules_agree_with_the_shim_on_random_names() -> None:
    rng = random.Random(7)
    alphabet = "abAB09._-/:@"
    for _ in range(20000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert cel_accepts(s) == shim_accepts(s), s


def test_rules_agree_with_the_shim_on_random_references() -> None:
    """Names built from hosts, path components and tails near each rule's edge."""
    rng = random.Random(3)
    parts = ["docker.io", "index.docker.io", "Index.Docker.IO", "localhost", "reg.io", "r-1.x", "Host", "h:5000",
             "[::1]", "a", "a_b", "a__b", "a-b", "a--b", "A", "a.b", "x" * 120, "-", ".", "_", "library", "sha256"]
    tails = ["", ":v1", ":V1", ":.x", ":" + "t" * 128, ":" + "t" * 129, "@sha256:" + "a" * 64, "@sha256:" + "a" * 63,
             "@sha512:" + "f" * 128, ":v@sha384:" + "0" * 96, "@md5:" + "a" * 32, "@", ":"]
    for _ in range(20000):
        s = "/".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) + rng.choice(tails)
        assert cel_accepts(s) == shim_accepts(s), s
