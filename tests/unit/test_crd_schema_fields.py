"""Every schema node of deploy/cluster/crds.yaml has only JSONSchemaProps fields: the API server
decodes a CRD strictly when `kubectl apply` sends it (field validation Strict), so a YAML slip
that makes a key of a description (an unquoted ": " in a flow mapping) refuses the whole file.
The real `kubectl apply`: tests/cluster/test_controller_pods.py."""

from __future__ import annotations

from typing import Any

import yaml

from tests.support.kube import DEPLOY

#: apiextensions.k8s.io/v1 JSONSchemaProps (json names); x-kubernetes-* are checked by prefix.
FIELDS = {"id", "$schema", "$ref", "description", "type", "format", "title", "default", "maximum",
          "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
          "minItems", "uniqueItems", "multipleOf", "enum", "maxProperties", "minProperties", "required", "items",
          "allOf", "oneOf", "anyOf", "not", "properties", "additionalProperties", "patternProperties",
          "dependencies", "additionalItems", "definitions", "externalDocs", "example", "nullable"}


def _unknown(node: Any, path: str) -> list[str]:
    if not isinstance(node, dict):
        return [f"{path}: not a mapping"]
    bad = [f"{path}.{k}" for k in node if k not in FIELDS and not str(k).startswith("x-kubernetes-")]
    for name, sub in (node.get("properties") or {}).items():
        bad += _unknown(sub, f"{path}.properties.{name}")
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            bad += _unknown(node[key], f"{path}.{key}")
    for key in ("allOf", "oneOf", "anyOf"):
        for i, sub in enumerate(node.get(key) or []):
            bad += _unknown(sub, f"{path}.{key}[{i}]")
    return bad


def test_every_schema_node_has_only_known_fields() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "crds.yaml").read_text()) if d]
    assert docs
    bad: list[str] = []
    for crd in docs:
        for v in crd["spec"]["versions"]:
            bad += _unknown(v["schema"]["openAPIV3Schema"], f"{crd['metadata']['name']}/{v['name']}")
    assert not bad, bad
