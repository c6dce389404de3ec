#!/usr/bin/env bash
# Set up (first run only) and start the server. Flags go to `chattts-stream serve`;
# see `scripts/serve.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/chattts-stream serve "$@"
