"""Table tests for shim.reference (rules of distribution/reference
ParseNormalizedNamed + TagNameOnly; several cases come from its normalize_test.go)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, strategies as st

from shim.reference import Reference, InvalidReference, is_image_id, normalize, parse

D1 = "sha256:" + "a" * 64
D2 = "sha256:" + "0123456789abcdef" * 4
HEX = "1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a"


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        # Docker Hub defaults
        ("nginx", "docker.io/library/nginx:latest"),
        ("nginx:1.27", "docker.io/library/nginx:1.27"),
        ("user/app", "docker.io/user/app:latest"),
        ("user/app:v1", "docker.io/user/app:v1"),
        ("docker.io/nginx", "docker.io/library/nginx:latest"),
        ("docker.io/library/nginx", "docker.io/library/nginx:latest"),
        ("docker.io/user/app", "docker.io/user/app:latest"),
        ("index.docker.io/nginx", "docker.io/library/nginx:latest"),
        ("index.docker.io/user/app:v2", "docker.io/user/app:v2"),
        ("library/debian", "docker.io/library/debian:latest"),
        ("a/b/c", "docker.io/a/b/c:latest"),
        (f"docker.io/{HEX}", f"docker.io/library/{HEX}:latest"),
        ("192.168.0.1", "docker.io/library/192.168.0.1:latest"),
        # registry hosts, ports
        ("registry.k8s.io/pause:3.10", "registry.k8s.io/pause:3.10"),
        ("ghcr.io/org/team/app", "ghcr.io/org/team/app:latest"),
        ("localhost:5000/x", "localhost:5000/x:latest"),
        ("127.0.0.1:5000/x:1", "127.0.0.1:5000/x:1"),
        ("192.168.0.2:25000/debian", "192.168.0.2:25000/debian:latest"),
        ("myregistry:5000/a/b:c", "myregistry:5000/a/b:c"),
        ("[fc00::1]:5000/docker/docker", "[fc00::1]:5000/docker/docker:latest"),
        # localhost is a host even without a port or dot
        ("localhost/foo", "localhost/foo:latest"),
        ("localhost/library/debian", "localhost/library/debian:latest"),
        # an uppercase first component is a host (upstream rule)
        ("LOCALDOMAIN/debian", "LOCALDOMAIN/debian:latest"),
        # digests: no default tag; tag+digest keeps both
        (f"nginx@{D1}", f"docker.io/library/nginx@{D1}"),
        (f"nginx:1.27@{D1}", f"docker.io/library/nginx:1.27@{D1}"),
        (f"localhost:5000/x:1@{D2}", f"localhost:5000/x:1@{D2}"),
        ("nginx@sha512:" + "c" * 128, "docker.io/library/nginx@sha512:" + "c" * 128),
        # tag grammar
        ("nginx:Latest_1.2-rc.3", "docker.io/library/nginx:Latest_1.2-rc.3"),
        ("nginx:" + "t" * 128, "docker.io/library/nginx:" + "t" * 128),
        # separators
        ("docker---rules/docker", "docker.io/docker---rules/docker:latest"),
        ("dock__er/docker", "docker.io/dock__er/docker:latest"),
        # image IDs are recognized and kept in sha256: form
        (D1, D1),
        (HEX, f"sha256:{HEX}"),
    ],
)
def test_normalize(ref: str, expected: str) -> None:
    assert normalize(ref) == expected
    assert normalize(expected) == expected  # idempotent


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("", "empty"),
        ("Nginx", "lowercase"),
        ("docker/Docker", "lowercase"),
        ("docker.io/docker/Docker", "lowercase"),
        ("localhost:5000/Foo:bar", "lowercase"),
        ("nginx@sha256:abc", "digest"),
        ("nginx@sha256:" + "a" * 63, "digest"),
        ("nginx@sha256:" + "a" * 65, "64 lowercase hex"),
        ("nginx@sha256:" + "A" * 64, "64 lowercase hex"),
        ("nginx@md5:" + "a" * 32, "unsupported digest algorithm"),
        ("nginx@sha256", "digest"),
        ("nginx@", "digest"),
        (f"nginx@{D1}@{D1}", "digest"),
        ("nginx:", "tag"),
        ("nginx:-bad", "tag"),
        ("nginx:" + "t" * 129, "tag"),
        ("nginx:a:b", "tag"),
        ("https://github.com/docker/docker", "host"),
        ("-docker", "repository name"),
        ("-docker/docker", "repository name"),
        ("docker-/docker", "repository name"),
        ("-docker.io/docker/docker", "host"),
        ("my_host.com/x", "host"),
        ("docker///docker", "repository name"),
        ("docker/", "repository name"),
        ("____/____", "repository name"),
        ("dock..er/docker", "host"),
        ("dock_.er/docker", "host"),
        ("docker/dock..er", "repository name"),
        ("[fc00::1]:5000", "repository name"),
        ("fc00::1:5000/debian", "host"),
        ("[fe80::1%eth0]:5000/debian", "host"),
        ("nginx latest", "repository name"),
        ("x/" + "a" * 254, "longer than 255"),
        (HEX.upper(), "lowercase"),
    ],
)
def test_invalid(ref: str, message: str) -> None:
    with pytest.raises(InvalidReference, match=message):
        normalize(ref)


def test_reference_error_is_value_error() -> None:
    assert issubclass(InvalidReference, ValueError)


def test_parse_fields_and_forms() -> None:
    r = parse(f"localhost:5000/team/app:1.0@{D1}")
    assert r == Reference("localhost:5000", "team/app", "1.0", D1)
    assert r.name == "localhost:5000/team/app"
    assert r.tagged() == "localhost:5000/team/app:1.0"
    assert r.digested() == f"localhost:5000/team/app@{D1}"
    assert str(r) == f"localhost:5000/team/app:1.0@{D1}"


def test_parse_adds_no_default_tag() -> None:
    r = parse("nginx")
    assert (r.domain, r.path, r.tag, r.digest) == ("docker.io", "library/nginx", None, None)
    assert r.tagged() is None and r.digested() is None
    assert r.with_default_tag().tagged() == "docker.io/library/nginx:latest"
    d = parse(f"nginx@{D1}")
    assert d.with_default_tag() == d
    assert d.tagged() is None
    assert d.digested() == f"docker.io/library/nginx@{D1}"


@pytest.mark.parametrize("ref", [D1, HEX])
def test_parse_rejects_image_ids(ref: str) -> None:
    with pytest.raises(InvalidReference, match="image ID"):
        parse(ref)


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        (D1, True),
        (HEX, True),
        ("sha256:" + "a" * 63, False),
        ("sha256:" + "A" * 64, False),
        ("sha512:" + "a" * 64, False),
        ("a" * 65, False),
        ("nginx", False),
        (f"nginx@{D1}", False),
        ("", False),
    ],
)
def test_is_image_id(s: str, expected: bool) -> None:
    assert is_image_id(s) is expected


# Property: references built from the grammar normalize idempotently and
# round-trip through parse/str.
_component = st.from_regex(r"\A[a-z0-9]{1,5}(?:(?:[._]|__|-{1,2})[a-z0-9]{1,5}){0,2}\Z")
_path = st.lists(_component, min_size=1, max_size=3).map("/".join)
_host = st.sampled_from(
    ["", "docker.io/", "index.docker.io/", "localhost/", "localhost:5000/", "reg.example.com/",
     "10.0.0.1:443/", "[::1]:5000/"]
)
_tag = st.one_of(st.just(""), st.from_regex(r"\A:[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}\Z"))
_digest = st.one_of(st.just(""), st.from_regex(r"\A@sha256:[a-f0-9]{64}\Z"))


@given(host=_host, path=_path, tag=_tag, digest=_digest)
def test_normalize_property(host: str, path: str, tag: str, digest: str) -> None:
    ref = host + path + tag + digest
    assume(not is_image_id(ref))
    first, slash, _ = path.partition("/")
    # A first component with "." is a host; "_" makes it an invalid one, which
    # we reject on purpose (see the module docstring).
    assume(host or not slash or not ("." in first and "_" in first))
    out = normalize(ref)
    assert normalize(out) == out
    r = parse(out)
    assert str(r) == out
    assert r.tag is not None or r.digest is not None
    assert out.endswith(tag + digest)


def test_invalid_host_like_first_component_is_rejected() -> None:
    """Upstream would read "a_b.c/x" as a domain-less path; we reject it."""
    with pytest.raises(InvalidReference, match="host"):
        parse("a_b.c/x")
    assert normalize("a.b/x") == "a.b/x:latest"


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        # host names are case-insensitive: one normal form
        ("Registry.Example.COM/app", "registry.example.com/app:latest"),
        ("REG.example.com:5000/team/app:V1", "reg.example.com:5000/team/app:V1"),
        ("Docker.IO/nginx", "docker.io/library/nginx:latest"),
        ("Index.Docker.IO/library/nginx:1", "docker.io/library/nginx:1"),
        ("LocalHost/app", "localhost/app:latest"),
        # a host only because of its upper case keeps it (lower-cased it would be a Hub path)
        ("LOCALDOMAIN/debian", "LOCALDOMAIN/debian:latest"),
    ],
)
def test_host_is_lower_case_in_normal_form(ref: str, expected: str) -> None:
    assert normalize(ref) == expected
    assert normalize(expected) == expected


def test_spellings_of_one_image_share_one_pull_name() -> None:
    from shim.reference import pull_name

    spellings = ["nginx", "library/nginx", "docker.io/library/nginx", "docker.io/library/nginx:latest",
                 "index.docker.io/nginx:latest", "DOCKER.IO/library/nginx"]
    assert {pull_name(s) for s in spellings} == {"docker.io/library/nginx:latest"}
    assert pull_name("Reg.Local:5000/app") == pull_name("reg.local:5000/app:latest")
    assert pull_name("nginx:1.27") != pull_name("nginx")
    assert pull_name(f"nginx:1@{D1}") == f"docker.io/library/nginx:1@{D1}"  # the tag stays: the runtime records it
    assert pull_name("Not A Reference") == "Not A Reference"  # unparseable: as sent, the runtime answers
