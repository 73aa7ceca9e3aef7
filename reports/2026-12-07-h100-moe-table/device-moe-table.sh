#!/usr/bin/env bash
# Issue 20, on the GPU machine: two measurement defines of decode's grouped expert kernel (mmv_moe_group_*), both
# unmeasured, against the default kernels, one binary (carry/strata):
#   -DMMV_MOE_GROUP_ONE_TRIP=1  the group count and the whole group read in one trip to L2 (the default takes
#                               three one after another);
#   -DMMV_MOE_L2_BEFORE_WAIT=1  each lane asks L2 for its rows before the PDL wait, which ptxas places above the
#                               weight loads (reports/2026-12-07-h100-moe-order-ncu/).
# 1. the grouped experts' CUDA test with both defines (bit for bit against slot by slot); 2. `strata bench` decode
# of 1, 8 and 16 sequences: default, each define, both, interleaved, twice each while the call has time (BUDGET
# seconds, default 330).
# Needs in carry/: strata.xz and cuda_parity.xz (release builds, stripped, xz-compressed; cuda_parity is the test
# binary of `cargo test --release -p strata-engine --test cuda_parity --no-run`).
set -u
OUT=${OUT:-out}; mkdir -p $OUT
BUDGET=${BUDGET:-330}
A=-DMMV_MOE_GROUP_ONE_TRIP=1
B=-DMMV_MOE_L2_BEFORE_WAIT=1
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz cuda_parity.xz && chmod +x strata cuda_parity)
carry/strata --version
STRATA_KERNEL_DEFINES="$A $B" timeout 150 carry/cuda_parity --ignored --test-threads 1 --nocapture grouped_experts > $OUT/parity.txt 2>&1
echo "parity ($A $B) rc $? at ${SECONDS}s"; grep -E "grouped experts|test result|panicked" $OUT/parity.txt | head -6
b() { # name [defines]
  [ $SECONDS -lt $((BUDGET - 40)) ] || return
  STRATA_KERNEL_DEFINES="${2:-}" timeout $((BUDGET - SECONDS - 5)) carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --prompt-tokens 16 --gen-tokens 32 --sequences 1,8,16 --reps 2 --llama-bench off > $OUT/$1.md 2> $OUT/$1.log || tail -3 $OUT/$1.log
  echo "== $1 at ${SECONDS}s"; grep -E "^\| (tg|pp)" $OUT/$1.md | awk -F'|' -v n=$1 '{printf "%-9s %-10s %10s\n", n, $2, $3}'
}
b default
b onetrip "$A"
b l2wait "$B"
b both "$A $B"
b default2
b onetrip2 "$A"
b l2wait2 "$B"
b both2 "$A $B"
