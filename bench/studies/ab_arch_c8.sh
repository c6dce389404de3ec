#!/usr/bin/env bash
# Issue #17, acceptance 6: the server before the architecture rework (commit ee2787d, checked out
# with `git worktree add /tmp/arch-before ee2787d`) against this tree, closed loop with 8 streams
# on the fake engine, pcm16 and opus, interleaved round by round so that the load of a shared
# machine falls on both. Results: bench/results/studies/arch-c8-fake-<hw>.{md,json}.
#   ROUNDS="1 2 3 4 5 6" bench/studies/ab_arch_c8.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BEFORE=${BEFORE:-/tmp/arch-before}
OUT=${OUT:-/tmp/archbench}
mkdir -p "$OUT"
PY="$PWD/.venv/bin/python"
BEFORE_CMD="sh -c 'cd $BEFORE && exec $PY -m server serve \"\$@\"' serve"
for round in ${ROUNDS:-1 2 3}; do
  for side in before after; do
    cmd=""
    [[ $side == before ]] && cmd="$BEFORE_CMD"
    "$PY" -m bench --engine fake --server-cmd "$cmd" --concurrency 8 --baselines "" \
      --formats pcm16,opus --duration 15 --grace-s 15 --no-plots \
      --title "issue 17 $side round $round (fake engine, c8)" --out "$OUT/$side-$round" \
      > "$OUT/$side-$round.log" 2>&1
    echo "$side $round done"
  done
done
