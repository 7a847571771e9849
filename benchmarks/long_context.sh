#!/usr/bin/env bash
# One RL call on a trajectory pair of N tokens (artrl bench memory --context N), for each length and layout:
# the memory plan beside the measured peak, one JSON line each, appended to $OUT (default: stdout).
#   benchmarks/long_context.sh [MODEL] [LENGTHS...]      e.g. benchmarks/long_context.sh random:qwen3-0.6b 2048 4096 8192
# Extra flags for every run go in $FLAGS (e.g. FLAGS=--no-gradient-checkpointing). Runs one at a time: each is
# one process, and two torch processes on one machine's cores slow each other.
set -euo pipefail
model=${1:-random:qwen3-0.6b}
shift || true
lengths=${*:-2048 4096 8192}
out=${OUT:-/dev/stdout}
for layout in prompt completion; do
  for n in $lengths; do
    artrl bench memory --model "$model" --context "$n" --layout "$layout" --gradient-checkpointing ${FLAGS:-} \
      2>/dev/null | tail -1 >> "$out"
  done
done
