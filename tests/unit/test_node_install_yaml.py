"""The kubelet config edit of `cri-shim node install` (shim/node_install/yamledit.py): only the
endpoint lines change, every other byte stays, and the edit undone key by key (what uninstall
does when the file changed since install) gives the original bytes back."""

from __future__ import annotations

import difflib

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.node_install import yamledit
from shim.node_install.kubelet import go_duration, parse_flags, same_endpoint
from shim.node_install.yamledit import REMOVE, EditError
from tests.unit.fake_node import KUBEADM_CONFIG

SHIM = "unix:///run/cri-shim/cri-shim.sock"

#: kubeadm 1.26: the runtime endpoint is a flag (kubeadm-flags.env), not in the file
KUBEADM_126 = """apiVersion: kubelet.config.k8s.io/v1beta1
authentication:
  anonymous:
    enabled: false
  webhook:
    cacheTTL: 0s
    enabled: true
  x509:
    clientCAFile: /etc/kubernetes/pki/ca.crt
authorization:
  mode: Webhook
cgroupDriver: systemd
clusterDNS:
- 10.96.0.10
clusterDomain: cluster.local
kind: KubeletConfiguration
rotateCertificates: true
staticPodPath: /etc/kubernetes/manifests
"""

#: written by hand: a document marker, comments everywhere, quoted values, an end marker
HAND = """---
# kubelet on the GPU pool, see ticket OPS-1234
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: 'unix:///var/run/containerd/containerd.sock'   # the runtime
imageServiceEndpoint:
# pulls
serializeImagePulls: true
maxPods: 110
evictionHard:
  memory.available: "200Mi"   # keep
...
"""


def changed_lines(a: str, b: str, keepends: bool = True) -> list[str]:
    return [line for line in difflib.ndiff(a.splitlines(keepends=keepends), b.splitlines(keepends=keepends))
            if line[:1] in "+-"]


def test_kubeadm_config_gets_lines_appended_and_nothing_else() -> None:
    out = yamledit.edit(KUBEADM_CONFIG, {"imageServiceEndpoint": SHIM, "serializeImagePulls": "false"}, "c")
    assert out == KUBEADM_CONFIG + f"imageServiceEndpoint: {SHIM}\nserializeImagePulls: false\n"


def test_a_value_is_replaced_in_place_keeping_its_comment() -> None:
    out = yamledit.edit(HAND, {"containerRuntimeEndpoint": SHIM, "imageServiceEndpoint": '""',
                               "serializeImagePulls": "false", "registryPullQPS": "0"}, "c")
    assert changed_lines(HAND, out) == [
        "- containerRuntimeEndpoint: 'unix:///var/run/containerd/containerd.sock'   # the runtime\n",
        f"+ containerRuntimeEndpoint: {SHIM}   # the runtime\n",
        "- imageServiceEndpoint:\n", '+ imageServiceEndpoint: ""\n',
        "- serializeImagePulls: true\n", "+ serializeImagePulls: false\n",
        "+ registryPullQPS: 0\n"]
    assert out.endswith("registryPullQPS: 0\n...\n")  # before the document end marker
    doc = yaml.safe_load(out)
    assert (doc["containerRuntimeEndpoint"], doc["imageServiceEndpoint"]) == (SHIM, "")


def test_crlf_and_no_newline_at_the_end() -> None:
    """With no newline at its end, the last line is left alone: new keys go before the first."""
    text = "# kubelet\r\n" + KUBEADM_126.replace("\n", "\r\n").rstrip("\r\n")
    out = yamledit.edit(text, {"imageServiceEndpoint": SHIM}, "c")
    assert out == f"# kubelet\r\nimageServiceEndpoint: {SHIM}\r\n" + text[len("# kubelet\r\n"):]
    assert yamledit.edit(out, {"imageServiceEndpoint": REMOVE}, "c") == text


def test_remove_takes_the_line_away_and_only_it() -> None:
    text = KUBEADM_126 + f"imageServiceEndpoint: {SHIM}  # cri-shim\n"
    assert yamledit.edit(text, {"imageServiceEndpoint": REMOVE}, "c") == KUBEADM_126


@pytest.mark.parametrize("text, why", [
    ('{"kind": "KubeletConfiguration", "imageServiceEndpoint": ""}', "flow-style (JSON) mapping"),
    ("kind: KubeletConfiguration\nimageServiceEndpoint: a\nimageServiceEndpoint: b\n", "written twice"),
    ("kind: KubeletConfiguration\nimageServiceEndpoint: >\n  unix:///run/x.sock\n", "not a one-line value"),
    ("- a\n- b\n", "the document is not a mapping"),
    ("a: [\n", "not valid YAML"),
    ("a: &x 1\nb: *x\n", "not valid YAML"),  # no aliases, as every YAML the shim reads
])
def test_what_cannot_be_edited_safely_is_refused(text: str, why: str) -> None:
    with pytest.raises(EditError, match="") as e:
        yamledit.edit(text, {"imageServiceEndpoint": SHIM}, "/var/lib/kubelet/config.yaml")
    assert why in str(e.value) and str(e.value).startswith("/var/lib/kubelet/config.yaml: ")


@pytest.mark.parametrize("value, raw", [(SHIM, SHIM), ("", '""'), (False, "false"), (0, "0"), ("true", '"true"'),
                                        ("a: b", '"a: b"'), ("#x", '"#x"'), ("10", '"10"')])
def test_render_reads_back_as_the_value(value: str | bool | int, raw: str) -> None:
    assert yamledit.render(value) == raw
    assert yaml.safe_load(f"k: {raw}\n") == {"k": value}


# ------------------------------------------------------------------------ the edit, undone key by key

LINES = ["apiVersion: kubelet.config.k8s.io/v1beta1", "kind: KubeletConfiguration", "cgroupDriver: systemd",
         "clusterDomain: cluster.local", "maxPods: 110", "staticPodPath: /etc/kubernetes/manifests",
         "authentication:\n  anonymous:\n    enabled: false", "clusterDNS:\n- 10.96.0.10", "memorySwap: {}",
         "logging:\n  verbosity: 0  # quiet"]
COMMENTS = ["# a comment", "", "   # indented comment", "#"]
ENDPOINT_FORMS = ["{k}: {v}", "{k}: '{v}'", '{k}: "{v}"', "{k}: {v}  # trailing", "{k}:", '{k}: ""']
KEYS = ["containerRuntimeEndpoint", "imageServiceEndpoint", "serializeImagePulls", "registryPullQPS"]
VALUES = {"containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
          "imageServiceEndpoint": "unix:///var/run/crio/crio.sock", "serializeImagePulls": "true",
          "registryPullQPS": "5"}


@st.composite
def kubelet_configs(draw: st.DrawFn) -> str:
    entries = [*LINES]
    for key in KEYS:
        if draw(st.booleans()):
            form = draw(st.sampled_from(ENDPOINT_FORMS if "Endpoint" in key else ["{k}: {v}", "{k}: {v}  # x"]))
            entries.append(form.format(k=key, v=VALUES[key]))
    entries = draw(st.permutations(entries))
    out = []
    for e in entries:
        out += draw(st.lists(st.sampled_from(COMMENTS), max_size=2))
        out.append(e)
    text = "\n".join(out) + draw(st.sampled_from(["\n", "", "\n# end\n"]))
    if draw(st.booleans()):
        text = text.replace("\n", "\r\n")
    return text


@settings(max_examples=300, deadline=None)
@given(kubelet_configs(), st.sampled_from(["image-only", "full"]))
def test_the_edit_undone_key_by_key_gives_the_same_bytes(text: str, mode: str) -> None:
    """uninstall's path for a file changed since install: each key install set, back to its value
    as written before (or its line removed). On any such file: the original bytes."""
    want = ({"imageServiceEndpoint": SHIM} if mode == "image-only" else {"containerRuntimeEndpoint": SHIM}) | {
        "serializeImagePulls": "false", "registryPullQPS": "0"}
    before = yamledit.entries(text, "c")
    edited = yamledit.edit(text, want, "c")
    doc = yamledit.parse(edited, "c")
    assert doc == {**yamledit.parse(text, "c"), **{k: yaml.safe_load(v) for k, v in want.items()}}
    # no line changed but those of the keys (a last line gets its newline)
    for line in changed_lines(text, edited, keepends=False):
        assert line[2:].split(":")[0].strip() in want, line
    undo = {k: (before[k].raw if k in before else REMOVE) for k in want}
    assert yamledit.edit(edited, undo, "c") == text


def test_flags_in_both_forms_last_one_wins() -> None:
    argv = ["/usr/bin/kubelet", "--config", "/var/lib/kubelet/config.yaml", "--v=2", "--kubeconfig=/etc/k.conf",
            "--container-runtime-endpoint", "unix:///a.sock", "--container-runtime-endpoint=unix:///b.sock",
            "--node-labels", "x=y", "--image-service-endpoint"]  # a flag without its value at the end: ignored
    assert parse_flags(argv) == {"--config": "/var/lib/kubelet/config.yaml", "--kubeconfig": "/etc/k.conf",
                                 "--container-runtime-endpoint": "unix:///b.sock"}


def test_endpoints_compare_as_sockets() -> None:
    assert same_endpoint("unix:///var/run/containerd/containerd.sock", "/run/containerd/containerd.sock")
    assert same_endpoint("unix:///run//cri-shim/./cri-shim.sock", SHIM)
    assert not same_endpoint("unix:///run/containerd/containerd.sock", "unix:///run/crio/crio.sock")


@pytest.mark.parametrize("value, seconds", [("10s", 10.0), ("1m0s", 60.0), ("1m30s", 90.0), ("500ms", 0.5),
                                            ("0s", 0.0), ("", None), ("ten", None), (10, None), (None, None)])
def test_go_durations(value: object, seconds: float | None) -> None:
    assert go_duration(value) == seconds
