#!/usr/bin/env bash
# One-time (and idempotent) set-up of everything chattts-stream needs on a fresh
# Debian/Ubuntu machine: system libraries, a virtual environment in .venv with
# the Python packages, and (for the tests) the browser-test tools.
#
#   scripts/setup.sh          runtime only (what `scripts/serve.sh` needs)
#   scripts/setup.sh --dev    plus test tools (what `scripts/test.sh` needs)
#
# Re-running is fast: each step is skipped when its inputs did not change.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
[[ "${1:-}" == "--dev" ]] && DEV=1
PYTHON="${PYTHON:-python3}"
# The CPU build of torch. Override TORCH_SPEC for a GPU machine, e.g.
#   TORCH_SPEC="torch==2.9.1" (PyPI's default Linux wheels include CUDA).
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VENV=.venv
STAMP="$VENV/.setup-stamp"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

# --- system packages --------------------------------------------------------
APT_PACKAGES=(libopus0)
if [[ $DEV -eq 1 ]]; then
  # opus-tools: opusinfo/opusdec check our Ogg Opus; chromium (+ node) runs the browser tests;
  # ffmpeg decodes our mp3 (gapless tag) and flac (libsndfile cannot read a FLAC stream of unknown length);
  # espeak-ng speaks with known word boundaries for bench.words (tests/bench/words/test_smoke.py);
  # haproxy is the round-robin load balancer in front of three replicas (tests/integration/test_cluster.py);
  # fonts-noto-cjk draws the demo page's Chinese text in its screenshot (scripts/screenshot_demo.py).
  APT_PACKAGES+=(opus-tools chromium ffmpeg espeak-ng haproxy fonts-noto-cjk)
  command -v node >/dev/null || APT_PACKAGES+=(nodejs npm)
fi
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if command -v apt-get >/dev/null; then
    log "installing system packages: ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    log "please install these system packages yourself: ${missing[*]}" && exit 1
  fi
fi

# --- browser-client test tools (npm, offline-safe: no browser download) --------
if [[ $DEV -eq 1 ]]; then
  lock_hash="$(sha256sum client_js/package-lock.json | cut -c1-16)"
  if [[ ! -f client_js/node_modules/.setup-stamp || "$(cat client_js/node_modules/.setup-stamp)" != "$lock_hash" ]]; then
    log "installing client_js test dependencies (npm ci)"
    (cd client_js && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
    echo "$lock_hash" > client_js/node_modules/.setup-stamp
  fi
fi

# --- Python environment -----------------------------------------------------
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-dev$DEV-$TORCH_SPEC"
# The dev set-up also installs client_py (the Docker image, runtime only, does not copy it).
[[ $DEV -eq 1 ]] && want+="-client-$(sha256sum client_py/pyproject.toml | cut -c1-16)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
log "installing $TORCH_SPEC"
"${PIP[@]}" "$TORCH_SPEC"
# ChatTTS and vocos import torchaudio but use only its pure-Python parts. PyPI's
# torchaudio wheels carry a compiled extension built for CUDA torch, which cannot
# load beside the CPU torch; torchaudio runs fine without it, so it is removed.
"${PIP[@]}" --no-deps "torchaudio==2.11.0"
rm -f "$VENV"/lib/python3*/site-packages/torchaudio/lib/*.so
extras="model"
[[ $DEV -eq 1 ]] && extras="model,dev"
log "installing chattts-stream[$extras]"
"${PIP[@]}" -e ".[$extras]"
if [[ $DEV -eq 1 ]]; then
  # The Python client (bench/ uses it) with its pipecat and LiveKit extras
  # (tests/integration/test_pipecat.py, test_livekit.py).
  log "installing client_py[pipecat,livekit]"
  "${PIP[@]}" -e "./client_py[pipecat,livekit]"
fi
echo "$want" > "$STAMP"
log "ready: $VENV"
