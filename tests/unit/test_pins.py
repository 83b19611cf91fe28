"""Table tests for pin patterns (shim.pins): normalization of exact references,
digests, image IDs and globs (docker.io defaults, ports), and matching against
the names a runtime reports for an image."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from shim import reference
from shim.config import ConfigError, from_dict
from shim.image_patterns import normalize_pattern
from shim.images.pin_set import PinSet, image_names

D1 = "sha256:" + "a" * 64
D2 = "sha256:" + "0123456789abcdef" * 4
HEX = "1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a"


@pytest.mark.parametrize(("pattern", "canonical"), [
    # exact references: docker.io defaults
    ("nginx", "docker.io/library/nginx:latest"),
    ("nginx:1.27", "docker.io/library/nginx:1.27"),
    ("library/nginx", "docker.io/library/nginx:latest"),
    ("docker.io/nginx:1.27", "docker.io/library/nginx:1.27"),
    ("index.docker.io/library/nginx", "docker.io/library/nginx:latest"),
    ("user/app", "docker.io/user/app:latest"),
    ("  nginx  ", "docker.io/library/nginx:latest"),  # YAML leftovers trimmed
    # registries and ports
    ("registry.k8s.io/pause:3.10", "registry.k8s.io/pause:3.10"),
    ("localhost/app", "localhost/app:latest"),
    ("localhost:5000/team/app", "localhost:5000/team/app:latest"),
    ("myregistry:5000/app:v1", "myregistry:5000/app:v1"),
    ("10.0.0.1:443/app:v1", "10.0.0.1:443/app:v1"),
    ("[fc00::1]:5000/app", "[fc00::1]:5000/app:latest"),
    # digests: the tag of name:tag@digest is dropped, the digest pins
    (f"nginx@{D1}", f"docker.io/library/nginx@{D1}"),
    (f"nginx:1.27@{D1}", f"docker.io/library/nginx@{D1}"),
    (f"localhost:5000/app@{D2}", f"localhost:5000/app@{D2}"),
    # image IDs
    (D1, D1),
    (HEX, f"sha256:{HEX}"),
    # globs: docker.io defaults on the repository part, ports kept
    ("registry.k8s.io/pause:*", "registry.k8s.io/pause:*"),
    ("quay.io/org/*", "quay.io/org/*"),
    ("pause:*", "docker.io/library/pause:*"),
    ("org/*", "docker.io/org/*"),
    ("docker.io/nginx:1.*", "docker.io/library/nginx:1.*"),
    ("index.docker.io/org/*", "docker.io/org/*"),
    ("localhost:5000/*", "localhost:5000/*"),
    ("reg.example.com:8443/team/app:v[0-9]*", "reg.example.com:8443/team/app:v[0-9]*"),
    ("*.example.com/*", "*.example.com/*"),
    ("nginx:1.2?", "docker.io/library/nginx:1.2?"),
    ("[fc00::1]:5000/team/*", "[fc00::1]:5000/team/*"),
])
def test_normalize_pattern(pattern: str, canonical: str) -> None:
    assert normalize_pattern(pattern) == canonical
    assert normalize_pattern(canonical) == canonical  # idempotent


@pytest.mark.parametrize(("pattern", "message"), [
    ("", "empty"),
    ("   ", "empty"),
    ("Nginx", "lowercase"),
    ("nginx@sha256:abc", "digest"),
    (f"nginx:*@{D1}", "glob cannot contain a digest"),
    ("nginx:", "tag"),
    ("https://example.com/app", "host"),
])
def test_invalid_patterns(pattern: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        normalize_pattern(pattern)


def test_config_names_the_bad_pattern() -> None:
    with pytest.raises(ConfigError) as e:
        from_dict({"pins": {"images": ["nginx", "Bad"]}})
    assert e.value.key == "pins.images[1]" and "'Bad'" in str(e.value)
    with pytest.raises(ConfigError, match="pins.mode"):
        from_dict({"pins": {"mode": "sometimes"}})


# An image as containerd reports it: ID, normalized tags and digests.
NGINX = (D2, ["docker.io/library/nginx:1.27", "docker.io/library/nginx:latest"], [f"docker.io/library/nginx@{D1}"])
PAUSE = ("sha256:" + "b" * 64, ["registry.k8s.io/pause:3.10"], ["registry.k8s.io/pause@" + "sha256:" + "c" * 64])
LOCAL = ("sha256:" + "e" * 64, ["localhost:5000/team/app:v2"], [])
NESTED = ("sha256:" + "f" * 64, ["quay.io/org/team/app:v1"], [])
IPV6 = ("sha256:" + "1" * 64, ["[fc00::1]:5000/app:v1"], [])


def matches(patterns: list[str], image: tuple[str, list[str], list[str]]) -> str | None:
    return PinSet.build(patterns).match(image_names(*image))


@pytest.mark.parametrize(("pattern", "image", "pinned"), [
    ("nginx", NGINX, True),
    ("nginx:1.27", NGINX, True),
    ("nginx:1.26", NGINX, False),
    ("docker.io/library/nginx:latest", NGINX, True),
    (f"nginx@{D1}", NGINX, True),
    (f"nginx:9.9@{D1}", NGINX, True),  # the digest pins, whatever the tag says
    (f"otherrepo@{D1}", NGINX, False),  # a digest pins one repository's manifest
    (D2, NGINX, True),
    (D2.removeprefix("sha256:"), NGINX, True),
    (D1, NGINX, False),  # a manifest digest is not an image ID
    ("nginx:1.*", NGINX, True),
    ("nginx:2.*", NGINX, False),
    ("docker.io/library/*", NGINX, True),
    ("*", NGINX, True),  # docker.io/library/*: every official image
    ("*", PAUSE, False),
    ("registry.k8s.io/pause:*", PAUSE, True),
    ("registry.k8s.io/pause:3.1?", PAUSE, True),
    ("registry.k8s.io/pause:3.[0-8]", PAUSE, False),
    ("registry.k8s.io/pause", PAUSE, False),  # exact: that is pause:latest
    ("localhost:5000/team/app:v2", LOCAL, True),
    ("localhost:5000/*", LOCAL, True),
    ("localhost:5001/*", LOCAL, False),
    ("localhost/team/app:v2", LOCAL, False),  # another registry
    ("quay.io/org/*", NESTED, True),  # * crosses '/'
    ("quay.io/org/app:*", NESTED, False),
    ("[fc00::1]:5000/app:v1", IPV6, True),
    ("[fc00::1]:5000/*", IPV6, True),  # the host is literal, not a [character class]
    ("[fc00::2]:5000/*", IPV6, False),
    ("f:5000/*", IPV6, False),
])
def test_match(pattern: str, image, pinned: bool) -> None:
    assert (matches([pattern], image) is not None) is pinned
    pins = PinSet.build([pattern])
    for _ in range(2):  # the second time from the per-name cache
        assert (pins.match_image(*image) is not None) is pinned


def test_runtime_names_are_normalized_before_matching() -> None:
    """A runtime that reports short names still matches (CRI-O with unqualified names, old tooling)."""
    image = ("sha256:" + "9" * 64, ["nginx:1.27", "index.docker.io/library/redis"], ["nginx@" + D1])
    assert matches(["docker.io/library/nginx:1.27"], image) is not None
    assert matches(["redis:latest"], image) is not None
    assert matches([f"docker.io/library/nginx@{D1}"], image) is not None
    assert PinSet.build(["redis"]).match_image(*image) == "docker.io/library/redis:latest"


def test_match_names_the_pin_and_its_source() -> None:
    pins = PinSet.build(["registry.k8s.io/pause:*", "nginx"], declared=[("quay.io/org/app:v1", "base"),
                                                                        ("Not A Ref", "broken")])
    pin = pins.match(image_names(*PAUSE))
    assert pin == "registry.k8s.io/pause:*"
    assert pins.describe(pin) == "pins.images entry 'registry.k8s.io/pause:*'"
    pin = pins.match(image_names(*NGINX))
    assert pins.describe(pin) == "pins.images entry 'nginx'"
    pin = pins.match(image_names(*NESTED[:1], ["quay.io/org/app:v1"], []))
    assert pins.describe(pin) == "image set 'base'"
    assert pins.match(image_names(*LOCAL)) is None
    assert not PinSet.build([]) and PinSet.build([], declared=[("nginx", "s")])


# image_names skips the full parse for names that are already normalized; the result
# must be what normalization gives (or the name itself when it does not parse).
_name = st.builds(
    lambda host, path, tail: host + path + tail,
    st.sampled_from(["", "docker.io/", "index.docker.io/", "localhost/", "localhost:5000/", "reg.example.com/",
                     "REG/", "a_b.c/", "[::1]:5000/", "docker.io/library/", "quay.io/",
                     "Reg.Example.com/", "LocalHost:5000/", "Docker.IO/", "Index.Docker.io/library/"]),
    st.from_regex(r"\A[a-z0-9A-Z_.:@-]{1,8}(/[a-z0-9_.:-]{1,6}){0,2}\Z"),
    st.sampled_from(["", ":v1", ":latest", f"@{D1}", f":v1@{D1}", ":", "@sha256:ab", ":Bad Tag"]),
)


@given(_name)
def test_image_names_agree_with_normalize(name: str) -> None:
    try:
        expected = reference.normalize(name)
    except reference.InvalidReference:
        expected = name
    assert image_names("", [name], []) == [expected]


def test_pin_hosts_are_case_insensitive_and_split_like_references() -> None:
    pins = PinSet.build(["REG.Example.com/app:*", "Quay.IO/org/tool:1"])
    assert pins.match_image("", ["reg.example.com/app:v1"], []) == "reg.example.com/app:*"
    assert pins.match_image("", ["quay.io/org/tool:1"], []) == "quay.io/org/tool:1"
    assert PinSet.build(["reg.example.com/app:v1"]).match_image("", ["Reg.EXAMPLE.com/app:v1"], []) is not None
    # the glob's host is decided by reference.split_domain: an upper-case first component is a host
    assert normalize_pattern("LOCALDOMAIN/x:*") == "LOCALDOMAIN/x:*"
    assert normalize_pattern("Index.Docker.io/busybox:*") == "docker.io/library/busybox:*"
