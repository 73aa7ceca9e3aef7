#!/usr/bin/env bash
# A/B of two builds on the GPU machine in one call, with the release binaries in carry/: carry/strata (this build)
# against carry/strata-base, `strata bench` alternating between them ROUNDS times (default 2, new first), after the
# whole CUDA parity suite (carry/cuda_parity; PARITY=0 skips it). Each run's report and log go to $OUT; a short
# table is printed after each run.
# Env: MODEL (default synth:qwen3-30b-a3b), PP (default 512,4096), DEPTH (default 0,4096), SEQ (default 1,32),
# REPS (default 3), ROUNDS (default 2), EXTRA (more `strata bench` flags for both builds, e.g. a --vram-budget).
# PARITY_FILTER: run only the parity tests whose names contain it.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
nvidia-smi -L
if [ "${PARITY:-1}" = 1 ]; then
  timeout 280 carry/cuda_parity --ignored --test-threads 1 --nocapture ${PARITY_FILTER:-} > "$OUT/parity-full.txt" 2>&1
  echo "parity rc $?"
  grep -E "test result|panicked|FAILED" "$OUT/parity-full.txt" | tail -8
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  for b in strata strata-base; do
    carry/$b bench --device cuda:0 --model "${MODEL:-synth:qwen3-30b-a3b}" --prompt-tokens "${PP:-512,4096}" \
      --gen-tokens 64 --depth "${DEPTH:-0,4096}" --sequences "${SEQ:-1,32}" --reps "${REPS:-3}" --llama-bench off ${EXTRA:-} \
      > "$OUT/$b-$r.md" 2> "$OUT/$b-$r.log"
    echo "$b run $r: rc $? $(carry/$b --version)"
    grep -E "^\| (pp|tg)" "$OUT/$b-$r.md" | awk -F'|' '{printf "  %-16s %10s %s\n", $2, $3, $4}'
  done
done
