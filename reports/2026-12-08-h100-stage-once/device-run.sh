#!/usr/bin/env bash
# Expert launches: activation rows staged once a launch for grouped launches (STRATA_MOE_STAGE_ONCE=1, new default),
# in every block (0), once for every Q4_K/Q6_K launch (2), and 1 with -DMMV_MOE_MINB=4.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/logs"
BUDGET=${BUDGET:-560}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-harness.xz cuda_parity.xz && chmod +x strata strata-harness cuda_parity)
carry/strata --version
timeout 200 carry/cuda_parity --ignored --test-threads 1 --nocapture grouped batched_steps batch_invariant matmul_matches_cpu gemm_fallback gemm_tile_heights tensor_core_q4_k experts_with_few_tokens > $OUT/parity.txt 2>&1
echo "parity rc $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|test result|panicked" $OUT/parity.txt | head -14
grep -E "grouped experts" $OUT/parity.txt | head -8
M=synth:qwen3-30b-a3b
bench() { # name, env...
  [ $SECONDS -lt $((BUDGET - 50)) ] || return
  local n=$1; shift
  env "$@" timeout $((BUDGET - SECONDS - 10)) carry/strata bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 1,8,32 --reps 2 --llama-bench off > $OUT/logs/bench-$n.md 2> $OUT/logs/bench-$n.log || tail -3 $OUT/logs/bench-$n.log
  echo "== bench $n at ${SECONDS}s"
  grep -E "^\| (tg|pp)" $OUT/logs/bench-$n.md | awk -F'|' -v n=$n '{printf "%-8s %-14s %10s\n", n, $2, $3}'
}
bench st1 STRATA_MOE_STAGE_ONCE=1
bench st0 STRATA_MOE_STAGE_ONCE=0
bench st2 STRATA_MOE_STAGE_ONCE=2
source ci/device-load.sh
load parallel-32
load parallel-32-stage-block
bench st1b STRATA_MOE_STAGE_ONCE=1
bench st0b STRATA_MOE_STAGE_ONCE=0
bench st2b STRATA_MOE_STAGE_ONCE=2
bench st1m4 STRATA_MOE_STAGE_ONCE=1 STRATA_KERNEL_DEFINES=-DMMV_MOE_MINB=4
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
