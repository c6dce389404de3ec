"""Offline checks of the Kubernetes manifests in deploy/k8s (no cluster needed).

Every manifest is validated against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package ships (strict: unknown fields fail), with the
network blocked to prove it stays offline; then the things a schema cannot
see are checked across files: probes, shutdown timing, the HPA's target and
metrics, the ingress hash key, which port each public path reaches (WebSocket
and the OpenAI-compatible HTTP API), the Wyoming port (in-cluster, guarded by a
NetworkPolicy), the API-key Secret, client IPs behind the ingress, selectors,
and the CHATTTS_* settings.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from server.config import Settings, load_settings
from server.errors import StartupError
from server.frontends.access import read_api_keys
from server.frontends.wyoming.server import exposure_problem
from server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ADAPTER = ROOT / "deploy" / "prometheus-adapter"
INGRESS_NGINX_VALUES = ROOT / "deploy" / "ingress-nginx" / "values.yaml"
HTTP_API_SOURCE = ROOT / "server" / "frontends" / "http" / "api.py"
#: Oldest Kubernetes minor the manifests support, and the newest the schemas know.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
#: Custom resources (no schema in kubernetes-validate): checked by hand below.
CRD_KINDS = {"ServiceMonitor"}
NOT_MANIFESTS = {"kustomization.yaml"}

Doc = dict[str, Any]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.y*ml") if p.name not in NOT_MANIFESTS)


def load_docs(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


ALL_DOCS = [(path, doc) for path in manifest_files() for doc in load_docs(path)]


def one(kind: str) -> Doc:
    found = [doc for _, doc in ALL_DOCS if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container() -> Doc:
    containers = one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: Doc = containers[0]
    return result


def container_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container().get("env", []) if "value" in e}


def container_ports() -> dict[str, int]:
    """Named container ports: name -> number."""
    ports = container()["ports"]
    assert all(p.get("name") for p in ports), "every container port is named"
    return {p["name"]: int(p["containerPort"]) for p in ports}


def settings() -> Settings:
    """The pod's settings, parsed by the server's own parser from its CHATTTS_* env."""
    env = {k: v for k, v in container_env().items() if k.startswith("CHATTTS_")}
    return load_settings([], env=env)


def ws_port() -> int:
    return settings().port


def http_api_port() -> int:
    """The port the server binds for the HTTP API (the server's own rule for -1)."""
    s = settings()
    assert s.http_port != 0, "CHATTTS_HTTP_PORT=0 turns the OpenAI-compatible HTTP API off"
    return s.http_port if s.http_port > 0 else s.port + 1


def wyoming_port() -> int:
    port = settings().wyoming_port
    assert port > 0, "CHATTTS_WYOMING_PORT: Wyoming (Home Assistant) is off, or on a random port"
    return port


def ingresses() -> list[Doc]:
    return [doc for _, doc in ALL_DOCS if doc["kind"] == "Ingress"]


def service_port_target(ref: dict[str, Any]) -> int:
    """A backend's Service port (by name or number) -> the container port it reaches."""
    service = one("Service")
    wanted = ref.get("name", ref.get("number"))
    matches = [p for p in service["spec"]["ports"] if wanted in (p.get("name"), p["port"])]
    assert len(matches) == 1, f"Service has no port {wanted!r}"
    target = matches[0]["targetPort"]
    return container_ports()[target] if isinstance(target, str) else int(target)


def ingress_paths() -> list[tuple[Doc, str, str, Doc]]:
    """(Ingress, path, pathType, service backend) for every path of every Ingress."""
    result = []
    for ingress in ingresses():
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                result.append((ingress, path["path"], path["pathType"], path["backend"]["service"]))
    return result


def routed_port(request_path: str) -> int | None:
    """The container port a request path reaches through the Ingresses (None: not public).

    Kubernetes' rule: an Exact match wins, else the longest Prefix match, where a Prefix
    matches by whole path elements (/v1/audio matches /v1/audio/speech, not /v1/audiox).
    """
    exact = [b for _, p, kind, b in ingress_paths() if kind == "Exact" and p == request_path]
    if exact:
        return service_port_target(exact[0]["port"])
    prefixes = []
    for _, p, kind, b in ingress_paths():
        base = p.rstrip("/")
        if kind == "Prefix" and (request_path == base or request_path.startswith(base + "/")):
            prefixes.append((len(base), b))
    if not prefixes:
        return None
    return service_port_target(max(prefixes, key=lambda item: item[0])[1]["port"])


def http_api_routes() -> set[str]:
    """The paths the aiohttp server registers (read from its source: no server is started)."""
    routes = set(
        re.findall(r"router\.add_(?:get|post|put|delete|route)\(\s*\"([^\"]+)\"", HTTP_API_SOURCE.read_text())
    )
    assert routes, f"no aiohttp routes found in {HTTP_API_SOURCE}"
    return routes


def nginx_size(text: str) -> int:
    """An nginx size ("1m", "64k", "1024"; "0" = no limit) in bytes."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", text.strip())
    assert match, text
    factor = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2).lower()]
    return int(match.group(1)) * factor


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail any attempt to resolve or connect: schema validation must be offline."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


# --- schemas ---------------------------------------------------------------------------


def test_the_expected_manifests_exist() -> None:
    kinds = sorted(doc["kind"] for _, doc in ALL_DOCS)
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "Ingress", "PodDisruptionBudget"):
        assert kind in kinds
    for path, doc in ALL_DOCS:
        assert doc.get("apiVersion") and doc.get("metadata", {}).get("name"), path


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("path", "doc"),
    [pytest.param(p, d, id=f"{p.name}:{d['kind']}") for p, d in ALL_DOCS if d["kind"] not in CRD_KINDS],
)
def test_manifest_matches_the_kubernetes_schema(path: Path, doc: Doc, version: str, no_network: None) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{path.name} ({doc['kind']}) against {version}: {where}: {exc.message}")


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


def test_kustomization_lists_the_manifests() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    crd_files = {p.name for p, d in ALL_DOCS if d["kind"] in CRD_KINDS}
    assert listed == {p.name for p in manifest_files()} - crd_files
    image = container()["image"].split(":")[0]
    assert [i["name"] for i in kustomization.get("images", [])] == [image]


# --- the pod -----------------------------------------------------------------------------


def test_deployment_selector_matches_its_pods() -> None:
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)


def test_probes_hit_health_and_ready_on_the_container_port() -> None:
    c = container()
    port = int(container_env().get("CHATTTS_PORT", Settings().port))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port in ports.values()

    def probe_port(probe: Doc) -> int:
        target = probe["httpGet"]["port"]
        return int(ports[target] if isinstance(target, str) else target)

    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["httpGet"]["path"] in ("/health", "/ready")
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert probe_port(c[name]) == port, name
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


def test_grace_period_covers_prestop_and_drain() -> None:
    pod = one("Deployment")["spec"]["template"]["spec"]
    c = container()
    pre_stop = _prestop_seconds(c)
    drain = float(container_env().get("CHATTTS_DRAIN_TIMEOUT_S", Settings().drain_timeout_s))
    # The endpoint must be gone from the ingress before SIGTERM starts the drain.
    assert pre_stop >= 5
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain


def test_one_gpu_per_pod_and_resource_requests() -> None:
    resources = container()["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert str(resources["requests"].get("nvidia.com/gpu", "1")) == "1"
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert "memory" in resources["limits"]


def test_chattts_env_are_real_settings_and_parse() -> None:
    env = container_env()
    names = {f"CHATTTS_{name.upper()}" for name in Settings.__dataclass_fields__}
    chattts = {k: v for k, v in env.items() if k.startswith("CHATTTS_")}
    assert set(chattts) <= names, set(chattts) - names
    settings = load_settings([], env=chattts)  # the server's own parser and types
    assert settings.host == "0.0.0.0"
    assert settings.device.startswith("cuda")
    assert settings.cache_dir == "/models" or settings.model_dir
    assert settings.max_queue >= settings.max_batch


def test_weights_volume_and_writable_tmp() -> None:
    pod = one("Deployment")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    weights = volumes[mounts["/models"]]
    claim = weights["persistentVolumeClaim"]["claimName"]
    assert one("PersistentVolumeClaim")["metadata"]["name"] == claim
    if container()["securityContext"].get("readOnlyRootFilesystem"):
        assert "emptyDir" in volumes[mounts["/tmp"]]
        env = container_env()
        for var in ("XDG_CACHE_HOME", "NUMBA_CACHE_DIR"):
            assert env[var].startswith("/tmp/"), var
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_scrape_annotations_point_at_metrics() -> None:
    annotations = one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) in [p["containerPort"] for p in container()["ports"]]
    # /metrics is served on the WebSocket port, not on the HTTP API's.
    assert int(annotations["prometheus.io/port"]) == ws_port()


def test_http_api_port_is_a_named_container_port_and_matches_the_setting() -> None:
    ports = container_ports()
    env = container_env()
    # Explicit, so that a port that cannot be bound fails the start (the default -1 only
    # logs a warning and runs without the HTTP API).
    assert int(env["CHATTTS_HTTP_PORT"]) > 0
    assert ports["http"] == ws_port()
    assert ports["http-api"] == http_api_port()
    assert http_api_port() != ws_port()
    assert ports["wyoming"] == wyoming_port()
    assert sorted(ports.values()) == sorted({ws_port(), http_api_port(), wyoming_port()}), (
        "a port the server does not bind"
    )
    assert all(p["protocol"] == "TCP" for p in container()["ports"])


def test_api_keys_come_from_a_mounted_secret() -> None:
    env = container_env()
    # Keys never sit in the manifest itself.
    assert "CHATTTS_API_KEYS" not in env
    keys_file = Path(env["CHATTTS_API_KEYS_FILE"])
    assert keys_file.is_absolute()
    assert settings().api_keys_file == str(keys_file)
    mounts = {m["mountPath"].rstrip("/"): m for m in container()["volumeMounts"]}
    mount = mounts.get(str(keys_file.parent))
    assert mount, f"no volume is mounted at {keys_file.parent} (CHATTTS_API_KEYS_FILE)"
    assert mount.get("readOnly") is True
    assert "subPath" not in mount, "a subPath mount never sees an updated Secret"
    volumes = {v["name"]: v for v in one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    secret = volumes[mount["name"]].get("secret")
    assert secret and secret.get("secretName"), f"volume {mount['name']} is not a Secret"
    items = secret.get("items")
    if items:
        assert keys_file.name in {item["path"] for item in items}, "the Secret item is not the keys file"
    # Readable by the pod's group (fsGroup), not by others.
    mode = secret.get("defaultMode", 0o644)
    assert mode & 0o007 == 0, oct(mode)
    assert mode & 0o040 and one("Deployment")["spec"]["template"]["spec"]["securityContext"].get("fsGroup")
    if secret.get("optional"):
        # An optional Secret that is absent leaves an empty folder: the server must then
        # start (without keys) instead of crash-looping on the missing file.
        try:
            read_api_keys(Settings(api_keys_file=str(ROOT / "no-such-dir" / keys_file.name)))
        except StartupError as exc:
            pytest.fail(f"optional Secret, but the server cannot start without the file: {exc}")


def test_client_ip_comes_from_the_ingress_not_the_client() -> None:
    """The pods trust the first X-Forwarded-For hop; the controller must make it the client's."""
    assert settings().trust_forwarded_for is True
    config = yaml.safe_load(INGRESS_NGINX_VALUES.read_text())["controller"]["config"]
    # Appending to a client-sent X-Forwarded-For makes the first hop the client's choice.
    assert str(config.get("compute-full-forwarded-for", "false")).lower() != "true"
    if str(config.get("use-forwarded-headers", "false")).lower() == "true":
        # Only from a known load balancer: the default 0.0.0.0/0 trusts every sender.
        cidr = str(config.get("proxy-real-ip-cidr", "0.0.0.0/0"))
        assert "0.0.0.0/0" not in cidr and "::/0" not in cidr, cidr


# --- service, ingress, disruption budget ------------------------------------------------


def test_service_selects_the_pods_and_targets_the_container_port() -> None:
    service = one("Service")
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], labels)
    port_names = {p["name"] for p in container()["ports"]}
    port_numbers = {p["containerPort"] for p in container()["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names | port_numbers
    # Every server port is reachable through the Service (the HTTP API and Wyoming too).
    targets = {service_port_target(p) for p in service["spec"]["ports"]}
    assert {ws_port(), http_api_port(), wyoming_port()} <= targets


def stream_ingress() -> Doc:
    """The Ingress that routes the WebSocket endpoint."""
    found = [ingress for ingress, path, _, _ in ingress_paths() if path == "/v1/stream"]
    assert len(found) == 1, "exactly one Ingress routes /v1/stream"
    return found[0]


def test_ingress_hashes_on_the_resume_token_and_spreads_new_streams() -> None:
    ingress = stream_ingress()
    annotations = ingress["metadata"]["annotations"]
    hash_by = annotations["nginx.ingress.kubernetes.io/upstream-hash-by"]
    if hash_by != "$arg_resume":
        # A variable that the controller's http-snippet maps from $arg_resume; a bare
        # $arg_resume would hash every new connection ("" key) to one pod.
        variable = re.fullmatch(r"\$(\w+)", hash_by)
        assert variable, hash_by
        snippet = yaml.safe_load(INGRESS_NGINX_VALUES.read_text())["controller"]["config"]["http-snippet"]
        block = re.search(
            r"map\s+\$arg_resume\s+\$" + variable.group(1) + r"\s*\{(.*?)\n\s*\}", snippet, re.S
        )
        assert block, f"no `map $arg_resume ${variable.group(1)}` in {INGRESS_NGINX_VALUES}"
        entries = dict(
            line.strip().rstrip(";").rsplit(None, 1) for line in block.group(1).splitlines() if line.strip()
        )
        assert entries.pop("default") == "$arg_resume"
        # New connections: a per-request random key, so they spread over all pods.
        assert entries.pop('""') in ("$req_id", "$request_id"), entries
        # Tokens "<route>.<secret>" hash on the route: the first connection's request id.
        for pattern, value in entries.items():
            regex = re.fullmatch(r'"~(.*)"', pattern)
            assert regex and value.startswith("$"), (pattern, value)
            nginx_regex = regex.group(1).replace("(?<", "(?P<")
            matched = re.match(nginx_regex, "0123abcd.secret")
            assert matched and "$" + matched.lastgroup == value, (pattern, value)
    # Hashing needs the pod endpoints, not the Service's virtual IP.
    assert annotations.get("nginx.ingress.kubernetes.io/service-upstream", "false") != "true"
    # WebSocket streams must outlive nginx's default 60 s proxy timeouts.
    for key in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[f"nginx.ingress.kubernetes.io/{key}"]) >= 300, key
    # The stream endpoint is routed to the Service's port; /metrics is not public.
    service = one("Service")
    service_ports = {p["name"] for p in service["spec"]["ports"]} | {
        p["port"] for p in service["spec"]["ports"]
    }
    paths = {}
    for every in ingresses():
        for rule in every["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] == service["metadata"]["name"]
                assert backend["port"].get("name", backend["port"].get("number")) in service_ports
                paths[path["path"]] = path["pathType"]
    assert "/v1/stream" in paths
    assert not any(p == "/" and t == "Prefix" for p, t in paths.items()), "/ Prefix would publish /metrics"


def test_each_public_path_reaches_the_port_that_serves_it() -> None:
    # WebSocket server: the stream endpoint and the demo page.
    assert routed_port("/v1/stream") == ws_port()
    assert routed_port("/") == ws_port()
    # The OpenAI-compatible HTTP API: every route the aiohttp server registers.
    routes = http_api_routes()
    assert {"/v1/audio/speech", "/v1/models"} <= routes
    for route in routes:
        assert routed_port(route) == http_api_port(), route
    # Prefix paths: /v1/audio covers speech and voices, and new routes need no Ingress change.
    prefixes = {p for _, p, kind, _ in ingress_paths() if kind == "Prefix"}
    assert {"/v1/audio", "/v1/models"} <= prefixes
    # Nothing else of either server is public.
    for private in ("/metrics", "/health", "/ready"):
        assert routed_port(private) is None, f"{private} is public"
    # Every path of the HTTP API port is one the aiohttp server answers.
    for _, path, kind, backend in ingress_paths():
        if service_port_target(backend["port"]) == http_api_port():
            assert any(
                r == path or (kind == "Prefix" and r.startswith(path.rstrip("/") + "/")) for r in routes
            ), path


def test_http_api_ingress_streams_and_does_not_hash() -> None:
    hash_key = "nginx.ingress.kubernetes.io/upstream-hash-by"
    # ingress-nginx keeps one upstream per Service port, and the first Ingress that names
    # it sets its balancing: every Ingress that routes one port must agree on the hash.
    by_port: dict[int, set[str | None]] = {}
    for ingress, _, _, backend in ingress_paths():
        hash_by = ingress["metadata"].get("annotations", {}).get(hash_key)
        by_port.setdefault(service_port_target(backend["port"]), set()).add(hash_by)
    assert all(len(keys) == 1 for keys in by_port.values()), by_port
    # A speech request is one response, never resumed: no affinity, plain balancing.
    assert by_port[http_api_port()] == {None}
    max_body = settings().max_message_bytes
    stream = stream_ingress()
    for ingress, _, _, backend in ingress_paths():
        if service_port_target(backend["port"]) != http_api_port():
            continue
        annotations = ingress["metadata"].get("annotations", {})
        # Chunks must reach the client as they are generated, not in proxy-buffer steps.
        assert annotations.get("nginx.ingress.kubernetes.io/proxy-buffering", "off") == "off"
        # nginx must let through every body the server accepts (its 413 is OpenAI-shaped).
        body = nginx_size(annotations.get("nginx.ingress.kubernetes.io/proxy-body-size", "1m"))
        assert body == 0 or body >= max_body
        # The headers wait for the first audio: more than nginx's default 60 s.
        assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 120
        # Same host, TLS and controller as the WebSocket endpoint.
        assert ingress["spec"]["ingressClassName"] == stream["spec"]["ingressClassName"]
        assert {r["host"] for r in ingress["spec"]["rules"]} == {r["host"] for r in stream["spec"]["rules"]}
        assert ingress["spec"]["tls"] == stream["spec"]["tls"]


def test_the_wyoming_port_is_in_cluster_only_and_guarded_by_a_network_policy() -> None:
    """Wyoming has no API keys and the pods use keys: the explicit flag is set, the network guards it."""
    assert settings().api_keys_file, "the pods use API keys"
    assert exposure_problem(settings(), keys_required=True) is None, "the server would refuse to start"
    # No Ingress reaches it (raw TCP; ingress-nginx routes HTTP paths).
    assert all(service_port_target(backend["port"]) != wyoming_port() for _, _, _, backend in ingress_paths())
    policy = one("NetworkPolicy")
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], labels)
    assert "Ingress" in policy["spec"]["policyTypes"]
    names = container_ports()

    def ports_of(rule: Doc) -> set[int]:
        return {names[p["port"]] if isinstance(p["port"], str) else int(p["port"]) for p in rule["ports"]}

    rules = policy["spec"]["ingress"]
    # The WebSocket and HTTP API ports stay open to every source (ingress, Prometheus).
    open_rules = [r for r in rules if not r.get("from")]
    assert {ws_port(), http_api_port()} <= set().union(*(ports_of(r) for r in open_rules))
    # Wyoming only from labelled pods: never in a rule without `from`, never from everywhere.
    wyoming_rules = [r for r in rules if wyoming_port() in ports_of(r)]
    assert wyoming_rules and all(r.get("from") for r in wyoming_rules)
    for rule in wyoming_rules:
        for peer in rule["from"]:
            assert "ipBlock" not in peer and peer["podSelector"]["matchLabels"], peer


def test_pdb_selects_the_pods_and_allows_one_eviction() -> None:
    pdb = one("PodDisruptionBudget")
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    min_replicas = one("HorizontalPodAutoscaler")["spec"]["minReplicas"]
    if "maxUnavailable" in pdb["spec"]:
        assert int(pdb["spec"]["maxUnavailable"]) >= 1
    else:
        assert int(pdb["spec"]["minAvailable"]) < min_replicas, "a drain could never evict a pod"


def test_servicemonitor_scrapes_the_service() -> None:
    monitors = [doc for _, doc in ALL_DOCS if doc["kind"] == "ServiceMonitor"]
    service = one("Service")
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
            # /metrics is served on the WebSocket port only.
            assert service_port_target({"name": endpoint["port"]}) == ws_port()


# --- autoscaling ------------------------------------------------------------------------------


def exported_metric_names() -> set[str]:
    text = Metrics().render().decode()
    return set(re.findall(r"^# TYPE (\w+) ", text, re.M))


def adapter_rules() -> list[Doc]:
    rules: list[Doc] = yaml.safe_load((ADAPTER / "rules.yaml").read_text())["rules"]
    return rules


def test_hpa_scales_the_deployment_on_streams_with_cpu_fallback() -> None:
    hpa = one("HorizontalPodAutoscaler")
    deployment = one("Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        "Deployment",
        deployment["metadata"]["name"],
    )
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    metrics = hpa["spec"]["metrics"]
    pods = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in metrics if m["type"] == "Pods"}
    assert "chattts_active_streams" in pods
    # The per-pod stream target stays below what one batch can run.
    max_batch = int(container_env().get("CHATTTS_MAX_BATCH", Settings().max_batch))
    assert 0 < float(pods["chattts_active_streams"]["averageValue"]) <= max_batch
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in metrics)
    # The load metrics are real gauges of the server, served by the adapter.
    served = {rule["name"]["as"] for rule in adapter_rules()}
    assert set(pods) <= served
    assert set(pods) <= exported_metric_names()


def test_adapter_rules_expose_server_gauges_per_pod() -> None:
    exported = exported_metric_names()
    for rule in adapter_rules():
        series = re.match(r"(\w+)\{", rule["seriesQuery"])
        assert series and series.group(1) in exported, rule["seriesQuery"]
        assert re.fullmatch(rule["name"]["matches"], series.group(1))
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"]["resource"] == "pod"
        assert overrides["namespace"]["resource"] == "namespace"
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]


def test_adapter_helm_values_carry_the_same_rules() -> None:
    values = yaml.safe_load((ADAPTER / "values.yaml").read_text())
    assert values["rules"]["custom"] == adapter_rules()
