"""The KEDA ScaledObject of every manifest set: what it scales, on which metrics, how fast.

KEDA was chosen over the prometheus-adapter HPA that deploy/k8s had: SIG Autoscaling is
deprecating prometheus-adapter in favour of KEDA (kubernetes-sigs/prometheus-adapter#701),
and KEDA reads Prometheus itself (no custom.metrics.k8s.io adapter to run and configure).
The triggers' PromQL is checked here for what the cluster cannot tell us until it scales
wrongly: the metric is a real gauge of the server, the query is scoped to this
Deployment's pods, and the per-pod target fits one pod's batch.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from server.metrics import Metrics
from tests.deploy.manifests import SET_NAMES, Manifests, manifest_set

SETS = {name: manifest_set(name) for name in SET_NAMES}
#: The form of a Deployment's pod names: <deployment>-<pod-template-hash>-<5 characters>.
POD_OF = "{name}-7c9f8d6b5-x2k9q"

Doc = dict[str, Any]


@pytest.fixture(params=SET_NAMES)
def m(request: pytest.FixtureRequest) -> Manifests:
    return SETS[request.param]


def exported_metric_names() -> set[str]:
    text = Metrics().render().decode()
    return set(re.findall(r"^# TYPE (\w+) ", text, re.M))


def prometheus_triggers(m: Manifests) -> dict[str, Doc]:
    """The Prometheus triggers by the one metric each query reads."""
    result = {}
    for trigger in m.one("ScaledObject")["spec"]["triggers"]:
        if trigger["type"] != "prometheus":
            continue
        names = set(re.findall(r"\b(chattts_\w+)\{", trigger["metadata"]["query"]))
        assert len(names) == 1, trigger["metadata"]["query"]
        result[names.pop()] = trigger
    return result


def label_matchers(query: str) -> dict[str, tuple[str, str]]:
    """``{label: (operator, value)}`` of the one selector in a PromQL query."""
    # Quoted values may hold braces themselves (a regex's {5}).
    selector = re.search(r'\{((?:[^}"]|"(?:[^"\\]|\\.)*")*)\}', query)
    assert selector, query
    found = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', selector.group(1))
    return {label: (op, value) for label, op, value in found}


def test_it_scales_the_deployment_between_sane_bounds(m: Manifests) -> None:
    scaled = m.one("ScaledObject")["spec"]
    deployment = m.one("Deployment")
    target = scaled["scaleTargetRef"]
    assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment"), target["name"]) == (
        deployment["apiVersion"],
        "Deployment",
        deployment["metadata"]["name"],
    )
    # A new pod needs minutes: never scale to zero, keep a second pod for drains and crashes.
    assert 2 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
    # KEDA owns the count: a replicas field would reset it on every apply or upgrade.
    assert "replicas" not in deployment["spec"]


def test_it_scales_on_active_streams_and_the_queue_with_cpu_as_fallback(m: Manifests) -> None:
    triggers = prometheus_triggers(m)
    assert {"chattts_active_streams", "chattts_queue_depth"} <= set(triggers)
    # Real gauges of the server.
    assert set(triggers) <= exported_metric_names()
    for trigger in triggers.values():
        # The query is the Deployment's total; AverageValue divides it by the replicas.
        assert trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["query"].startswith("sum(")
        assert trigger["metadata"]["serverAddress"].startswith(("http://", "https://"))
    # The per-pod stream target stays below what one batch can run.
    max_batch = m.settings().max_batch
    assert 0 < float(triggers["chattts_active_streams"]["metadata"]["threshold"]) <= max_batch
    cpu = [t for t in m.one("ScaledObject")["spec"]["triggers"] if t["type"] == "cpu"]
    assert len(cpu) == 1 and cpu[0]["metricType"] == "Utilization"
    assert 0 < int(cpu[0]["metadata"]["value"]) <= 100
    assert "cpu" in m.container()["resources"]["requests"], "CPU utilisation needs a CPU request"


def test_queries_read_only_this_deployments_pods(m: Manifests) -> None:
    deployment = m.one("Deployment")["metadata"]["name"]
    namespace = "chattts"  # deploy/k8s's kustomization and the renderings' namespace
    for metric, trigger in prometheus_triggers(m).items():
        matchers = label_matchers(trigger["metadata"]["query"])
        assert matchers["namespace"] == ("=", namespace), metric
        op, pattern = matchers["pod"]
        assert op == "=~", metric
        # PromQL anchors its regexes: fullmatch is what Prometheus does.
        assert re.fullmatch(pattern, POD_OF.format(name=deployment)), (metric, pattern)
        for other in (f"{deployment}-canary", f"{deployment}x", "other"):
            assert not re.fullmatch(pattern, POD_OF.format(name=other)), (metric, other)
        # The 1-minute average of each pod: a burst of short streams does not flap.
        assert re.search(r"avg_over_time\(" + metric + r"\{.*\}\[1m\]\)", trigger["metadata"]["query"])


def test_it_scales_up_at_once_and_down_slowly(m: Manifests) -> None:
    behavior = m.one("ScaledObject")["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    down = behavior["scaleDown"]
    # Each removed pod drains its streams: at least 5 minutes of calm, one pod at a time.
    assert down["stabilizationWindowSeconds"] >= 300
    assert down["selectPolicy"] == "Min"
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])
