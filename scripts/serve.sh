#!/usr/bin/env bash
# Set up (first run only) and start the server. Flags go to `chattts-stream serve`;
# see `scripts/serve.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# torch's OpenMP threads spin while they wait; on a CPU shared with anything else that
# spinning made model steps up to 60x slower (bench/README.md). Override if you know better.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/chattts-stream serve "$@"
