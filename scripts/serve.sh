#!/usr/bin/env bash
# Set up (first run only) and start the server. Flags go to `chattts-stream serve`;
# see `scripts/serve.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# How torch's idle threads wait is the server's own choice (--omp-wait-policy auto: a short
# spin; pass --omp-wait-policy passive on a CPU shared with other busy processes).
exec .venv/bin/chattts-stream serve "$@"
