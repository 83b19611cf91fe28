"""Nodes as themselves (deploy/cluster/node-identity.yaml): a shim using its kubelet's own
kubeconfig (client certificate, user system:node:<name>, group system:nodes) against an API
server with Node,RBAC authorization and NodeRestriction, where the ValidatingAdmissionPolicies
keep each node to its own NodeImageSetStatus and its own Events."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import CoreV1Api, EventsV1Api, RbacAuthorizationV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from shim.controller.pull_secrets import ROLE
from tests.support.apiserver import ControlPlane
from tests.support.kube import Admin

from .test_cluster_sets import SHIM, current, delete, image_set, pinned, shim_config, shim_status, wait_for


def as_node(cp: ControlPlane, tmp: Path, node: str) -> Admin:
    """A client with the node's kubelet kubeconfig (its client certificate)."""
    return Admin(cp.kubelet_kubeconfig(tmp / f"kubelet-{node}.kubeconfig", node))


def status_body(name: str) -> dict[str, Any]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus", "metadata": {"name": name},
            "status": {"nodeName": name}}


def apply_status(kc: Admin, name: str, **kw: Any) -> Any:
    return kc.custom("patch", *SHIM, "nodeimagesetstatuses", name, status_body(name), field_manager="cri-shim",
                     force=True, _content_type="application/apply-patch+yaml", **kw)


def event(about: dict[str, str], reason: str = "ImageSetAuthFailed") -> dict[str, Any]:
    return {"metadata": {"generateName": "forged.", "namespace": "default"}, "involvedObject": about,
            "reason": reason, "type": "Warning", "message": "image set x: 1 image(s) failed (auth)",
            "source": {"component": "cri-shim"}}


def status_ref(node: str) -> dict[str, str]:
    return {"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus", "name": node}


def refused(fn: Any) -> ApiException:
    """The refusal of an admission policy (it may take a moment to be active after install)."""
    def attempt() -> ApiException | None:
        try:
            fn()
        except ApiException as e:
            return e
        return None
    return wait_for(attempt, 30, "the request refused", interval=0.5)


def test_node_writes_only_its_own_status(control_plane, admin, tmp_path) -> None:
    kc = as_node(control_plane, tmp_path, "node-a")
    e = refused(lambda: apply_status(kc, "node-b"))
    assert e.status == 403
    assert ("ValidatingAdmissionPolicy 'cri-shim-node-own-status' with binding 'cri-shim-node-own-status' denied "
            "request: node node-a may write only the NodeImageSetStatus named node-a, not node-b") in e.body
    # its own passes RBAC and the policy (raises if refused; a dry run: the test shims own node-a's object)
    apply_status(kc, "node-a", dry_run="All")


def test_node_creates_events_only_about_its_own_objects(control_plane, admin, tmp_path) -> None:
    kc = as_node(control_plane, tmp_path, "node-a")

    def create(body: dict[str, Any], **kw: Any) -> Any:
        return kc.run(lambda api: CoreV1Api(api).create_namespaced_event("default", body, **kw))

    before = {e.metadata.name for e in admin.events()}
    e = refused(lambda: create(event(status_ref("node-b"))))
    assert e.status == 403
    assert "ValidatingAdmissionPolicy 'cri-shim-node-own-events'" in e.body
    assert "node node-a may create Events about its own NodeImageSetStatus or Node only, " \
           "not about NodeImageSetStatus node-b" in e.body
    e = refused(lambda: create(event({"kind": "Node", "name": "node-b"})))
    assert e.status == 403 and "not about Node node-b" in e.body

    # the same forgery through events.k8s.io/v1 (`regarding`): the same resource, the same refusal
    body = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": "forged-v1", "namespace": "default"},
            "regarding": status_ref("node-b"), "reason": "ImageSetAuthFailed", "type": "Warning",
            "note": "forged", "action": "Pull", "reportingController": "cri-shim", "reportingInstance": "node-a",
            "eventTime": "2026-01-01T00:00:00.000000Z"}
    with pytest.raises(ApiException) as ei:
        kc.run(lambda api: EventsV1Api(api).create_namespaced_event("default", body))
    assert ei.value.status == 403 and "not about NodeImageSetStatus node-b" in ei.value.body
    assert {e.metadata.name for e in admin.events()} == before  # nothing forged was stored

    # about its own status object or Node, and its kubelet's Events about anything else: allowed
    assert create(event(status_ref("node-a")), dry_run="All").involved_object.name == "node-a"
    assert create(event({"kind": "Node", "name": "node-a"}), dry_run="All").involved_object.name == "node-a"
    pod = {"apiVersion": "v1", "kind": "Pod", "namespace": "default", "name": "web-1"}
    assert create(event(pod, "Pulled"), dry_run="All").involved_object.kind == "Pod"


def test_node_reads_no_secret_and_no_other_node(control_plane, admin, tmp_path) -> None:
    """Without a set naming it, a node reads no Secret (the Node authorizer: only its pods'); nor
    another Node; it reads the sets."""
    kc = as_node(control_plane, tmp_path, "node-a")
    with pytest.raises(ApiException) as e:
        kc.run(lambda api: CoreV1Api(api).list_namespaced_secret("cri-shim"))
    assert e.value.status == 403
    with pytest.raises(ApiException) as e:
        kc.run(lambda api: CoreV1Api(api).read_node("node-b"))
    assert e.value.status == 403
    assert kc.custom("list", *SHIM, "imagesets")["kind"] == "ImageSetList"


def test_shim_with_the_kubelet_kubeconfig_follows_its_rotated_certificate(control_plane, admin, make_image,
                                                                       shim_factory, tmp_path) -> None:
    """The shim's cluster.kubeconfig is the kubelet's own. It starts with a certificate the API
    server does not trust (every request 401); kubelet's rotation replaces the file with a good
    one: with no restart, the shim reads the set, pulls and pins its image, writes its status."""
    img = make_image()
    admin.set_node_labels("node-b", {"t40": "yes"})
    admin.apply_custom(*SHIM, "imagesets", image_set("t40-kubelet-identity", [img.ref], {"t40": "yes"}))
    pem = tmp_path / "kubelet-client-current.pem"
    control_plane.issue_kubelet_cert("node-b", pem, ca=control_plane.other_ca())
    kc = control_plane.kubelet_kubeconfig(tmp_path / "kubelet.kubeconfig", "node-b", cert=pem)
    cfg = shim_config(control_plane, tmp_path, "node-b")
    cfg["cluster"]["kubeconfig"] = str(kc)
    try:
        shim = shim_factory(cfg, log_level="info")
        wait_for(lambda: "HTTP 401" in shim.log_text(), 30,
                 "the untrusted certificate refused")
        assert not pinned(shim).get(img.image_id)
        control_plane.issue_kubelet_cert("node-b", pem)  # kubelet's rotation: a new file renamed over the old
        wait_for(lambda: pinned(shim).get(img.image_id), 60, "image pulled and pinned after the rotation")
        wait_for(lambda: current(admin, "node-b", "t40-kubelet-identity"), 30, "status current")
        assert "client certificate reloaded" in shim.log_text()
        managers = {m["manager"] for m in admin.get_custom(*SHIM, "nodeimagesetstatuses", "node-b")
                    ["metadata"]["managedFields"]}
        assert managers == {"cri-shim"}
    finally:
        delete(admin, *SHIM, "imagesets", "t40-kubelet-identity")
        admin.set_node_labels("node-b", {"t40": None})


def test_node_reads_the_secrets_sets_name_and_no_other(control_plane, admin, controllers, tmp_path) -> None:
    """The controller keeps the Role nodes read pull Secrets by: exactly those a set names; when no
    set names them any more, none."""
    ns = "t41-team"
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
              "data": {".dockerconfigjson": base64.b64encode(b'{"auths": {}}').decode()}}
    admin.apply_docs([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
                      {**secret, "metadata": {"name": "named", "namespace": ns}},
                      {**secret, "metadata": {"name": "other", "namespace": ns}}])
    body = image_set("t41-private", ["registry.example/app:1"], {"t41": "yes"})
    body["spec"]["imagePullSecrets"] = [{"namespace": ns, "name": "named"}]
    admin.apply_custom(*SHIM, "imagesets", body)
    kc = as_node(control_plane, tmp_path, "node-a")

    def read(name: str) -> Any:
        return kc.run(lambda api: CoreV1Api(api).read_namespaced_secret(name, ns))

    def readable(name: str) -> bool:
        try:
            return read(name).metadata.name == name
        except ApiException as e:
            if e.status == 403:
                return False
            raise
    try:
        assert not readable("named")  # no controller yet: no Role
        controllers("c1")
        wait_for(lambda: readable("named"), 30, "node-a may read the Secret the set names", interval=0.3)
        watched = kc.run(lambda api: CoreV1Api(api).list_namespaced_secret(ns, field_selector="metadata.name=named"))
        assert [s.metadata.name for s in watched.items] == ["named"]  # as the shim watches it, by name
        with pytest.raises(ApiException) as e:
            read("other")
        assert e.value.status == 403 and 'cannot get resource \\"secrets\\"' in e.value.body
        with pytest.raises(ApiException) as e:
            kc.run(lambda api: CoreV1Api(api).list_namespaced_secret(ns))
        assert e.value.status == 403
        role = admin.run(lambda api: RbacAuthorizationV1Api(api).read_namespaced_role(ROLE, ns))
        assert role.rules[0].resource_names == ["named"]

        delete(admin, *SHIM, "imagesets", "t41-private")
        wait_for(lambda: not readable("named"), 30, "the Secret no longer readable once no set names it",
                 interval=0.3)
    finally:
        delete(admin, *SHIM, "imagesets", "t41-private")


def test_a_node_name_other_than_the_identity_is_said_at_start(control_plane, admin, shim_factory, tmp_path,
                                                             short_tmp) -> None:
    """node-b's kubelet kubeconfig with cluster.node_name node-a: `cri-shim status` says which name
    to set; reading node-a's Node is refused, with the API server's reason."""
    admin_sock = str(short_tmp / "admin.sock")
    cfg = shim_config(control_plane, tmp_path, "node-a", server={"admin_socket": admin_sock})
    cfg["cluster"]["kubeconfig"] = str(control_plane.kubelet_kubeconfig(tmp_path / "kubelet.kubeconfig", "node-b"))
    shim_factory(cfg, log_level="info")
    st = wait_for(lambda: (s := shim_status(admin_sock)).get("identity_error") and s, 30, "the identity checked")
    assert st["identity_error"] == ("the kubeconfig's user is system:node:node-b but cluster.node_name is node-a: "
                                    "the API server refuses this node's status writes (set cluster.node_name: node-b)")
    err = wait_for(lambda: shim_status(admin_sock)["watches"]["node"].get("error"), 30, "the Node watch refused")
    assert err.startswith("HTTP 403: Forbidden: ") and 'User "system:node:node-b"' in err, err


def test_forged_events_about_another_node_are_refused_0_of_n(control_plane, admin, tmp_path) -> None:
    """Issue 45: the object is matched whatever its apiVersion says (omitted, `v1`, another case or
    version), its kind however spelled, and an update may not move an Event to another object nor
    touch another node's. Every forgery is refused; the node's own Events still pass."""
    a, b = as_node(control_plane, tmp_path, "node-a"), as_node(control_plane, tmp_path, "node-b")

    def create(kc: Admin, body: dict[str, Any], **kw: Any) -> Any:
        return kc.run(lambda api: CoreV1Api(api).create_namespaced_event("default", body, **kw))

    refused(lambda: create(a, event(status_ref("node-b"))))  # the policy is in force
    nis = {"kind": "NodeImageSetStatus", "name": "node-b"}
    about = [nis, {**nis, "apiVersion": "v1"}, {**nis, "apiVersion": "CRI-SHIM.io/v1"},
             {**nis, "apiVersion": "cri-shim.io/v2"}, {**nis, "apiVersion": "cri-shim.io"},
             {**nis, "kind": "nodeimagesetstatus"}, {**nis, "kind": "NodeImageSetStatuses"},
             {**nis, "kind": "nis"}, {**nis, "namespace": "default"},
             {"kind": "Node", "name": "node-b", "namespace": "default"},
             {"kind": "Node", "name": "node-b"}, {"kind": "node", "name": "node-b", "apiVersion": "v1"},
             {"kind": "ImageSet", "name": "node-b", "apiVersion": "cri-shim.io/v1"},
             {"kind": "NodeImageSetStatus", "name": "node-a", "namespace": "default"}]
    attempts: list[tuple[str, Any]] = [(f"create {o}", lambda o=o: create(a, event(o))) for o in about]
    attempts += [(f"events.k8s.io create {o}", lambda o=o, i=i: a.run(lambda api: EventsV1Api(api).create_namespaced_event(
        "default", {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                    "metadata": {"name": f"forged-v1-{i}", "namespace": "default"}, "regarding": o,
                    "reason": "ImageSetAuthFailed", "type": "Warning", "note": "forged", "action": "Pull",
                    "reportingController": "cri-shim", "reportingInstance": "node-a",
                    "eventTime": "2026-01-01T00:00:00.000000Z"})))
                 for i, o in enumerate((nis, {**nis, "apiVersion": "v1"}))]

    # node-b's own Event (allowed), then what node-a (or node-b) may not do to it
    before = {e.metadata.name for e in admin.events()}
    own = create(b, event(status_ref("node-b"))).metadata.name

    def patch(kc: Admin, body: dict[str, Any]) -> Any:
        return kc.run(lambda api: CoreV1Api(api).patch_namespaced_event(
            own, "default", body, _content_type="application/merge-patch+json"))
    attempts += [
        ("node-a moves node-b's Event to itself", lambda: patch(a, {"involvedObject": status_ref("node-a")})),
        ("node-a counts on node-b's Event", lambda: patch(a, {"count": 7})),
        ("node-b moves its Event to its Node", lambda: patch(b, {"involvedObject": {"kind": "Node", "name": "node-b"}})),
        ("node-a replaces node-b's Event", lambda: a.run(lambda api: CoreV1Api(api).replace_namespaced_event(
            own, "default", {**event(status_ref("node-a")), "metadata": {
                "name": own, "namespace": "default", "resourceVersion": rv}}))),
    ]
    rv = admin.run(lambda api: CoreV1Api(api).read_namespaced_event(own, "default")).metadata.resource_version
    accepted, answers = [], {}
    for what, fn in attempts:
        try:
            fn()
            accepted.append(what)
        except ApiException as e:
            answers[what] = (e.status, e.body)
    print(f"\nforged Events accepted: {len(accepted)} of {len(attempts)}")
    assert accepted == [], accepted
    not_policy = {w: a for w, a in answers.items()
                  if a[0] != 403 or "ValidatingAdmissionPolicy 'cri-shim-node-own-events'" not in a[1]}
    assert not_policy == {}, not_policy
    assert "node node-a may not move an Event to another object" in answers["node-a moves node-b's Event to itself"][1]
    assert "not about NodeImageSetStatus default/node-b" in answers[f"create {about[8]}"][1]
    stored = admin.run(lambda api: CoreV1Api(api).read_namespaced_event(own, "default"))
    assert stored.involved_object.name == "node-b" and stored.count != 7  # untouched
    assert {e.metadata.name for e in admin.events()} - before == {own}  # nothing forged was stored

    # the node's own: still allowed, however its apiVersion is written; a count on its own Event too
    for o in ({"kind": "NodeImageSetStatus", "name": "node-a"}, status_ref("node-a"),
              {"kind": "Node", "name": "node-a"}):
        assert create(a, event(o), dry_run="All").involved_object.name == "node-a"
    assert patch(b, {"count": 2}).count == 2
    pod = {"apiVersion": "v1", "kind": "Pod", "namespace": "default", "name": "node-b"}  # a pod: not looked at
    assert create(a, event(pod, "Pulled"), dry_run="All").involved_object.kind == "Pod"
