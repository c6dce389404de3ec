#!/usr/bin/env bash
# The Python client as its users get it: `pip install ./client_py` into a fresh virtual
# environment that has nothing but the package and its declared dependencies (websockets),
# then its own tests (stdlib unittest against a scripted server; no chattts-stream server).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check ./client_py
# Only what it declares: the package, websockets, and pip's own.
"$venv/bin/python" -m pip list --format=freeze --disable-pip-version-check \
  | grep -v -E '^(chattts-stream-client|websockets|pip|setuptools)==' && {
    echo "client_py pulled in undeclared packages (above)" >&2; exit 1; }
cd client_py/tests  # not the source tree: the installed package is the one under test
"$venv/bin/python" -m unittest discover -s . -v 2>&1 | tail -n 3
