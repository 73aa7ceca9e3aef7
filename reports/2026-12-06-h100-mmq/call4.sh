#!/usr/bin/env bash
# Issue 20: mmq_moe for every expert of a step of up to 128 tokens; parity subset, bench base/new, serve load.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-base.xz cuda_parity.xz strata-harness.xz && chmod +x strata strata-base strata-harness cuda_parity)
carry/cuda_parity --ignored --test-threads 1 --nocapture experts_with_few tensor_core_q4_k gemm_tile_heights moe_ffn the_expert_cache tiny_qwen3moe 2>&1 > $OUT/parity.txt
grep -E "^test .*(ok|FAILED)$|test result|panicked|FAIL" $OUT/parity.txt | tail -20
grep -E "mmq|moe prefill Q4_K n_tok=(8|128)" $OUT/parity.txt | grep -v "^mmq Q" | head -20
M=synth:qwen3-30b-a3b
bench() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" $b bench --device cuda:0 --model $M --prompt-tokens 16,128 --gen-tokens 32 --sequences 1,8 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> /tmp/bench-$n.log || tail -5 /tmp/bench-$n.log
  echo "== $n rc $?"
}
bench new carry/strata
bench base carry/strata-base
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-16s %-12s %10s\n", n, $2, $3}'; done
grep -A10 "pp128, one profiled" $OUT/bench-new.md
mkdir -p $OUT/load
carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --arm slots=parallel-1 --arm slots=parallel-32 --out $OUT/load > /tmp/load.log 2>&1; echo "== load rc $?"
f=$(ls -d $OUT/load/*/ | head -1); cp $f/report.md $OUT/load-report.md; rm -rf $OUT/load
grep -E "^\| (single|load)" $OUT/load-report.md
