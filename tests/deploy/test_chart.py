"""The Helm chart's own behaviour: lint, its values, its optional parts, and deploy/k8s agreeing with it.

Rendered by Helm's engine in a subprocess (tests/deploy/helm_render.py). The checks
every rendering must pass (schemas, ports, probes, routes, scaling) are in
test_k8s_manifests.py and test_autoscaling.py; here: what a value changes.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.config import VERSION, Settings, load_settings
from server.frontends.access import read_api_keys
from server.frontends.wyoming.server import exposure_problem
from server.streams.routing import router_config
from tests.deploy.manifests import CHART, Manifests, RenderError, k8s, lint, render

Doc = dict[str, Any]
#: Labels Helm adds that deploy/k8s does not carry.
HELM_LABELS = {"app.kubernetes.io/version", "app.kubernetes.io/managed-by", "helm.sh/chart"}


def env_of(m: Manifests) -> dict[str, str]:
    return m.env()


def secrets(m: Manifests) -> dict[str, Doc]:
    return {doc["metadata"]["name"]: doc for doc in m.of_kind("Secret")}


@pytest.mark.parametrize(
    "values_files",
    [(), ("values-cpu.yaml",), ("values-full.yaml",), ("values-cpu.yaml", "values-full.yaml")],
    ids=["gpu", "cpu", "gpu-full", "cpu-full"],
)
def test_helm_lint_strict_is_clean(values_files: tuple[str, ...]) -> None:
    report = lint(values_files)
    assert report["errors"] == []
    # Severity 2 is a warning, 3 an error (`--strict` fails on both); 1 is information.
    assert [msg for msg in report["messages"] if msg["severity"] >= 2] == []


def test_chart_version_is_the_servers() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    assert chart["apiVersion"] == "v2"


def _normalised(doc: Doc) -> Doc:
    """An object without what Helm adds (its labels, the Secrets checksum) and comments."""
    doc = copy.deepcopy(doc)
    labels = doc["metadata"].get("labels", {})
    for label in HELM_LABELS | {"app.kubernetes.io/component"}:
        labels.pop(label, None)
    if doc["kind"] == "Deployment":
        annotations = doc["spec"]["template"]["metadata"].get("annotations", {})
        annotations.pop("checksum/secrets", None)
        for c in doc["spec"]["template"]["spec"]["containers"]:
            c["env"] = sorted(c["env"], key=lambda e: e["name"])
    return doc


def test_deploy_k8s_is_the_chart_with_values_full() -> None:
    """The plain manifests cannot drift from the chart: every object equal, but for Helm's labels."""
    # deploy/k8s mounts an API-key Secret made out of band, under the chart's default name.
    base: dict[str, Any] = {"apiKeys": {"existingSecret": "chattts-stream-api-keys"}}
    full = ("values-full.yaml",)
    chart = render(full, {**base, "gateway": {"create": True, "className": "example-gateway-class"}})
    monitor = render(full, {**base, "serviceMonitor": {"enabled": True}})
    chart = Manifests(chart.name, chart.docs + monitor.docs)
    ours = {(d["kind"], d["metadata"]["name"]): _normalised(d) for _, d in k8s().docs}
    theirs = {(d["kind"], d["metadata"]["name"]): _normalised(d) for _, d in chart.docs}
    # The chart with a ServiceMonitor drops the scrape annotations: compare the Deployment without it.
    theirs[("Deployment", "chattts-stream")] = _normalised(render(full, base).one("Deployment"))
    assert set(ours) == set(theirs)
    for key, doc in ours.items():
        assert doc == theirs[key], key


def test_chart_defaults_are_gpu_and_values_cpu_is_cpu() -> None:
    gpu, cpu = render(), render(("values-cpu.yaml",))
    assert gpu.settings().device == "cuda" and gpu.container()["image"].endswith(":gpu")
    assert cpu.settings().device == "cpu" and cpu.container()["image"].endswith(":cpu")


def test_a_misspelt_or_mistyped_value_is_refused() -> None:
    """values.schema.json: Helm refuses values it does not know instead of ignoring them."""
    for bad, where in (
        ({"apiKey": {"keys": ["k"]}}, "apiKey"),
        ({"replicaCount": "two"}, "replicaCount"),
        ({"config": {"max_batch": 4}}, "max_batch"),
        ({"httpRoute": {"timeouts": {"stream": "forever"}}}, "stream"),
        ({"autoscaling": {"cpuUtilization": 170}}, "cpuUtilization"),
    ):
        with pytest.raises(RenderError, match=where):
            render(values=bad)


def test_flags_the_chart_derives_cannot_be_set_twice() -> None:
    for flag in ("port", "device", "drain-timeout-s", "api-keys-file", "resume-secret-file"):
        with pytest.raises(RenderError, match=rf"config\.{flag} is set by the chart"):
            render(values={"config": {flag: "1"}})


def test_config_numbers_reach_the_server_as_it_parses_them() -> None:
    """Helm reads numbers as floats; 268435456 must not arrive as 2.68435456e+08."""
    m = render(values={"config": {"replay-total-bytes": 268435456, "max-wait-ms": 2.5, "warmup": False}})
    assert m.env()["CHATTTS_REPLAY_TOTAL_BYTES"] == "268435456"
    settings = m.settings()
    assert (settings.replay_total_bytes, settings.max_wait_ms, settings.warmup) == (268435456, 2.5, False)


def test_shutdown_values_set_the_drain_and_the_grace_period() -> None:
    m = render(values={"shutdown": {"preStopSeconds": 10, "drainTimeoutSeconds": 300, "closeSeconds": 20}})
    assert m.settings().drain_timeout_s == 300
    assert m.pod()["terminationGracePeriodSeconds"] == 330
    assert m.container()["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]


# --- API keys -----------------------------------------------------------------------------


def test_api_keys_given_as_values_become_the_secret_the_server_reads(tmp_path: Path) -> None:
    m = render(values={"apiKeys": {"keys": ["key-one", "key-two"]}})
    volume = m.volume_of_mount(str(Path(m.env()["CHATTTS_API_KEYS_FILE"]).parent))
    secret = secrets(m)[volume["secret"]["secretName"]]
    (item,) = volume["secret"]["items"]
    # The file the pod would see, read by the server's own reader.
    keys_file = tmp_path / item["path"]
    keys_file.write_text(secret["stringData"][item["key"]])
    # Keys above any ``[tenant]`` line are each their own tenant (None).
    assert read_api_keys(Settings(api_keys_file=str(keys_file))) == [("key-one", None), ("key-two", None)]


def test_api_keys_from_an_existing_secret_or_none() -> None:
    existing = render(values={"apiKeys": {"existingSecret": "my-keys"}})
    assert existing.volume_of_mount("/etc/chattts-stream/api-keys")["secret"]["secretName"] == "my-keys"
    assert secrets(existing) == {}
    # Default: the Secret <release>-api-keys, made by the chart (test_a_key_is_generated...).
    assert render().volume_of_mount("/etc/chattts-stream/api-keys")["secret"]["secretName"] == (
        "chattts-stream-api-keys"
    )
    with pytest.raises(RenderError, match="not both"):
        render(values={"apiKeys": {"existingSecret": "my-keys", "keys": ["k"]}})
    off = render(values={"apiKeys": {"enabled": False}})
    assert "CHATTTS_API_KEYS_FILE" not in off.env()
    assert all(v["name"] != "api-keys" for v in off.pod()["volumes"])
    # Without keys Wyoming needs no exemption to open on 0.0.0.0.
    assert off.settings().wyoming_allow_unauthenticated is False
    assert exposure_problem(off.settings(), keys_required=False) is None


def test_a_changed_chart_made_secret_rolls_the_pods() -> None:
    """The server reads its keys once at start: the pod template changes with them."""

    def checksum(values: dict[str, Any]) -> str | None:
        annotations = render(values=values).one("Deployment")["spec"]["template"]["metadata"]["annotations"]
        return annotations.get("checksum/secrets")

    one, two = checksum({"apiKeys": {"keys": ["a"]}}), checksum({"apiKeys": {"keys": ["b"]}})
    assert one and two and one != two
    assert checksum({"resumeSecret": {"value": "x" * 32}}) != checksum({"resumeSecret": {"value": "y" * 32}})
    # Secrets made out of band, or the generated key (kept by upgrades): no checksum to roll on.
    assert checksum({}) is None
    assert checksum({"apiKeys": {"existingSecret": "my-keys"}}) is None


def test_without_keys_the_chart_generates_one_the_server_reads(tmp_path: Path) -> None:
    """No pod waits in ContainerCreating for a Secret nobody made: the default makes one."""
    m = render()
    keys_file = Path(m.env()["CHATTTS_API_KEYS_FILE"])
    volume = m.volume_of_mount(str(keys_file.parent))
    secret = secrets(m)[volume["secret"]["secretName"]]
    (item,) = volume["secret"]["items"]
    (tmp_path / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
    ((key, tenant),) = read_api_keys(Settings(api_keys_file=str(tmp_path / item["path"])))
    assert tenant is None and len(key) >= 32 and key.isalnum()
    # Random, not a key every install shares (another render, another key; `lookup`
    # keeps the installed one on upgrade, which needs a cluster to show).
    other = secrets(render(name="other-release"))["other-release-chattts-stream-api-keys"]
    assert base64.b64decode(other["data"]["keys"]).decode() != key


# --- resume secret ---------------------------------------------------------------------------


def resume_parts(m: Manifests) -> tuple[str | None, list[Doc]]:
    """(CHATTTS_RESUME_SECRET_FILE or None, the volumes that mount a resume Secret)."""
    volumes = [v for v in m.pod()["volumes"] if v["name"] == "resume-secret"]
    return m.env().get("CHATTTS_RESUME_SECRET_FILE"), volumes


def test_no_resume_secret_renders_nothing_of_it() -> None:
    for m in (render(), render(("values-cpu.yaml",))):
        assert resume_parts(m) == (None, [])
        assert not any(name.endswith("-resume") for name in secrets(m))


@pytest.mark.parametrize(
    "values",
    [{"value": "a-shared-resume-secret-of-enough-length"}, {"existingSecret": "shared-resume-key"}],
    ids=["value", "existingSecret"],
)
def test_a_resume_secret_is_mounted_as_the_file_the_flag_names(values: dict[str, str]) -> None:
    m = render(values={"resumeSecret": values})
    secret_file, volumes = resume_parts(m)
    assert secret_file and volumes
    path = Path(secret_file)
    volume = m.volume_of_mount(str(path.parent))
    assert volume["name"] == "resume-secret"
    assert volume["mount"].get("readOnly") is True and "subPath" not in volume["mount"]
    assert [item["path"] for item in volume["secret"]["items"]] == [path.name]
    assert volume["secret"]["defaultMode"] & 0o007 == 0, "readable by others"
    assert volume["secret"].get("optional") is False, "a replica without the key would sign nothing"
    made = secrets(m)
    if "value" in values:
        secret = made[volume["secret"]["secretName"]]
        assert secret["stringData"][volume["secret"]["items"][0]["key"]] == values["value"]
    else:
        assert volume["secret"]["secretName"] == "shared-resume-key"
        assert not any(name.endswith("-resume") for name in made)
    with pytest.raises(RenderError, match="not both"):
        render(values={"resumeSecret": {"value": "x" * 32, "existingSecret": "y"}})


def _pod_env(m: Manifests, pod_ip: str) -> dict[str, str]:
    """The CHATTTS_* variables as the kubelet gives them to a pod at ``pod_ip`` (``$(VAR)`` expanded)."""
    entries = m.container()["env"]
    known: dict[str, str] = {}
    for entry in entries:
        if entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            known[entry["name"]] = pod_ip
        elif "value" in entry:
            value = entry["value"]
            for name, seen in known.items():  # only variables defined above it, as Kubernetes does
                value = value.replace(f"$({name})", seen)
            known[entry["name"]] = value
    return {k: v for k, v in known.items() if k.startswith("CHATTTS_")}


def test_a_resume_secret_makes_every_pod_a_forwarding_replica_at_its_pod_ip(tmp_path: Path) -> None:
    m = render(values={"resumeSecret": {"value": "a-shared-resume-secret-of-enough-length"}})
    env = _pod_env(m, "10.244.1.17")
    settings = load_settings([], env=env)
    assert settings.resume_secret_file == env["CHATTTS_RESUME_SECRET_FILE"]
    assert settings.advertise_url == f"ws://10.244.1.17:{m.ws_port()}"
    # The server's own start-up check accepts it: the pod IP lies in the default --forward-allow.
    secret_file = tmp_path / "secret"
    secret_file.write_text("a-shared-resume-secret-of-enough-length")
    config = router_config(dataclasses.replace(settings, resume_secret_file=str(secret_file)), m.ws_port())
    assert config is not None and config.advertise_url == settings.advertise_url
    # Without a secret nothing is advertised (resume stays on the replica that holds the stream).
    plain = _pod_env(render(values={}), "10.244.1.17")
    assert "CHATTTS_ADVERTISE_URL" not in plain and "CHATTTS_RESUME_SECRET_FILE" not in plain
    with pytest.raises(RenderError, match="advertise-url"):
        render(values={"config": {"advertise-url": "ws://10.0.0.1:8080"}})


# --- optional parts ----------------------------------------------------------------------------


def test_without_autoscaling_the_deployment_keeps_its_count() -> None:
    m = render(values={"autoscaling": {"enabled": False}, "replicaCount": 3})
    assert m.of_kind("ScaledObject") == []
    assert m.one("Deployment")["spec"]["replicas"] == 3


def test_the_defaults_route_nothing_and_scale_nothing() -> None:
    """Routes and autoscaling are one value each (values-full.yaml sets them)."""
    m = render()
    assert m.of_kind("HTTPRoute") == [] and m.of_kind("ScaledObject") == []
    assert m.one("Deployment")["spec"]["replicas"] == 2
    on = render(values={"httpRoute": {"enabled": True}, "autoscaling": {"enabled": True}})
    assert len(on.of_kind("HTTPRoute")) == 2 and len(on.of_kind("ScaledObject")) == 1
    claim = render(values={"models": {"create": True}}).one("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_http_api_can_stay_in_the_cluster() -> None:
    m = render(values={"httpRoute": {"enabled": True, "httpApi": False}})
    assert len(m.of_kind("HTTPRoute")) == 1
    assert m.routed_port("/v1/audio/speech") is None
    assert m.routed_port("/v1/stream") == m.ws_port()
    assert m.service_port_target(m.http_api_port()) == m.http_api_port()


def test_routes_attach_to_the_parents_given() -> None:
    parents = [{"name": "shared-gateway", "namespace": "gateways", "sectionName": "websecure"}]
    route: dict[str, Any] = {"enabled": True, "parentRefs": parents, "hostnames": ["tts.corp.example"]}
    m = render(values={"httpRoute": route})
    for route in m.of_kind("HTTPRoute"):
        assert route["spec"]["parentRefs"] == parents
        assert route["spec"]["hostnames"] == ["tts.corp.example"]
    assert m.of_kind("Gateway") == []
    with pytest.raises(RenderError, match=r"gateway\.className"):
        render(values={"gateway": {"create": True}})


def test_wyoming_off_leaves_no_port_open() -> None:
    m = render(values={"ports": {"wyoming": 0}})
    assert "wyoming" not in m.container_ports()
    assert m.settings().wyoming_port == 0
    assert all(p["name"] != "wyoming" for p in m.one("Service")["spec"]["ports"])
    assert all("from" not in rule for rule in m.one("NetworkPolicy")["spec"]["ingress"])


def test_weights_from_an_existing_claim_or_an_empty_dir() -> None:
    claim = render(values={"models": {"create": False, "existingClaim": "weights"}})
    assert claim.volume_of_mount("/models")["persistentVolumeClaim"]["claimName"] == "weights"
    assert claim.of_kind("PersistentVolumeClaim") == []
    scratch = render(values={"models": {"create": False}})
    assert "emptyDir" in scratch.volume_of_mount("/models")


def test_two_releases_in_one_namespace_select_only_their_own_pods() -> None:
    one, two = render(name="tts-a"), render(name="tts-b")
    assert one.one("Deployment")["metadata"]["name"] != two.one("Deployment")["metadata"]["name"]
    for kind, path in (
        ("Service", ("spec", "selector")),
        ("PodDisruptionBudget", ("spec", "selector", "matchLabels")),
        ("NetworkPolicy", ("spec", "podSelector", "matchLabels")),
    ):
        selector = one.one(kind)
        for key in path:
            selector = selector[key]
        assert all(one.pod_labels().get(k) == v for k, v in selector.items()), kind
        assert not all(two.pod_labels().get(k) == v for k, v in selector.items()), kind
