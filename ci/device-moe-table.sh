#!/usr/bin/env bash
# Issue 20, on the GPU machine: decode's grouped expert kernel (mmv_moe_group_*) with -DMMV_MOE_GROUP_ONE_TRIP=1
# (the group count and the whole group read in one trip to L2, where the default takes three one after another)
# against the default kernels, one binary (carry/strata): 1. the grouped experts' CUDA test under the define (bit
# for bit against slot by slot); 2. `strata bench` decode of 1, 8 and 16 sequences, default and define
# interleaved, three times each while the call has time (BUDGET seconds, default 330).
# Needs in carry/: strata.xz and cuda_parity.xz (release builds, stripped, xz-compressed; cuda_parity is the test
# binary of `cargo test --release -p strata-engine --test cuda_parity --no-run`).
set -u
OUT=${OUT:-out}; mkdir -p $OUT
BUDGET=${BUDGET:-330}
D=-DMMV_MOE_GROUP_ONE_TRIP=1
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz cuda_parity.xz && chmod +x strata cuda_parity)
carry/strata --version
STRATA_KERNEL_DEFINES=$D timeout 150 carry/cuda_parity --ignored --test-threads 1 --nocapture grouped_experts > $OUT/parity.txt 2>&1
echo "parity ($D) rc $? at ${SECONDS}s"; grep -E "grouped experts|test result|panicked" $OUT/parity.txt | head -6
b() { # name [defines]
  [ $SECONDS -lt $((BUDGET - 40)) ] || return
  STRATA_KERNEL_DEFINES="${2:-}" timeout $((BUDGET - SECONDS - 5)) carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --prompt-tokens 16 --gen-tokens 32 --sequences 1,8,16 --reps 2 --llama-bench off > $OUT/$1.md 2> $OUT/$1.log || tail -3 $OUT/$1.log
  echo "== $1 at ${SECONDS}s"; grep -E "^\| (tg|pp)" $OUT/$1.md | awk -F'|' -v n=$1 '{printf "%-9s %-10s %10s\n", n, $2, $3}'
}
b default
b onetrip $D
b default2
b onetrip2 $D
b default3
b onetrip3 $D
