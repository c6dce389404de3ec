"""JSON schemas for custom resources (Gateway API, KEDA, the Prometheus operator), offline.

``kubernetes-validate`` ships schemas for the built-in kinds only. The kinds that a
CustomResourceDefinition adds are checked here against schemas derived from the CRDs
their projects publish, vendored under ``tests/deploy/schemas/<project>/<release>/``
(``tests/deploy/schemas/README.md`` names each source file, tag and sha256).

Derive one (the only way the vendored files were made)::

    python -m tests.deploy.crd_schema tests/deploy/schemas/gateway-api/v1.6.1 CRD.yaml ...

What the derivation keeps and what it cannot:

* every structural constraint of the CRD's ``openAPIV3Schema`` (types, required fields,
  enums, patterns, lengths, bounds, ``oneOf``/``anyOf``), with ``nullable`` and
  ``x-kubernetes-int-or-string`` spelled as JSON schema;
* strict objects: an object with ``properties`` and neither ``additionalProperties`` nor
  ``x-kubernetes-preserve-unknown-fields`` rejects unknown fields (the API server would
  silently prune them, so a misspelt field would be lost: the same rule as
  ``kubernetes_validate.validate(strict=True)``);
* ``metadata`` is checked against the Kubernetes ObjectMeta schema of kubernetes-validate;
* ``status`` is dropped (a manifest never sets it);
* **not** the CEL rules (``x-kubernetes-validations``): the API server evaluates them, and
  no CEL evaluator with Kubernetes' extensions is at hand. The few that matter for our
  manifests are checked by hand in the tests (e.g. a route's backend timeout ≤ its request
  timeout). Descriptions are dropped too (size).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parent / "schemas"
#: Where kubernetes-validate's definitions file says it lives (its ``$id``).
K8S_DEFINITIONS = "https://kubernetes.io/api/_definitions.json"
OBJECT_META = K8S_DEFINITIONS + "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"

Schema = dict[str, Any]
#: Keywords of a structural schema that JSON schema has under the same name and meaning.
_KEPT = {
    "type",
    "enum",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
    "required",
    "format",
}


def convert(node: Schema, *, strict: bool = True) -> Schema:
    """One node of a CRD's structural schema as strict JSON schema (see the module doc).

    Inside ``oneOf``/``anyOf``/``allOf``/``not`` a node only adds constraints to the
    object its parent describes, so it is never closed (``strict`` False).
    """
    out: Schema = {key: node[key] for key in _KEPT if key in node}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {
            name: convert(child, strict=strict) for name, child in node["properties"].items()
        }
    if "items" in node:
        out["items"] = convert(node["items"], strict=strict)
    for key in ("oneOf", "anyOf", "allOf"):
        if key in node:
            out.setdefault("allOf", []).append({key: [convert(child, strict=False) for child in node[key]]})
    if "not" in node:
        out["not"] = convert(node["not"], strict=False)
    additional = node.get("additionalProperties")
    if isinstance(additional, dict):
        out["additionalProperties"] = convert(additional, strict=strict)
    elif additional is not None:
        out["additionalProperties"] = additional
    elif strict and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def schemas_from_crd(crd: Schema) -> Iterator[tuple[str, Schema]]:
    """(file name, schema) for every served version of a CustomResourceDefinition."""
    assert crd.get("kind") == "CustomResourceDefinition", crd.get("kind")
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    for version in crd["spec"]["versions"]:
        if not version.get("served", True):
            continue
        schema = convert(version["schema"]["openAPIV3Schema"])
        properties = schema["properties"]
        properties.pop("status", None)
        properties["apiVersion"] = {"const": f"{group}/{version['name']}"}
        properties["kind"] = {"const": kind}
        properties["metadata"] = {"$ref": OBJECT_META}
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        yield schema_file_name(f"{group}/{version['name']}", kind), schema


def schema_file_name(api_version: str, kind: str) -> str:
    group, _, version = api_version.rpartition("/")
    return f"{group}_{version}_{kind}.json"


def releases_for(api_version: str, kind: str) -> list[Path]:
    """Every vendored schema of this kind (one per project release), oldest release first."""
    name = schema_file_name(api_version, kind)
    return sorted(SCHEMAS.glob(f"*/*/{name}"), key=lambda p: _release_key(p.parent.name))


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.lstrip("v").split("."))


def is_custom(doc: Schema) -> bool:
    """Whether ``doc``'s kind has a vendored CRD schema rather than a built-in one."""
    return bool(releases_for(doc["apiVersion"], doc["kind"]))


def validate(doc: Schema, schema_path: Path, k8s_version: str) -> None:
    """Validate ``doc`` against one vendored schema, its metadata against ``k8s_version``'s.

    Raises:
        jsonschema.ValidationError: the first violation.
    """
    schema = json.loads(schema_path.read_text())
    definitions = schema_contents(
        f"kubernetes-json-schema/v{_k8s_schema_version(k8s_version)}-local-strict/_definitions.json",
        k8s_version,
    )
    registry: Registry = Registry().with_resource(K8S_DEFINITIONS, Resource.from_contents(definitions))
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


def _k8s_schema_version(version: str) -> str:
    """The kubernetes-validate schema folder for a Kubernetes version (its own rule)."""
    minor = kubernetes_validate.utils.major_minor(version)
    return [
        v
        for v in kubernetes_validate.utils.all_versions()
        if kubernetes_validate.utils.major_minor(v) <= minor
    ][-1]


def main(argv: list[str]) -> int:
    """``OUT_DIR CRD.yaml...``: write the schemas of the CRDs into ``OUT_DIR``."""
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for crd_path in argv[1:]:
        for crd in yaml.safe_load_all(Path(crd_path).read_text()):
            for name, schema in schemas_from_crd(crd):
                (out / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
                print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
