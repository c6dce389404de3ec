"""Offline checks of every deployment manifest set (no cluster needed).

The sets: the files of deploy/k8s, and the Helm chart deploy/helm/chattts-stream
rendered (Helm's own engine, ``tests/deploy/helm_render.py``) with values-full.yaml
(routes, KEDA, a shared weights volume: what deploy/k8s holds), with values-cpu.yaml
too, and with every optional part on, for GPU and CPU; and the chart's plain defaults
for GPU and CPU, which must need nothing but Kubernetes itself
(``tests/deploy/manifests.py``). Every object is validated against its schema with
the network blocked (built-in kinds: the Kubernetes OpenAPI schemas of
``kubernetes-validate``, strict; Gateway API, KEDA and Prometheus-operator kinds: the
vendored CRD schemas of ``tests/deploy/crd_schema.py``, for the oldest and newest
release supported). Then what a schema cannot see is checked within each set: probes,
shutdown timing, the pod's settings (parsed by the server's own parser), which port
each public path reaches through the HTTPRoutes and with which timeouts, the Wyoming
port (in-cluster, behind a NetworkPolicy), the API-key Secret, client IPs, selectors,
the ScaledObject's triggers and the metrics they read. Chart-only behaviour (values,
optional parts, the resume secret) is in test_chart.py.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server.config import Settings
from server.engine.flags import engine_options
from server.frontends.access import read_api_keys
from server.frontends.wyoming.server import exposure_problem
from tests.deploy import crd_schema
from tests.deploy.manifests import (
    ALL_SET_NAMES,
    K8S,
    K8S_OPTIONAL,
    PLAIN_SET_NAMES,
    SET_NAMES,
    Manifests,
    k8s_files,
    manifest_set,
)

ROOT = Path(__file__).resolve().parents[2]
HTTP_API_SOURCE = ROOT / "server" / "frontends" / "http" / "api.py"
#: Oldest Kubernetes minor the manifests support, and the newest the schemas know.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
#: Server flags the deployment sets before the server has them (another issue builds them):
#: CHATTTS_RESUME_SECRET_FILE, rendered only when a resume secret is configured.
PENDING_FLAGS = {"CHATTTS_RESUME_SECRET_FILE"} - {
    f"CHATTTS_{n.upper()}" for n in Settings.__dataclass_fields__
}
#: Slowest speech at the default speed, characters per second (ChatTTS speaks Chinese at
#: about 4-5 characters a second, English at about 15): sizes the HTTP API's route timeout.
SLOWEST_CHARS_PER_S = 3.0

Doc = dict[str, Any]

SETS = {name: manifest_set(name) for name in ALL_SET_NAMES}
#: The API groups every Kubernetes cluster serves without a CRD ("" is the core group, v1).
BUILT_IN_GROUPS = {
    "",
    "apps",
    "batch",
    "autoscaling",
    "policy",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
    "scheduling.k8s.io",
    "coordination.k8s.io",
    "discovery.k8s.io",
}
#: Tests of the pod and the Service, which hold for every set, plain defaults included.
every_set = pytest.mark.parametrize("m", ALL_SET_NAMES, indirect=True)


@pytest.fixture(params=SET_NAMES)
def m(request: pytest.FixtureRequest) -> Manifests:
    """Each manifest set with the cluster add-ons in turn (``every_set``: the plain ones too)."""
    return SETS[request.param]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail any attempt to resolve or connect: schema validation must be offline."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def gpu_pods(m: Manifests) -> bool:
    return m.settings().device.startswith("cuda")


# --- schemas ---------------------------------------------------------------------------


def test_the_expected_manifests_exist(m: Manifests) -> None:
    kinds = [doc["kind"] for _, doc in m.docs]
    for kind in ("Deployment", "Service", "ScaledObject", "PodDisruptionBudget", "NetworkPolicy"):
        assert kinds.count(kind) == 1, (m.name, kind)
    assert kinds.count("HTTPRoute") == 2, m.name
    for source, doc in m.docs:
        assert doc.get("apiVersion") and doc.get("metadata", {}).get("name"), source


def _schema_cases() -> Iterator[Any]:
    for set_name, m in SETS.items():
        for source, doc in m.docs:
            where = f"{set_name}:{source}:{doc['kind']}"
            if crd_schema.is_custom(doc):
                for schema in crd_schema.releases_for(doc["apiVersion"], doc["kind"]):
                    release = f"{schema.parent.parent.name}-{schema.parent.name}"
                    yield pytest.param(doc, schema, K8S_VERSIONS[-1], id=f"{where}:{release}")
            else:
                for version in K8S_VERSIONS:
                    yield pytest.param(doc, None, version, id=f"{where}:k8s-{version}")


@pytest.mark.parametrize(("doc", "schema", "version"), list(_schema_cases()))
def test_manifest_matches_its_schema(doc: Doc, schema: Path | None, version: str, no_network: None) -> None:
    try:
        if schema is None:
            kubernetes_validate.validate(doc, version, strict=True)
        else:
            crd_schema.validate(doc, schema, version)
    except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"no schema for {doc['apiVersion']} {doc['kind']}: {exc.message}")


def test_every_custom_kind_has_an_oldest_and_a_newest_schema() -> None:
    kinds = {
        (d["apiVersion"], d["kind"]) for m in SETS.values() for _, d in m.docs if crd_schema.is_custom(d)
    }
    assert {k for _, k in kinds} == {"HTTPRoute", "Gateway", "ScaledObject", "ServiceMonitor"}
    for api_version, kind in kinds:
        releases = crd_schema.releases_for(api_version, kind)
        assert releases, (api_version, kind)
        if kind != "ServiceMonitor":
            assert len(releases) == 2, (kind, releases)


def test_the_validator_does_reject_a_bad_manifest(no_network: None) -> None:
    """The schema test can fail: a misspelt field and a wrong type are caught."""
    bad = yaml.safe_load((K8S / "deployment.yaml").read_text())
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = yaml.safe_load((K8S / "deployment.yaml").read_text())
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


# --- the plain defaults ------------------------------------------------------------------


def api_group(doc: Doc) -> str:
    """The API group of an object ("" for the core group's ``v1``)."""
    api_version: str = doc["apiVersion"]
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


@pytest.mark.parametrize("name", PLAIN_SET_NAMES)
def test_the_defaults_need_nothing_but_kubernetes(name: str) -> None:
    """`helm install` with the default values works without Gateway API, KEDA, Prometheus or RWX."""
    m = SETS[name]
    assert m.docs
    custom = [
        (doc["apiVersion"], doc["kind"])
        for _, doc in m.docs
        if api_group(doc) not in BUILT_IN_GROUPS or crd_schema.is_custom(doc)
    ]
    assert custom == [], "kinds a plain cluster does not know"
    # No claim that waits for a ReadWriteMany storage class: each pod downloads the weights.
    assert m.of_kind("PersistentVolumeClaim") == []
    assert "emptyDir" in m.volume_of_mount("/models")
    # Without KEDA the Deployment keeps its own count.
    assert m.one("Deployment")["spec"]["replicas"] >= 1
    # The API-key Secret the pods mount is in the release: no pod waits for one made by hand.
    keys_dir = str(Path(m.env()["CHATTTS_API_KEYS_FILE"]).parent)
    assert m.named("Secret", m.volume_of_mount(keys_dir)["secret"]["secretName"])


def test_the_built_in_check_sees_every_custom_kind() -> None:
    """The check above can fail: values-full's add-ons are all outside the built-in groups."""
    custom = {doc["kind"] for _, doc in SETS["chart-full"].docs if api_group(doc) not in BUILT_IN_GROUPS}
    assert custom == {"HTTPRoute", "Gateway", "ScaledObject", "ServiceMonitor"}
    assert SETS["chart-full"].of_kind("PersistentVolumeClaim")[0]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_kustomization_lists_the_manifests() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in k8s_files()} - K8S_OPTIONAL
    raw = yaml.safe_load((K8S / "deployment.yaml").read_text())
    image = raw["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[0]
    assert [i["name"] for i in kustomization.get("images", [])] == [image]


# --- the pod -----------------------------------------------------------------------------


@every_set
def test_deployment_selector_matches_its_pods(m: Manifests) -> None:
    assert selects(m.one("Deployment")["spec"]["selector"]["matchLabels"], m.pod_labels())


@every_set
def test_probes_hit_health_and_ready_on_the_container_port(m: Manifests) -> None:
    c = m.container()
    ports = m.container_ports()

    def probe_port(probe: Doc) -> int:
        target = probe["httpGet"]["port"]
        return int(ports[target] if isinstance(target, str) else target)

    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["httpGet"]["path"] in ("/health", "/ready")
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert probe_port(c[name]) == m.ws_port(), name
    # Model load (and the first download of the weights) takes minutes.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def _prestop_seconds(c: Doc) -> float:
    pre_stop = c["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


@every_set
def test_grace_period_covers_prestop_and_drain(m: Manifests) -> None:
    pre_stop = _prestop_seconds(m.container())
    drain = m.settings().drain_timeout_s
    # The endpoint must be gone from every Gateway before SIGTERM starts the drain.
    assert pre_stop >= 5
    assert m.pod()["terminationGracePeriodSeconds"] > pre_stop + drain


@every_set
def test_gpu_pods_take_one_gpu_and_cpu_pods_none(m: Manifests) -> None:
    resources = m.container()["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]
    tolerations = {t["key"] for t in m.pod().get("tolerations", [])}
    if gpu_pods(m):
        assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
        assert str(resources["requests"].get("nvidia.com/gpu", "1")) == "1"
        assert "nvidia.com/gpu" in tolerations
    else:
        assert m.settings().device == "cpu"
        assert "nvidia.com/gpu" not in resources["requests"] and "nvidia.com/gpu" not in resources["limits"]
        assert "nvidia.com/gpu" not in tolerations
        # torch would use every core of the node: the threads are the cores the pod asks for.
        assert m.settings().threads == int(resources["requests"]["cpu"])


@every_set
def test_chattts_env_are_real_settings_and_parse(m: Manifests) -> None:
    names = {f"CHATTTS_{name.upper()}" for name in Settings.__dataclass_fields__}
    chattts = {k for k in m.env() if k.startswith("CHATTTS_")}
    assert chattts <= names | PENDING_FLAGS, chattts - names
    settings = m.settings()  # the server's own parser and types
    engine_options(settings)  # and the engine's own checks of its flags
    assert settings.host == "0.0.0.0"
    assert settings.cache_dir == "/models" or settings.model_dir
    assert settings.max_queue >= settings.max_batch


def test_weights_volume_and_writable_tmp(m: Manifests) -> None:
    weights = m.volume_of_mount("/models")
    claim = weights["persistentVolumeClaim"]["claimName"]
    assert m.named("PersistentVolumeClaim", claim), f"{m.name}: no PVC {claim}"
    if m.container()["securityContext"].get("readOnlyRootFilesystem"):
        assert "emptyDir" in m.volume_of_mount("/tmp")
        for var in ("XDG_CACHE_HOME", "NUMBA_CACHE_DIR"):
            assert m.env()[var].startswith("/tmp/"), var
    assert m.pod()["securityContext"]["runAsNonRoot"] is True


@every_set
def test_metrics_are_scraped_once_from_the_websocket_port(m: Manifests) -> None:
    """Pod annotations or a ServiceMonitor, never both (series would double)."""
    annotations = m.one("Deployment")["spec"]["template"]["metadata"].get("annotations", {})
    monitors = [doc for doc in m.applied() if doc["kind"] == "ServiceMonitor"]
    if monitors:
        assert "prometheus.io/scrape" not in annotations
        return
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    # /metrics is served on the WebSocket port, not on the HTTP API's.
    assert int(annotations["prometheus.io/port"]) == m.ws_port()


@every_set
def test_ports_are_named_container_ports_and_match_the_settings(m: Manifests) -> None:
    ports = m.container_ports()
    # Explicit, so that a port that cannot be bound fails the start (the default -1 only
    # logs a warning and runs without the HTTP API).
    assert int(m.env()["CHATTTS_HTTP_PORT"]) > 0
    assert ports["http"] == m.ws_port()
    assert ports["http-api"] == m.http_api_port() != m.ws_port()
    assert ports["wyoming"] == m.wyoming_port() > 0
    assert sorted(ports.values()) == sorted({m.ws_port(), m.http_api_port(), m.wyoming_port()}), (
        "a port the server does not bind"
    )
    assert all(p["protocol"] == "TCP" for p in m.container()["ports"])


@every_set
def test_api_keys_come_from_a_mounted_secret(m: Manifests) -> None:
    env = m.env()
    # Keys never sit in the manifest itself.
    assert "CHATTTS_API_KEYS" not in env
    keys_file = Path(env["CHATTTS_API_KEYS_FILE"])
    assert keys_file.is_absolute()
    assert m.settings().api_keys_file == str(keys_file)
    volume = m.volume_of_mount(str(keys_file.parent))
    assert volume["mount"].get("readOnly") is True
    assert "subPath" not in volume["mount"], "a subPath mount never sees an updated Secret"
    secret = volume.get("secret")
    assert secret and secret.get("secretName"), f"volume {volume['name']} is not a Secret"
    items = secret.get("items")
    if items:
        assert keys_file.name in {item["path"] for item in items}, "the Secret item is not the keys file"
    # Readable by the pod's group (fsGroup), not by others.
    mode = secret.get("defaultMode", 0o644)
    assert mode & 0o007 == 0, oct(mode)
    assert mode & 0o040 and m.pod()["securityContext"].get("fsGroup")
    if secret.get("optional"):
        # An optional Secret that is absent leaves an empty folder: the server must then
        # start (without keys) instead of crash-looping on the missing file.
        read_api_keys(Settings(api_keys_file=str(ROOT / "no-such-dir" / keys_file.name)))


@every_set
def test_client_ips_are_not_taken_from_a_header_the_client_can_write(m: Manifests) -> None:
    """The server would take the first X-Forwarded-For hop; behind a Gateway that is the client's.

    Envoy-based Gateways (Envoy Gateway, Istio, kgateway, Cilium) append the peer's address
    to the X-Forwarded-For the client sent, so its first hop is whatever the client wrote:
    trusted, it would let a client choose its rate-limit identity.
    """
    assert m.settings().trust_forwarded_for is False


# --- service, routes, disruption budget --------------------------------------------------


@every_set
def test_service_selects_the_pods_and_targets_the_container_ports(m: Manifests) -> None:
    service = m.one("Service")
    assert selects(service["spec"]["selector"], m.pod_labels())
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in set(m.container_ports()) | set(m.container_ports().values())
    # Every server port is reachable through the Service (the HTTP API and Wyoming too).
    targets = {m.service_port_target(p["port"]) for p in service["spec"]["ports"]}
    assert {m.ws_port(), m.http_api_port(), m.wyoming_port()} <= targets


def http_api_routes() -> set[str]:
    """The paths the aiohttp server registers (read from its source: no server is started)."""
    routes = set(
        re.findall(r"router\.add_(?:get|post|put|delete|route)\(\s*\"([^\"]+)\"", HTTP_API_SOURCE.read_text())
    )
    assert routes, f"no aiohttp routes found in {HTTP_API_SOURCE}"
    return routes


def test_each_public_path_reaches_the_port_that_serves_it(m: Manifests) -> None:
    # WebSocket server: the stream endpoint and the demo page.
    assert m.routed_port("/v1/stream") == m.ws_port()
    assert m.routed_port("/") == m.ws_port()
    assert m.routed_port("/client_js/chattts-stream.js") == m.ws_port()
    # The OpenAI-compatible HTTP API: every route the aiohttp server registers.
    routes = http_api_routes()
    assert {"/v1/audio/speech", "/v1/models"} <= routes
    for route in routes:
        assert m.routed_port(route) == m.http_api_port(), route
    # Nothing else of either server is public ("/" is Exact: a PathPrefix / would publish all).
    for private in ("/metrics", "/health", "/ready", "/v1/streamx", "/v1/audiox"):
        assert m.routed_port(private) is None, f"{private} is public"
    # Every path of the HTTP API port is one the aiohttp server answers.
    for _, kind, path, backend in m.route_paths():
        if m.service_port_target(backend["port"]) == m.http_api_port():
            assert any(
                r == path or (kind == "PathPrefix" and r.startswith(path.rstrip("/") + "/")) for r in routes
            ), path


def test_routes_send_to_the_service_without_affinity_or_rewrites(m: Manifests) -> None:
    service = m.one("Service")["metadata"]["name"]
    for _, _, _, backend in m.route_paths():
        assert backend["name"] == service and backend.get("kind", "Service") == "Service", backend
        assert "namespace" not in backend, "a backend in another namespace needs a ReferenceGrant"
    for route in m.of_kind("HTTPRoute"):
        for rule in route["spec"]["rules"]:
            # Resume needs no stickiness, and a rewrite or redirect would break the server's paths.
            assert "sessionPersistence" not in rule and "filters" not in rule, route["metadata"]["name"]
            assert len(rule["backendRefs"]) == 1, "one Service: the balancing is the Gateway's"


def _seconds(duration: str) -> float:
    """A Gateway API duration ("900s", "1h30m", "0s") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def route_timeouts(m: Manifests, port: int) -> list[Doc]:
    """The timeouts of every rule that sends to ``port`` (a container port)."""
    result = []
    for route in m.of_kind("HTTPRoute"):
        for rule in route["spec"]["rules"]:
            if any(m.service_port_target(b["port"]) == port for b in rule["backendRefs"]):
                result.append(rule.get("timeouts", {}))
    assert result, f"{m.name}: no route to port {port}"
    return result


def test_websocket_routes_never_time_a_stream_out(m: Manifests) -> None:
    """An upgraded WebSocket is one request: its request timeout is the connection's life."""
    for timeouts in route_timeouts(m, m.ws_port()):
        # Unset, implementations choose (many 15 s): it must be explicit.
        request = _seconds(timeouts["request"])
        assert request == 0 or request >= 3600, timeouts
        # The CEL rule of the CRD (not evaluated offline): backendRequest <= request.
        if "backendRequest" in timeouts:
            backend = _seconds(timeouts["backendRequest"])
            assert request == 0 or 0 < backend <= request, timeouts


def test_the_http_api_route_outlasts_the_longest_generation(m: Manifests) -> None:
    """A speech response lasts as long as its generation: the longest text at real time."""
    longest_s = m.settings().max_text_chars / SLOWEST_CHARS_PER_S
    for timeouts in route_timeouts(m, m.http_api_port()):
        request = _seconds(timeouts["request"])
        assert request == 0 or request >= longest_s, (timeouts, longest_s)
        if "backendRequest" in timeouts:
            backend = _seconds(timeouts["backendRequest"])
            assert request == 0 or 0 < backend <= request, timeouts


def test_routes_share_one_host_and_gateway_listener(m: Manifests) -> None:
    routes = m.of_kind("HTTPRoute")
    assert len({yaml.safe_dump(r["spec"]["parentRefs"]) for r in routes}) == 1, "routes on different Gateways"
    assert len({tuple(r["spec"].get("hostnames", [])) for r in routes}) == 1, "routes on different hosts"
    # Where the set has a Gateway (the example), the routes attach to one of its HTTPS listeners.
    for gateway in m.of_kind("Gateway"):
        listeners = {lst["name"]: lst for lst in gateway["spec"]["listeners"]}
        for ref in routes[0]["spec"]["parentRefs"]:
            assert ref["name"] == gateway["metadata"]["name"]
            listener = listeners[ref["sectionName"]]
            assert listener["protocol"] == "HTTPS" and listener["tls"]["mode"] == "Terminate"
            assert listener["hostname"] in routes[0]["spec"]["hostnames"]


def test_the_wyoming_port_is_in_cluster_only_and_guarded_by_a_network_policy(m: Manifests) -> None:
    """Wyoming has no API keys and the pods use keys: the explicit flag is set, the network guards it."""
    settings = m.settings()
    assert settings.api_keys_file, "the pods use API keys"
    assert exposure_problem(settings, keys_required=True) is None, "the server would refuse to start"
    # No route reaches it (raw TCP; HTTPRoutes route HTTP paths).
    assert all(m.service_port_target(b["port"]) != m.wyoming_port() for _, _, _, b in m.route_paths())
    policy = m.one("NetworkPolicy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], m.pod_labels())
    assert "Ingress" in policy["spec"]["policyTypes"]
    names = m.container_ports()

    def ports_of(rule: Doc) -> set[int]:
        return {names[p["port"]] if isinstance(p["port"], str) else int(p["port"]) for p in rule["ports"]}

    rules = policy["spec"]["ingress"]
    # The WebSocket and HTTP API ports stay open to every source (Gateway, Prometheus, replicas).
    open_rules = [r for r in rules if not r.get("from")]
    assert {m.ws_port(), m.http_api_port()} <= set().union(*(ports_of(r) for r in open_rules))
    # Wyoming only from labelled pods: never in a rule without `from`, never from everywhere.
    wyoming_rules = [r for r in rules if m.wyoming_port() in ports_of(r)]
    assert wyoming_rules and all(r.get("from") for r in wyoming_rules)
    for rule in wyoming_rules:
        for peer in rule["from"]:
            assert "ipBlock" not in peer and peer["podSelector"]["matchLabels"], peer


def test_pdb_selects_the_pods_and_allows_one_eviction(m: Manifests) -> None:
    pdb = m.one("PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], m.pod_labels())
    min_replicas = m.one("ScaledObject")["spec"]["minReplicaCount"]
    if "maxUnavailable" in pdb["spec"]:
        assert int(pdb["spec"]["maxUnavailable"]) >= 1
    else:
        assert int(pdb["spec"]["minAvailable"]) < min_replicas, "a drain could never evict a pod"


def test_servicemonitor_scrapes_the_service(m: Manifests) -> None:
    service = m.one("Service")
    for monitor in m.of_kind("ServiceMonitor"):
        assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            # /metrics is served on the WebSocket port only.
            assert m.service_port_target(endpoint["port"]) == m.ws_port()
