"""The deployment's manifest sets, loaded for the tests: deploy/k8s and the chart's renderings.

A :class:`Manifests` is one set of Kubernetes objects as a cluster would receive it:
the files of ``deploy/k8s`` (with the kustomization's image applied), or the Helm chart
``deploy/helm/chattts-stream`` rendered with some values (``tests/deploy/helm_render.py``,
in a subprocess). The helpers answer what the tests ask of every set alike: the one
Deployment's container and its settings (parsed by the server's own parser), which port a
public path reaches through the HTTPRoutes, which Service port a backend means.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from server.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CHART = ROOT / "deploy" / "helm" / "chattts-stream"
#: deploy/k8s files that are examples or optional, not in the kustomization.
K8S_OPTIONAL = {"gateway.yaml", "servicemonitor.yaml"}
NOT_MANIFESTS = {"kustomization.yaml"}
#: Every optional part of the chart switched on (and given what it needs).
FULL_VALUES: dict[str, Any] = {
    "apiKeys": {"keys": ["key-one", "key-two"]},
    "resumeSecret": {"value": "a-shared-resume-secret-of-enough-length"},
    "gateway": {"create": True, "className": "example-gateway-class"},
    "serviceMonitor": {"enabled": True},
}
#: The sets with the cluster add-ons (values-full.yaml: routes, KEDA, a shared weights
#: volume), as deploy/k8s has them; the route and scaling tests run on these.
#: name -> (values files, extra values).
SETS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "chart-gpu": (("values-full.yaml",), {}),
    "chart-cpu": (("values-cpu.yaml", "values-full.yaml"), {}),
    "chart-full": (("values-full.yaml",), FULL_VALUES),
    "chart-cpu-full": (("values-cpu.yaml", "values-full.yaml"), FULL_VALUES),
}
#: The chart's own defaults (no values-full.yaml): what `helm install` gives a plain cluster.
PLAIN_SETS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "chart-plain-gpu": ((), {}),
    "chart-plain-cpu": (("values-cpu.yaml",), {}),
}

Doc = dict[str, Any]


class RenderError(Exception):
    """The chart refused the values (schema, a ``fail``, a ``required``): Helm's message."""


@dataclass
class Manifests:
    """One set of manifests: ``(source file, object)`` pairs."""

    name: str
    docs: list[tuple[str, Doc]]
    #: Sources that are examples, not applied with the rest (deploy/k8s's K8S_OPTIONAL).
    optional: frozenset[str] = frozenset()

    def applied(self) -> list[Doc]:
        """The objects a cluster receives (without the optional examples)."""
        return [doc for source, doc in self.docs if source not in self.optional]

    def of_kind(self, kind: str) -> list[Doc]:
        return [doc for _, doc in self.docs if doc["kind"] == kind]

    def one(self, kind: str) -> Doc:
        found = self.of_kind(kind)
        assert len(found) == 1, f"{self.name}: expected one {kind}, found {len(found)}"
        return found[0]

    def named(self, kind: str, name: str) -> Doc | None:
        found = [doc for doc in self.of_kind(kind) if doc["metadata"]["name"] == name]
        return found[0] if found else None

    # --- the pod ---------------------------------------------------------------------

    def pod(self) -> Doc:
        pod: Doc = self.one("Deployment")["spec"]["template"]["spec"]
        return pod

    def pod_labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.one("Deployment")["spec"]["template"]["metadata"]["labels"]
        return labels

    def container(self) -> Doc:
        containers = self.pod()["containers"]
        assert len(containers) == 1
        result: Doc = containers[0]
        return result

    def env(self) -> dict[str, str]:
        return {e["name"]: e["value"] for e in self.container().get("env", []) if "value" in e}

    def container_ports(self) -> dict[str, int]:
        """Named container ports: name -> number."""
        ports = self.container()["ports"]
        assert all(p.get("name") for p in ports), "every container port is named"
        return {p["name"]: int(p["containerPort"]) for p in ports}

    def settings(self) -> Settings:
        """The pod's settings, parsed by the server's own parser from its CHATTTS_* env."""
        env = {k: v for k, v in self.env().items() if k.startswith("CHATTTS_")}
        return load_settings([], env=env)

    def ws_port(self) -> int:
        return self.settings().port

    def http_api_port(self) -> int:
        """The port the server binds for the HTTP API (the server's own rule for -1)."""
        s = self.settings()
        assert s.http_port != 0, "CHATTTS_HTTP_PORT=0 turns the OpenAI-compatible HTTP API off"
        return s.http_port if s.http_port > 0 else s.port + 1

    def wyoming_port(self) -> int:
        """The Wyoming port (0: off)."""
        return self.settings().wyoming_port

    def volume_of_mount(self, directory: str) -> Doc:
        """The volume mounted at ``directory`` (its mount must exist)."""
        mounts = {m["mountPath"].rstrip("/"): m for m in self.container()["volumeMounts"]}
        mount = mounts.get(directory.rstrip("/"))
        assert mount, f"{self.name}: no volume is mounted at {directory}"
        volumes = {v["name"]: v for v in self.pod()["volumes"]}
        return {"mount": mount, **volumes[mount["name"]]}

    # --- service and routes ----------------------------------------------------------

    def service_port_target(self, port: int | str) -> int:
        """A Service port (by number or name) -> the container port it reaches."""
        service = self.one("Service")
        matches = [p for p in service["spec"]["ports"] if port in (p.get("name"), p["port"])]
        assert len(matches) == 1, f"{self.name}: the Service has no port {port!r}"
        target = matches[0]["targetPort"]
        return self.container_ports()[target] if isinstance(target, str) else int(target)

    def route_paths(self) -> list[tuple[Doc, str, str, Doc]]:
        """(HTTPRoute, path match type, path, backendRef) for every path of every route."""
        result = []
        for route in self.of_kind("HTTPRoute"):
            for rule in route["spec"]["rules"]:
                for match in rule.get("matches", [{"path": {"type": "PathPrefix", "value": "/"}}]):
                    path = match.get("path", {"type": "PathPrefix", "value": "/"})
                    for backend in rule["backendRefs"]:
                        result.append((route, path["type"], path["value"], backend))
        return result

    def routed_port(self, request_path: str) -> int | None:
        """The container port a request path reaches through the HTTPRoutes (None: not public).

        The Gateway API's precedence: an Exact match wins, else the longest PathPrefix,
        which matches whole path elements (/v1/audio matches /v1/audio/speech, not
        /v1/audiox).
        """
        exact = [b for _, kind, p, b in self.route_paths() if kind == "Exact" and p == request_path]
        if exact:
            return self.service_port_target(exact[0]["port"])
        prefixes = []
        for _, kind, p, b in self.route_paths():
            base = p.rstrip("/")
            if kind == "PathPrefix" and (request_path == base or request_path.startswith(base + "/")):
                prefixes.append((len(base), b))
        if not prefixes:
            return None
        return self.service_port_target(max(prefixes, key=lambda item: item[0])[1]["port"])


def load_docs(text: str) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.y*ml") if p.name not in NOT_MANIFESTS)


@functools.cache
def k8s() -> Manifests:
    """deploy/k8s as ``kubectl apply -k`` sends it (the kustomization's image and namespace)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization.get("images", [])}
    docs = []
    for path in k8s_files():
        for doc in load_docs(path.read_text()):
            for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                c["image"] = images.get(c["image"].split(":")[0], c["image"])
            docs.append((path.name, doc))
    return Manifests("k8s", docs, frozenset(K8S_OPTIONAL))


@functools.cache
def _render(values_files: tuple[str, ...], extra_json: str, name: str, lint: bool) -> Doc:
    command = [sys.executable, "-m", "tests.deploy.helm_render", "--name", name, "--set-json", extra_json]
    for values_file in values_files:
        command += ["-f", str(CHART / values_file)]
    if lint:
        command.append("--lint")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    try:
        result: Doc = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"helm_render failed ({done.returncode}): {done.stderr[-2000:]}") from None
    return result


def render(
    values_files: tuple[str, ...] = (), values: dict[str, Any] | None = None, *, name: str = "chattts-stream"
) -> Manifests:
    """The chart rendered like ``helm template NAME deploy/helm/chattts-stream -n chattts -f ...``.

    Raises:
        RenderError: the chart refused the values.
    """
    result = _render(values_files, json.dumps(values or {}, sort_keys=True), name, False)
    if "error" in result:
        raise RenderError(result["error"])
    docs = [
        (template.rsplit("/", 1)[-1], doc)
        for template, text in sorted(result["manifests"].items())
        if template.endswith((".yaml", ".yml"))
        for doc in load_docs(text)
    ]
    label = "+".join(values_files) + (f" {json.dumps(values)}" if values else "")
    return Manifests(f"chart {label or '(defaults)'}", docs)


def lint(values_files: tuple[str, ...] = ()) -> Doc:
    """``helm lint --strict`` of the chart with these values files (its report)."""
    report: Doc = _render(values_files, "{}", "chattts-stream", True)["lint"]
    return report


def manifest_set(name: str) -> Manifests:
    """One of the sets the consistency tests run on: ``k8s`` or a key of :data:`SETS`."""
    if name == "k8s":
        return k8s()
    files, values = {**SETS, **PLAIN_SETS}[name]
    rendered = render(files, values)
    return Manifests(name, rendered.docs)


SET_NAMES = ["k8s", *SETS]
PLAIN_SET_NAMES = list(PLAIN_SETS)
ALL_SET_NAMES = [*SET_NAMES, *PLAIN_SET_NAMES]
