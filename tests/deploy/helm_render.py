"""``helm template`` and ``helm lint`` of deploy/helm/chattts-stream, offline, as a subprocess.

Neither PyPI, Debian nor npm ships the ``helm`` binary, so the chart is rendered by
Helm's own Go engine (Helm v4's SDK, ``helm.sh/helm/v4``) through the ``helm-python-sdk``
wheel (``helm_python``, a ctypes binding to a C build of that SDK). It runs in a child
process: a Go runtime loaded into the pytest process would install its signal handlers
there, beside the servers and subprocesses the other tests start.

    python -m tests.deploy.helm_render [-f VALUES.yaml]... [--set-json JSON] [--lint]

prints ``{"manifests": {template path: rendered text}, "lint": report or null}`` as JSON.
``-f`` files merge like Helm's (maps deep-merged, later files win, ``null`` deletes a key);
``--set-json`` is one more such layer, applied last. The release is ``chattts-stream`` in
namespace ``chattts`` unless ``--name``/``--namespace`` say otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "chattts-stream"
#: The oldest Kubernetes the chart declares (Chart.yaml kubeVersion); lint checks against it.
KUBE_VERSION = "v1.30.0"


def merge(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of two values layers: maps deep-merged, anything else replaced."""
    out = dict(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def main(argv: list[str]) -> int:
    """Render (and optionally lint) the chart; see the module doc."""
    parser = argparse.ArgumentParser(prog="python -m tests.deploy.helm_render")
    parser.add_argument("-f", "--values", action="append", default=[], type=Path)
    parser.add_argument("--set-json", default="{}")
    parser.add_argument("--name", default="chattts-stream")
    parser.add_argument("--namespace", default="chattts")
    parser.add_argument("--lint", action="store_true")
    args = parser.parse_args(argv)

    import helm_python as helm  # the Go engine: only in this child process

    values: dict[str, Any] = {}
    for path in args.values:
        values = merge(values, yaml.safe_load(path.read_text()) or {})
    values = merge(values, json.loads(args.set_json))
    try:
        with helm.Chart.load(CHART) as chart:
            manifests = chart.render(values, name=args.name, namespace=args.namespace, is_install=True)
    except helm.HelmError as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    report = helm.lint(CHART, values, strict=True, kube_version=KUBE_VERSION) if args.lint else None
    print(json.dumps({"manifests": manifests, "lint": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
