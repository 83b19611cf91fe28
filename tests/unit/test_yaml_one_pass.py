"""safeyaml.load_all builds image-set files in one pass over the event stream: the result is
PyYAML's safe loader's, document by document, for what image-set files hold and for what they
might (tags, merge keys, odd scalars); the refusals are the event check's, with its messages."""

from __future__ import annotations

import datetime
import random

import pytest
import yaml

from shim import safeyaml

CASES = [
    "",
    "# only a comment\n",
    "---\n",
    "--- \n...\n---\nkind: A\n",
    "apiVersion: cri-shim.io/v1\nkind: ImageSet\nmetadata: {name: a, generation: 3}\n"
    "spec:\n  pin: true\n  images:\n  - name: registry.local/a:1\n  - {name: 'docker.io/b@sha256:00', runtimeHandler: kata}\n",
    "a: 12\nb: 0x1f\nc: 0o17\nd: 1_000\ne: 190:20:30\nf: 1.5e3\ng: .inf\nh: .NaN\n",
    "a: yes\nb: No\nc: on\nd: OFF\ne: true\nf: ~\ng: null\nh:\ni: ''\nj: \"12\"\nk: '1.5'\n",
    "t: 2001-12-14\nu: 2001-12-14t21:59:43.10-05:00\nv: 2001-12-14 21:59:43.10 -5\n",
    "dup: 1\ndup: 2\n",
    "1: one\n2.5: two\nnull: three\ntrue: four\n",
    "a: &anchor [1, 2]\nb: &other {x: y}\n",
    "a: ! 12\nb: !!str 12\nc: !!int '7'\n",
    "base: {x: 1}\nmerged:\n  <<: {x: 2, y: 3}\n  z: 4\n",
    "s: !!set {a, b}\no: !!omap [{a: 1}, {b: 2}]\n",
    "? [a, b]\n: c\n",
    "? {a: b}\n: c\n",
    "bin: !!binary aGVsbG8=\n",
    "x: =\n",
    "- [1, [2, [3, {k: [v]}]]]\n- |\n  literal\n  text\n- >\n  folded\n  text\n",
    "a: 1\n---\n- 2\n---\nplain\n---\n",
]


def reference(text: str) -> list[object]:
    return list(yaml.load_all(text, Loader=yaml.SafeLoader))


@pytest.mark.parametrize("text", CASES)
def test_same_documents_as_the_safe_loader(text: str) -> None:
    try:
        expected = reference(text)
    except yaml.YAMLError as e:
        with pytest.raises(type(e)):
            safeyaml.load_all(text)
        return
    got = safeyaml.load_all(text)
    assert got == expected
    assert [type(d) for d in got] == [type(d) for d in expected]


def test_types_are_the_safe_loaders() -> None:
    doc = safeyaml.load_all("a: 12\nb: 2001-12-14\nc: '12'\nd: 1.0\n")[0]
    assert doc == {"a": 12, "b": datetime.date(2001, 12, 14), "c": "12", "d": 1.0}
    assert type(doc["a"]) is int and type(doc["d"]) is float


@pytest.mark.parametrize("text, says", [
    ("a: &x [1]\nb: *x\n", "aliases (*name) are not allowed at line 2, column 4"),
    ("k: " + "[" * 64 + "]" * 64 + "\n", "nested more than 64 levels deep at line 1, column 67"),  # the map is one
    ("[" * 200_000 + "]" * 200_000, "nested more than 64 levels deep"),
])
def test_refusals_say_what_the_check_says(text: str, says: str) -> None:
    with pytest.raises(safeyaml.UnsafeYaml) as one_pass:
        safeyaml.load_all(text)
    with pytest.raises(safeyaml.UnsafeYaml) as check:
        safeyaml.check(text)
    assert str(one_pass.value) == str(check.value) and says in str(one_pass.value)


def test_64_levels_are_allowed_65_are_not() -> None:
    nested: list[object] = []
    for _ in range(63):
        nested = [nested]
    assert safeyaml.load_all("[" * 64 + "]" * 64) == [nested]
    with pytest.raises(safeyaml.UnsafeYaml):
        safeyaml.load_all("[" * 65 + "]" * 65)


def test_a_syntax_error_is_pyyamls() -> None:
    with pytest.raises(yaml.YAMLError):
        safeyaml.load_all("a: [1, 2\nb: 3\n")


def _tree(rng: random.Random, depth: int = 0) -> object:
    """A random document of what YAML's safe dumper writes: strings (also ones that read as
    numbers, booleans or null when unquoted), ints, floats, booleans, None, dates, lists and maps."""
    kind = rng.randrange(9 if depth < 4 else 7)
    if kind == 0:
        return rng.choice(["", "a b", "yes", "12", "1.5", "null", "~", "<<", "2001-12-14", "x: y", "- z", "é", "#"])
    if kind == 1:
        return "".join(rng.choice("ab:-# '\"\n/.0") for _ in range(rng.randrange(8)))
    if kind == 2:
        return rng.randrange(-10**6, 10**6)
    if kind == 3:
        return rng.choice([0.5, -2.25, 1e300, float("inf"), float("-inf")])
    if kind == 4:
        return rng.choice([True, False])
    if kind == 5:
        return None
    if kind == 6:
        return datetime.date(2000 + rng.randrange(30), 1 + rng.randrange(12), 1 + rng.randrange(28))
    if kind == 7:
        return [_tree(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice([rng.choice(["k", "yes", "1", "null", "a b"]), rng.randrange(5), True]): _tree(rng, depth + 1)
            for _ in range(rng.randrange(4))}


@pytest.mark.parametrize("flow", [None, False, True])
def test_any_dumped_document_reads_back_as_the_safe_loader_reads_it(flow: bool | None) -> None:
    rng = random.Random(f"one-pass-{flow}")  # seeded: the same 200 documents every run
    for _ in range(200):
        docs = [_tree(rng) for _ in range(1 + rng.randrange(3))]
        text = yaml.safe_dump_all(docs, default_flow_style=flow, allow_unicode=True)
        assert safeyaml.load_all(text) == reference(text), text
