#!/usr/bin/env bash
# One-time (and idempotent) set-up of everything chattts-stream needs on a fresh
# Debian/Ubuntu machine: system libraries, a virtual environment in .venv with
# the Python packages, and (for the tests) the browser-test tools.
#
#   scripts/setup.sh          runtime and the Python client (what `scripts/serve.sh` and
#                             `python -m bench` need)
#   scripts/setup.sh --dev    plus test tools (what `scripts/test.sh` needs)
#   scripts/setup.sh --plan   say what a run would install, change nothing (with or without --dev)
#
# Both share the one .venv, and --dev is a superset: after --dev, the plain set-up has
# nothing to do, so serve.sh and test.sh can alternate without reinstalling.
# torch is the build this machine can run (scripts/torch_choice.sh: the CPU build without
# an NVIDIA driver, the CUDA build the driver supports with one); TORCH_SPEC overrides it.
# Re-running is fast: each step is skipped when its inputs did not change.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=0
PLAN=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    --plan) PLAN=1 ;;
    *) echo "usage: scripts/setup.sh [--dev] [--plan]" >&2 && exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-}"
# shellcheck source=scripts/torch_choice.sh
source scripts/torch_choice.sh
VENV=.venv
STAMP="$VENV/.setup-stamp"
# What the Python environment is made from: a change to any of these reinstalls it.
STAMP_INPUTS=(pyproject.toml client_py/pyproject.toml scripts/setup.sh scripts/torch_choice.sh)
# The installer: uv, installed into .venv by its pip. Measured against pip on a fresh .venv
# with the dev packages, both compiling bytecode: 63 s against 172 s (median of 3, warm caches).
UV_SPEC="uv==0.13.*"

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
  if [[ $PLAN -eq 1 ]]; then
    log "plan: system packages ${missing[*]}"
  elif command -v apt-get >/dev/null; then
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
    if [[ $PLAN -eq 1 ]]; then
      log "plan: client_js test dependencies (npm ci)"
    else
      log "installing client_js test dependencies (npm ci)"
      (cd client_js && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error)
      echo "$lock_hash" > client_js/node_modules/.setup-stamp
    fi
  fi
fi

# --- Python environment -----------------------------------------------------
# The stamp's first line names the inputs and the torch build; its second, the level
# installed ("base" or "dev"). dev is a superset of base: a plain run is satisfied by a dev
# install, and a plain run that must reinstall keeps the dev packages, so serve.sh and
# test.sh never undo each other.
torch_variant
want="$(cat "${STAMP_INPUTS[@]}" | sha256sum | cut -c1-16) torch=$TORCH_VARIANT"
[[ "$TORCH_VARIANT" == override ]] && want+=" $TORCH_SPEC"
have="" have_level=""
if [[ -f "$STAMP" ]]; then
  { read -r have; read -r have_level; } <"$STAMP" || true
fi
level=base
[[ $DEV -eq 1 || "$have_level" == dev ]] && level=dev
if [[ "$have" == "$want" && ("$have_level" == dev || $DEV -eq 0 && "$have_level" == base) ]]; then
  [[ $PLAN -eq 1 ]] && log "plan: $VENV is up to date ($have_level)"
  exit 0
fi
if [[ $PLAN -eq 1 ]]; then
  log "plan: install the $level Python packages into $VENV (torch build: $TORCH_VARIANT)"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$UV_SPEC"

# uv reads no pip configuration: hand it the sources pip would use (pip.conf and PIP_*
# variables: a local wheel folder, a mirror), and pip's rule of taking the best version
# from all of them. As for pip, a PIP_* variable wins over the files. The configured
# index-url is kept apart: the torch step replaces it with PyTorch's index.
declare -A pip_file=() pip_env=()
while IFS= read -r line; do
  name="${line%%=*}" value="${line#*=}"
  value="${value#\'}" && value="${value%\'}"
  if [[ "$name" == :env:.* ]]; then pip_env[${name##*.}]="$value"; else pip_file[${name##*.}]="$value"; fi
done < <("$VENV/bin/python" -m pip config list 2>/dev/null)
pip_config() { echo "${pip_env[$1]-${pip_file[$1]-}}"; }
pip_sources=() pip_index=()
for url in $(pip_config extra-index-url); do pip_sources+=(--extra-index-url "$url"); done
for url in $(pip_config find-links); do pip_sources+=(--find-links "$url"); done
for file in $(pip_config constraint); do pip_sources+=(--constraint "$file"); done
if [[ "$(pip_config no-index)" =~ ^(1|[Tt]rue|yes|on)$ ]]; then pip_sources+=(--no-index); fi
if [[ -n "$(pip_config index-url)" ]]; then pip_index=(--index-url "$(pip_config index-url)"); fi
SSL_CERT_FILE="${SSL_CERT_FILE:-$(pip_config cert)}"
[[ -n "$SSL_CERT_FILE" ]] && export SSL_CERT_FILE
# --compile-bytecode as pip does: compiling at the first import instead would also raise the
# SyntaxWarnings of some packages there (opuslib's "is not 0"), which the tests make errors.
uv_install() {
  "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" \
    --index-strategy unsafe-best-match "${pip_sources[@]}" "$@"
}

torch_resolve
if [[ -n "$TORCH_INDEX" ]]; then
  uv_install --index-url "$TORCH_INDEX" "$TORCH_SPEC" "$TORCHAUDIO_SPEC"
else
  uv_install "${pip_index[@]}" "$TORCH_SPEC" "$TORCHAUDIO_SPEC"
fi

# The Python client is small and pure Python: bench/ uses it, so the plain set-up has it too.
# The dev set-up adds its pipecat and LiveKit extras (tests/integration/test_pipecat.py,
# test_livekit.py). The Docker image copies client_py's metadata for the same install.
packages=(-e ".[model]" -e "./client_py")
[[ $level == dev ]] && packages=(-e ".[model,dev]" -e "./client_py[pipecat,livekit]")
log "installing chattts-stream and its client (${level})"
uv_install "${pip_index[@]}" "${packages[@]}"
# After the packages: importing torch without numpy beside it would warn.
torch_check "$VENV/bin/python"
printf '%s\n%s\n' "$want" "$level" >"$STAMP"
log "ready: $VENV ($level)"
