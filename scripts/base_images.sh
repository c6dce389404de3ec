#!/usr/bin/env bash
# The Dockerfile's base images are pinned by digest (its ARG ..._IMAGE=NAME:TAG@sha256:...
# lines before the first FROM). Without arguments this prints each pin and the command that
# shows the tag's current digest; nothing here needs Docker:
#
#   scripts/base_images.sh             BASE_IMAGE: python:3.11-slim-bookworm@sha256:...
#                                        docker buildx imagetools inspect python:3.11-slim-bookworm
#
# With --resolve it runs those commands (Docker with buildx, and the registry reachable) and
# prints each ARG line with the tag's digest now, to paste into the Dockerfile after reading
# what changed in the image (for an official image: docker-library/repo-info's
# repos/NAME/remote/TAG.md).
set -euo pipefail
cd "$(dirname "$0")/.."

RESOLVE=0
case "${1:-}" in
  --resolve) RESOLVE=1 ;;
  "") ;;
  *) echo "usage: scripts/base_images.sh [--resolve]" >&2 && exit 2 ;;
esac

pin='^ARG ([A-Z0-9_]*IMAGE)=([^@[:space:]]+)@(sha256:[0-9a-f]{64})$'
found=0
while IFS= read -r line; do
  [[ "$line" == FROM* ]] && break
  [[ "$line" =~ $pin ]] || continue
  found=1
  name="${BASH_REMATCH[1]}" tag="${BASH_REMATCH[2]}" pinned="${BASH_REMATCH[3]}"
  if [[ $RESOLVE -eq 0 ]]; then
    printf '%s: %s@%s\n  docker buildx imagetools inspect %s\n' "$name" "$tag" "$pinned" "$tag"
    continue
  fi
  if ! shown="$(docker buildx imagetools inspect "$tag")"; then
    echo "docker buildx imagetools inspect $tag failed" >&2
    exit 1
  fi
  # The first "Digest:" of the text output is the tag's own (the multi-platform index).
  digest="$(awk '$1 == "Digest:" { print $2; exit }' <<<"$shown")"
  if [[ ! "$digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "docker buildx imagetools inspect $tag shows no digest" >&2
    exit 1
  fi
  note="unchanged"
  [[ "$digest" == "$pinned" ]] || note="was $pinned"
  printf 'ARG %s=%s@%s   # %s\n' "$name" "$tag" "$digest" "$note"
done <Dockerfile
if [[ $found -eq 0 ]]; then
  echo "the Dockerfile pins no base image by digest (ARG ..._IMAGE=NAME:TAG@sha256:... before FROM)" >&2
  exit 1
fi
