#!/usr/bin/env bash
# Set up (first run only) and run every check: ruff, mypy (strict on server/), pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -k protocol`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
export HF_HUB_OFFLINE=1  # tests never touch the network
.venv/bin/ruff check server tests bench
.venv/bin/ruff format --check server tests bench
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
