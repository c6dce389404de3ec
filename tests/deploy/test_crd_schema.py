"""The CRD-derived schemas (tests/deploy/crd_schema.py) catch what they must, and the derivation is right."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy import crd_schema
from tests.deploy.manifests import K8S

Doc = dict[str, Any]
LATEST_K8S = kubernetes_validate.latest_version()


def k8s_doc(name: str) -> Doc:
    doc: Doc = yaml.safe_load((K8S / name).read_text())
    return doc


def assert_refused(doc: Doc) -> None:
    schemas = crd_schema.releases_for(doc["apiVersion"], doc["kind"])
    assert schemas, doc["kind"]
    for schema in schemas:
        with pytest.raises(jsonschema.ValidationError):
            crd_schema.validate(doc, schema, LATEST_K8S)


@pytest.mark.parametrize(
    "name", ["httproute.yaml", "gateway.yaml", "scaledobject.yaml", "servicemonitor.yaml"]
)
def test_the_real_manifest_passes_every_release(name: str) -> None:
    doc = k8s_doc(name)
    for schema in crd_schema.releases_for(doc["apiVersion"], doc["kind"]):
        crd_schema.validate(doc, schema, LATEST_K8S)


def test_a_misspelt_or_mistyped_route_is_refused() -> None:
    route = k8s_doc("httproute.yaml")
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["timeout"] = bad["spec"]["rules"][0].pop("timeouts")  # misspelt
    assert_refused(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["timeouts"]["request"] = "forever"  # not a Gateway API duration
    assert_refused(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["backendRefs"][0]["port"] = "http"  # backendRefs take a number
    assert_refused(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"  # Ingress's word, not the Gateway API's
    assert_refused(bad)
    bad = copy.deepcopy(route)
    bad["metadata"]["lables"] = {}  # ObjectMeta is checked too
    assert_refused(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["parentRefs"][0]["port"] = 70000
    assert_refused(bad)


def test_a_bad_scaled_object_is_refused() -> None:
    scaled = k8s_doc("scaledobject.yaml")
    bad = copy.deepcopy(scaled)
    del bad["spec"]["triggers"][0]["type"]
    assert_refused(bad)
    bad = copy.deepcopy(scaled)
    bad["spec"]["minReplicaCount"] = "two"
    assert_refused(bad)
    bad = copy.deepcopy(scaled)
    bad["spec"]["scaleTargetRef"]["nmae"] = "chattts-stream"
    assert_refused(bad)


def test_another_api_version_finds_no_schema() -> None:
    route = k8s_doc("httproute.yaml")
    assert crd_schema.releases_for("gateway.networking.k8s.io/v1alpha1", "HTTPRoute") == []
    assert crd_schema.is_custom(route)
    assert not crd_schema.is_custom(k8s_doc("service.yaml"))


def test_the_derivation_of_a_structural_schema() -> None:
    crd = {
        "kind": "CustomResourceDefinition",
        "spec": {
            "group": "example.com",
            "names": {"kind": "Thing"},
            "versions": [
                {"name": "v1beta1", "served": False, "schema": {"openAPIV3Schema": {"type": "object"}}},
                {
                    "name": "v1",
                    "served": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "description": "dropped",
                                    "x-kubernetes-validations": [{"rule": "self.a > 0"}],
                                    "properties": {
                                        "port": {"x-kubernetes-int-or-string": True},
                                        "note": {"type": "string", "nullable": True},
                                        "free": {
                                            "type": "object",
                                            "x-kubernetes-preserve-unknown-fields": True,
                                        },
                                        "map": {
                                            "type": "object",
                                            "additionalProperties": {"type": "integer"},
                                        },
                                        "a": {"type": "integer"},
                                        "b": {"type": "integer"},
                                    },
                                    "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
                                },
                                "status": {"type": "object"},
                            },
                        }
                    },
                },
            ],
        },
    }
    ((name, schema),) = list(crd_schema.schemas_from_crd(crd))
    assert name == "example.com_v1_Thing.json"
    assert "status" not in schema["properties"] and "description" not in schema["properties"]["spec"]
    validator = jsonschema.Draft202012Validator(
        {**schema, "properties": {**schema["properties"], "metadata": {"type": "object"}}}
    )

    def ok(spec: Doc) -> bool:
        return validator.is_valid(
            {"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {}, "spec": spec}
        )

    assert ok({"a": 1, "port": 80}) and ok({"a": 1, "port": "http"})
    assert ok({"b": 1, "note": None, "free": {"anything": [1]}, "map": {"x": 1}})
    assert not ok({"a": 1, "b": 2}), "oneOf"
    assert not ok({}), "oneOf: one of a, b is required"
    assert not ok({"a": 1, "typo": 1}), "closed object"
    assert not ok({"a": 1, "map": {"x": "one"}}), "additionalProperties schema"
    assert not ok({"a": 1, "port": 1.5})
    assert not validator.is_valid(
        {"apiVersion": "example.com/v2", "kind": "Thing", "metadata": {}, "spec": {"a": 1}}
    )
