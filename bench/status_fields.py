"""How big NodeImageSetStatus and its managedFields are, with ``status.sets`` as a list map keyed by
name or as an atomic list, against a real etcd + kube-apiserver.

    python bench/status_fields.py [--rows 100 2500]

For each list type the CRD from deploy/cluster/crds.yaml is replaced with that list type (and no
maxItems), then a document of N current rows is applied twice by server-side apply (field manager
``cri-shim``, as shim/cluster/node_report.py does) and the stored object is read back. The CRD
ships atomic lists: docs/image-sets.md#a-status-object-bounded-whatever-the-number-of-sets.
Needs scripts/setup.d/55-apiserver.sh.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # python bench/NAME.py: see bench/_bootstrap.py
    import _bootstrap

    _bootstrap.run_as_module(__file__)

import yaml  # noqa: E402
from kubernetes_asyncio import client  # noqa: E402

from tests.support.apiserver import ControlPlane, require_control_plane  # noqa: E402
from tests.support.kube import DEPLOY, Admin, install  # noqa: E402

SHIM = ("cri-shim.io", "v1", "nodeimagesetstatuses")


def row(i: int) -> dict[str, Any]:
    return {"name": f"set-{i:05d}", "kind": "ImageSet", "source": "cluster", "desiredGeneration": "1",
            "currentGeneration": "1", "images": {"declared": 3, "present": 3, "pulling": 0, "queued": 0, "failed": 0}}


def crd(list_type: str) -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "crds.yaml").read_text()))
    out: dict[str, Any] = copy.deepcopy(next(d for d in docs if d["spec"]["names"]["kind"] == "NodeImageSetStatus"))
    sets = out["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["sets"]
    sets["maxItems"] = 100_000
    sets["x-kubernetes-list-type"] = list_type
    if list_type == "map":
        sets["x-kubernetes-list-map-keys"] = ["name"]
    else:
        sets.pop("x-kubernetes-list-map-keys", None)
    return out


def replace_crd(admin: Admin, body: dict[str, Any]) -> None:
    async def go(api: client.ApiClient) -> None:
        ext = client.ApiextensionsV1Api(api)
        cur = await ext.read_custom_resource_definition(body["metadata"]["name"])
        body["metadata"]["resourceVersion"] = cur.metadata.resource_version
        await ext.replace_custom_resource_definition(body["metadata"]["name"], body)
    admin.run(go)


def measure(admin: Admin, name: str, rows: int) -> tuple[int, int]:
    body = {"apiVersion": "cri-shim.io/v1", "kind": "NodeImageSetStatus", "metadata": {"name": name},
            "status": {"nodeName": name, "sets": [row(i) for i in range(rows)]}}
    for _ in range(2):
        admin.custom("patch", *SHIM[:2], SHIM[2], name, body, field_manager="cri-shim", force=True,
                     _content_type="application/apply-patch+yaml")
    obj = admin.get_custom(*SHIM[:2], SHIM[2], name)
    assert obj is not None
    return len(json.dumps(obj)), len(json.dumps(obj["metadata"].get("managedFields") or []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[100, 2500])
    args = ap.parse_args()
    apiserver, etcd = require_control_plane()
    workdir = Path(tempfile.mkdtemp(prefix="kube-fields-"))
    cp = ControlPlane(workdir, apiserver=apiserver, etcd=etcd, nodes=("n",))
    try:
        cp.start()
        admin = install(cp.kubeconfig(workdir / "admin.kubeconfig"), ("n",))
        print("| list type | rows | object bytes | managedFields bytes |\n| --- | --- | --- | --- |")
        for list_type in ("atomic", "map"):
            replace_crd(admin, crd(list_type))
            admin.wait_served(*SHIM)
            time.sleep(3)  # the API server's handler picks the new schema up asynchronously
            for n in args.rows:
                size, managed = measure(admin, f"{list_type}-{n}", n)
                print(f"| {list_type} | {n} | {size} | {managed} |", flush=True)
    finally:
        cp.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
