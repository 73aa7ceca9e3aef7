#!/usr/bin/env bash
# Issue 20: the grouped expert kernel's occupancy against loads in flight (STRATA_KERNEL_DEFINES variants of
# MMV_MOE_MINB and MMV_MOE_NB_LONG; the default build's kernels are main's).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
(cd carry && xz -d -f -k strata-new.xz && chmod +x strata-new)
M=synth:qwen3-30b-a3b
bench() { local n=$1; shift; SECONDS=0; env "$@" carry/strata-new bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 1,8 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> /tmp/bench-$n.log || tail -5 /tmp/bench-$n.log; echo "bench $n ${SECONDS}s"; grep -E "^\| tg32 x8" $OUT/bench-$n.md; }
bench default


bench nb4-minb4 STRATA_KERNEL_DEFINES="-DMMV_MOE_NB_LONG=4 -DMMV_MOE_MINB=4"
bench default-b
echo "== table"
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-12s %-12s %10s %s\n", n, $2, $3, $9}'; done
