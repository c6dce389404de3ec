#!/usr/bin/env bash
# Which torch build this machine gets, and from where. scripts/setup.sh sources this file;
# run alone, it prints the choice (and says it in one line on stderr) without installing:
#
#   scripts/torch_choice.sh   ->  variant=cpu  torch_spec=torch==2.13.0+cpu
#                                 torchaudio_spec=torchaudio==2.11.*  index=https://.../whl/cpu
#
# The choice:
#   - no NVIDIA driver (no nvidia-smi, or one that fails): the CPU build from PyTorch's CPU
#     index. PyPI's Linux torch is the CUDA build: gigabytes of CUDA libraries a CPU never uses.
#   - a driver: the CUDA build it can run. nvidia-smi's "CUDA Version" is the newest CUDA the
#     driver supports; the newest build of TORCH_VERSION not newer than that is taken, or else
#     one of the same major version (NVIDIA's minor version compatibility). A driver older than
#     every build gets the CPU build, and the line says to update the driver.
#   - PyTorch's index cannot be reached (a probe with a short timeout) or lacks the build: what
#     pip finds for torch==TORCH_VERSION in its own configured sources (PyPI, a local wheel
#     folder), said in one line.
# uv's own `--torch-backend auto` makes a like choice, but it reads the driver's version from
# /sys and /proc first (a faked nvidia-smi does not steer it), says nothing of what it chose,
# and fails where PyTorch's index is out of reach: setup.sh hands uv this choice's index.
# torchaudio comes from the same index as torch, so both are the same build: PyPI's torchaudio
# is a CUDA build whose compiled extension cannot load beside a CPU torch. torchaudio 2.11 is
# built against torch's stable ABI and works with torch 2.11 and every later release (its
# compatibility matrix), which is why its version is not torch's.
#
# Overrides (environment):
#   TORCH_SPEC=...       install exactly this torch, no detection and no probe; with
#   TORCH_INDEX=URL      from this index (without it: pip's configured sources). TORCH_INDEX
#                        alone replaces PyTorch's index for the detected build.
#   TORCH_VARIANT=cpu|cu126|cu130   no driver detection (a GPU image built without a GPU)
#   PYTORCH_INDEX_BASE=URL  where the per-build indexes are (a mirror of .../whl)
#   TORCH_INDEX_TIMEOUT=S   the probe's timeout in seconds (5)

TORCH_VERSION=2.13.0
# torch 2.13's stable CUDA builds on PyTorch's index (cu132 is experimental), newest first,
# each with the CUDA version it needs from the driver.
TORCH_CUDA_BUILDS=("cu130:13.0" "cu126:12.6")
TORCHAUDIO_SPEC="${TORCHAUDIO_SPEC:-torchaudio==2.11.*}"
PYTORCH_INDEX_BASE="${PYTORCH_INDEX_BASE:-https://download.pytorch.org/whl}"
TORCH_INDEX_TIMEOUT="${TORCH_INDEX_TIMEOUT:-5}"

torch_log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# "13.0" -> 1300, comparable as an integer.
_cuda_number() {
  local major="${1%%.*}" minor="${1#*.}"
  echo $((10#$major * 100 + 10#${minor%%.*}))
}

# Sets TORCH_VARIANT (cpu, cuXXX, or "override" when TORCH_SPEC is set) and TORCH_WHY from
# the environment and nvidia-smi alone: no network, so setup.sh can compare the variant with
# its stamp on every run and probe the index only when it installs.
torch_variant() {
  if [[ -n "${TORCH_SPEC:-}" ]]; then
    TORCH_VARIANT=override
    TORCH_WHY="TORCH_SPEC set"
    return
  fi
  local builds=(cpu "${TORCH_CUDA_BUILDS[@]%%:*}")
  if [[ -n "${TORCH_VARIANT:-}" ]]; then
    if [[ " ${builds[*]} " != *" $TORCH_VARIANT "* ]]; then
      torch_log "TORCH_VARIANT=$TORCH_VARIANT: torch $TORCH_VERSION's builds are ${builds[*]}"
      return 1
    fi
    TORCH_WHY="TORCH_VARIANT set"
    return
  fi
  local smi out cuda
  if ! smi="$(command -v nvidia-smi)"; then
    TORCH_VARIANT=cpu
    TORCH_WHY="no NVIDIA driver: nvidia-smi not found"
    return
  fi
  # nvidia-smi can hang on a wedged driver: bounded. A failing one means no usable GPU.
  if ! out="$(timeout 30 "$smi" 2>&1)"; then
    TORCH_VARIANT=cpu
    TORCH_WHY="nvidia-smi failed: $(head -n 1 <<<"$out")"
    return
  fi
  cuda="$(grep -o -m 1 -E 'CUDA Version: *[0-9]+\.[0-9]+' <<<"$out" | grep -o -E '[0-9]+\.[0-9]+$')" || true
  if [[ -z "$cuda" ]]; then
    TORCH_VARIANT=cpu
    TORCH_WHY="nvidia-smi shows no CUDA version"
    return
  fi
  local have build need same_major=""
  have="$(_cuda_number "$cuda")"
  for build in "${TORCH_CUDA_BUILDS[@]}"; do
    need="$(_cuda_number "${build#*:}")"
    if ((need <= have)); then
      TORCH_VARIANT="${build%%:*}"
      TORCH_WHY="the driver supports CUDA $cuda"
      return
    fi
    ((need / 100 == have / 100)) && same_major="${build%%:*}"
  done
  if [[ -n "$same_major" ]]; then
    TORCH_VARIANT="$same_major"
    TORCH_WHY="the driver supports CUDA $cuda; minor version compatibility"
    return
  fi
  TORCH_VARIANT=cpu
  TORCH_WHY="the driver supports only CUDA $cuda, older than torch $TORCH_VERSION's CUDA builds need (${TORCH_CUDA_BUILDS[*]#*:}): update the driver to use the GPU"
}

# Succeeds when URL (a PEP 503 project page) answers within TORCH_INDEX_TIMEOUT and lists a
# wheel whose name starts with WHEEL; otherwise says why not. A proxy's error page, or an
# index without the pinned build, is a "no" as much as a network that cannot reach it.
torch_index_has() {
  "${PYTHON:-python3}" - "$1" "$2" "$TORCH_INDEX_TIMEOUT" <<'PY'
import sys
import urllib.parse
import urllib.request

url, wheel, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
try:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        page = urllib.parse.unquote(response.read().decode("utf-8", "replace"))
except Exception as e:
    sys.exit(f"cannot be reached within {timeout:g} s ({getattr(e, 'reason', e)})")
if wheel not in page:
    sys.exit(f"lists no {wheel}* wheel")
PY
}

# After torch_variant: sets TORCH_SPEC, TORCH_INDEX (empty: pip's configured sources) and
# TORCHAUDIO_SPEC, probing the index, and says in one line what it chose.
torch_resolve() {
  if [[ "$TORCH_VARIANT" == override ]]; then
    TORCH_INDEX="${TORCH_INDEX:-}"
    local from="${TORCH_INDEX}"
    [[ -n "$from" ]] || from="pip's configured sources"
    torch_log "torch: $TORCH_SPEC as TORCH_SPEC says, from $from"
    return
  fi
  local kind="CPU" build why_not index="${TORCH_INDEX:-$PYTORCH_INDEX_BASE/$TORCH_VARIANT}"
  for build in "${TORCH_CUDA_BUILDS[@]}"; do
    [[ "${build%%:*}" == "$TORCH_VARIANT" ]] && kind="CUDA ${build#*:}"
  done
  if why_not="$(torch_index_has "$index/torch/" "torch-$TORCH_VERSION+$TORCH_VARIANT-" 2>&1)"; then
    TORCH_SPEC="torch==$TORCH_VERSION+$TORCH_VARIANT"
    TORCH_INDEX="$index"
    torch_log "torch: the $kind build ($TORCH_WHY): $TORCH_SPEC and $TORCHAUDIO_SPEC from $TORCH_INDEX"
  else
    TORCH_SPEC="torch==$TORCH_VERSION"
    TORCH_INDEX=""
    torch_log "torch: wanted the $kind build ($TORCH_WHY), but $index $why_not: falling back to what pip finds for $TORCH_SPEC and $TORCHAUDIO_SPEC in its configured sources"
  fi
}

# After the install (PYTHON_IN_VENV as $1): torch and torchaudio import together, and one line
# says which builds they are, or the set-up stops with the import error. One pair cannot
# import: a CPU torch that pip found in a local wheel folder beside PyPI's torchaudio, a CUDA
# build, whose compiled extension needs CUDA torch's libraries. That happens only where
# PyTorch's index cannot be reached (its CPU torchaudio is there alone) and such a folder
# exists, as on our CI machines. torchaudio's loader takes a missing extension as one that
# was not built, and ChatTTS and vocos use only its Python code (MelSpectrogram), so there,
# and only there, the extension is left out, and the line says so.
torch_check() {
  "$1" - <<'PY'
import importlib.util
import pathlib
import re
import subprocess
import sys

import torch

def try_import() -> subprocess.CompletedProcess[str]:
    code = "import torchaudio; print(torchaudio.__version__)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
spec = importlib.util.find_spec("torchaudio")
package = pathlib.Path(spec.origin).parent if spec and spec.origin else None
version = (package / "version.py").read_text() if package else ""
# PyPI's torchaudio (a CUDA build, "+cuXXX") beside a CPU torch.
mismatch = torch.version.cuda is None and re.search(r"__version__ = '[^']*\+cu\d+'", version)
result = try_import()
if result.returncode and mismatch and package:
    for path in (package / "lib").glob("*.so"):
        path.unlink()
    result = try_import()
if result.returncode:
    sys.exit(f"torchaudio does not import beside torch {torch.__version__} ({build}):\n{result.stderr}")
note = ""
if mismatch and package and not any((package / "lib").glob("*.so")):
    note = (
        " without its CUDA extension: PyPI's build beside a CPU torch, since the CPU build is on"
        " PyTorch's index only"
    )
print(
    f"\033[1m[setup]\033[0m installed torch {torch.__version__} ({build}) and torchaudio "
    f"{result.stdout.strip()}{note}",
    file=sys.stderr,
)
PY
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  torch_variant
  torch_resolve
  printf 'variant=%s\ntorch_spec=%s\ntorchaudio_spec=%s\nindex=%s\n' \
    "$TORCH_VARIANT" "$TORCH_SPEC" "$TORCHAUDIO_SPEC" "$TORCH_INDEX"
fi
