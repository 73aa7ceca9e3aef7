#!/usr/bin/env bash
# On the GPU machine, with the release binaries in carry/: the decode of steps of several sequences split over the
# keys (STRATA_BATCH_SPLIT_CELLS=0, splits sized by batch_splits) against one attn_decode launch (the default), in
# one call, after cuda_parity's batched decode test (which runs both). Env: SEQ (default 8,32), DEPTH (default
# 1024,4096), REPS (default 1). Each run's report and log go to $OUT; a short table is printed after each.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
nvidia-smi -L
timeout 120 carry/cuda_parity --ignored --test-threads 1 --nocapture batched_decode > "$OUT/parity.txt" 2>&1
echo "parity rc $?"
grep -E "^test result|FAILED|panicked|batched decode attention" "$OUT/parity.txt" | head -6
for arm in split one-launch; do
  case $arm in split) set_cells=(env STRATA_BATCH_SPLIT_CELLS=0) ;; *) set_cells=(env -u STRATA_BATCH_SPLIT_CELLS) ;; esac
  "${set_cells[@]}" carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --prompt-tokens 512 \
    --gen-tokens 64 --depth "${DEPTH:-1024,4096}" --sequences "${SEQ:-8,32}" --reps "${REPS:-1}" --llama-bench off \
    > "$OUT/$arm.md" 2> "$OUT/$arm.log"
  echo "$arm: rc $? $(carry/strata --version)"
  grep -E "^\| tg" "$OUT/$arm.md" | awk -F'|' '{printf "  %-20s %10s\n", $2, $3}'
done
