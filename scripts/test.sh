#!/usr/bin/env bash
# Set up (first run only) and run every check: ruff, mypy (strict on server/), pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -k protocol`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
export HF_HUB_OFFLINE=1  # tests never touch the network
.venv/bin/ruff check server tests bench client_py
.venv/bin/ruff format --check server tests bench client_py
.venv/bin/mypy
.venv/bin/mypy --strict client_py/src
scripts/test_client_py.sh  # pip install ./client_py in a fresh venv, then its own tests
.venv/bin/python -m pytest "$@"
