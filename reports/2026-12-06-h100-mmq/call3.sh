#!/usr/bin/env bash
# Issue 20: mmq_moe (a prompt's experts with few tokens on the integer tensor cores); the whole CUDA parity suite,
# bench base/new/new STRATA_MMQ=0, then strata serve under load.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
(cd carry && xz -d -f -k *.xz && chmod +x strata strata-base strata-harness cuda_parity)
carry/cuda_parity --ignored --test-threads 1 --nocapture 2>&1 > $OUT/parity-all.txt
grep -E "^test .*(ok|FAILED)$|test result|panicked" $OUT/parity-all.txt | tail -40
grep -E "mmq|moe prefill" $OUT/parity-all.txt | head -60
M=synth:qwen3-30b-a3b
bench() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" $b bench --device cuda:0 --model $M --prompt-tokens 16,128,512 --gen-tokens 32 --sequences 1,8 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> /tmp/bench-$n.log || tail -5 /tmp/bench-$n.log
  echo "== $n rc $?"
}
bench base carry/strata-base
bench new carry/strata
bench new-mmq0 carry/strata STRATA_MMQ=0
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-16s %-12s %10s\n", n, $2, $3}'; done
grep -A8 "pp128, one profiled" $OUT/bench-new.md
mkdir -p $OUT/load
carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --arm slots=parallel-1 --arm slots=parallel-32 --out $OUT/load > /tmp/load.log 2>&1; echo "== load rc $?"
f=$(ls -d $OUT/load/*/ | head -1); cp $f/report.md $OUT/load-report.md; rm -rf $OUT/load
grep -E "^\| (single|load)" $OUT/load-report.md
echo "== table"
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-16s %-12s %10s\n", n, $2, $3}'; done
