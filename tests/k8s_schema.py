"""Offline checks of KubeRay manifests against the operator's CRD schemas (used by tests/test_k8s.py).

A JSON-schema validator accepts keys the schema does not list, while the API server prunes them: a misspelled
optional field (`shutdownAfterJobFinish`) would silently fall back to its default. So besides `jsonschema`, every key
a manifest writes is looked up in the schema. The CRD's CEL rules (`x-kubernetes-validations`) are not evaluated.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

# Vendored into the repository (tests/schemas/kuberay/README.md says where they come from).
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas" / "kuberay"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# ObjectMeta fields a manifest may write; the CRDs leave top-level `metadata` as an open object.
OBJECT_META_KEYS = {"name", "namespace", "generateName", "labels", "annotations"}


@functools.cache
def read_crd_schema(kind: str) -> dict[str, Any]:
    """The `v1` openAPIV3Schema of a KubeRay kind. Do not mutate the result: it is cached."""
    # The CRDs are 1-1.4 MB of YAML: parse each once, with libyaml when it is there (pure Python takes seconds).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((SCHEMA_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def schema_key_problems(value: Any, schema: dict[str, Any], path: str = "") -> tuple[list[str], list[str]]:
    """Walk every key `value` writes. Returns (unknown, unchecked) dotted paths: unknown keys are absent from the
    schema (the API server would prune or reject them); unchecked ones sit under a part of the schema that does not
    list its keys (an open object or x-kubernetes-preserve-unknown-fields), so nothing can be said about them."""
    unknown: list[str] = []
    unchecked: list[str] = []
    _walk(value, schema, path, unknown, unchecked)
    return unknown, unchecked


def _walk(value: Any, schema: dict[str, Any], path: str, unknown: list[str], unchecked: list[str]) -> None:
    # anyOf/allOf/oneOf branches can add properties; in these CRDs they only type int-or-string leaves.
    branches = [schema] + [b for key in ("allOf", "anyOf", "oneOf") for b in schema.get(key, [])]
    props: dict[str, Any] = {}
    for b in branches:
        props.update(b.get("properties", {}))
    extra = next((b["additionalProperties"] for b in branches if "additionalProperties" in b), None)
    preserve = any(b.get("x-kubernetes-preserve-unknown-fields") for b in branches)
    if isinstance(value, dict):
        if not props and not isinstance(extra, dict):
            if value:  # an open object: its keys are not described, so they are not checked
                unchecked.append(path)
            return
        for key, sub in value.items():
            sub_path = f"{path}.{key}" if path else key
            if key in props:
                _walk(sub, props[key], sub_path, unknown, unchecked)
            elif isinstance(extra, dict):
                _walk(sub, extra, sub_path, unknown, unchecked)
            elif extra is True or preserve:
                unchecked.append(sub_path)
            else:
                unknown.append(sub_path)
    elif isinstance(value, list):
        items = next((b["items"] for b in branches if "items" in b), None)
        if items is None:
            if value and preserve:
                unchecked.append(path)
            return
        for i, sub in enumerate(value):
            _walk(sub, items, f"{path}[{i}]", unknown, unchecked)


def check_crd_document(doc: dict[str, Any]) -> list[str]:
    """All schema problems of a RayJob / RayCluster document, as readable strings (empty when it is valid)."""
    schema = read_crd_schema(doc["kind"])
    errors = jsonschema.Draft7Validator(schema).iter_errors(doc)
    problems = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]
    unknown, unchecked = schema_key_problems(doc, schema)
    problems += [f"{p}: not in the {doc['kind']} schema" for p in unknown]
    # Top-level metadata is the only open object these CRDs leave; check it against ObjectMeta's writable fields.
    problems += [f"{p}: open object in the schema, keys unchecked" for p in unchecked if p != "metadata"]
    problems += [f"metadata.{k}: not an ObjectMeta field" for k in set(doc.get("metadata", {})) - OBJECT_META_KEYS]
    return problems
