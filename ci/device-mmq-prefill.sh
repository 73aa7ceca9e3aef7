#!/usr/bin/env bash
# Issue 20, on the GPU machine: the prompt path's integer tensor cores at their defaults (a prompt step's experts on
# mmq_moe_* up to 256 tokens, STRATA_MMQ_PREFILL_TOKENS; the dense mmq_* at two 16-row tiles a block) against the
# build before them. In order, each step only while the call has time (BUDGET seconds, default 540):
# 1. the CUDA tests of the prompt path, their summary printed first;
# 2. `strata bench` on the 30B shape at 16 to 256 prompt tokens and decode of 1 and 8 sequences: the build under
#    test, then carry/strata-base (the build before);
# 3. scenarios/h200-load.yaml's 32-slot arm (1 to 32 clients), then the same with the prompt's experts on the f16
#    GEMM past 128 tokens (the former default);
# 4. the two benches again and the scenario's single stream (--parallel 1).
# Needs in carry/: strata.xz, strata-base.xz, strata-harness.xz and cuda_parity.xz (release builds, stripped,
# xz-compressed; cuda_parity is the test binary of `cargo test --release -p strata-engine --test cuda_parity
# --no-run`). $OUT gets the bench and load reports, the parity output and the logs in one tarball (the device
# returns 8 files at most).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/logs"
BUDGET=${BUDGET:-540}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-base.xz strata-harness.xz cuda_parity.xz && chmod +x strata strata-base strata-harness cuda_parity)
carry/strata --version; carry/strata-base --version
M=synth:qwen3-30b-a3b
timeout $((BUDGET / 3)) carry/cuda_parity --ignored --test-threads 1 --nocapture experts_with_few_tokens tensor_core_q4_k tiny_qwen3moe grouped_experts > $OUT/parity.txt 2>&1
echo "parity rc $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|test result|panicked" $OUT/parity.txt | head -12
grep -E "moe prefill .*(200|256)|^mmq " $OUT/parity.txt | head -6
bench() { # name, binary
  [ $SECONDS -lt $((BUDGET - 60)) ] || return
  local n=$1 bin=$2
  timeout $((BUDGET - SECONDS - 15)) $bin bench --device cuda:0 --model $M --prompt-tokens 16,128,136,192,256 --gen-tokens 32 --sequences 1,8 --reps 2 --llama-bench off > $OUT/logs/bench-$n.md 2> $OUT/logs/bench-$n.log || tail -5 $OUT/logs/bench-$n.log
  echo "== bench $n at ${SECONDS}s"
  grep -E "^\| (tg|pp)" $OUT/logs/bench-$n.md | awk -F'|' -v n=$n '{printf "%-6s %-14s %10s\n", n, $2, $3}'
}
source "$(dirname "$0")/device-load.sh" # load ARM: a scenario arm, about 90 s
bench new carry/strata
bench base carry/strata-base
load parallel-32
load parallel-32-mmq-prefill-128
bench new2 carry/strata
bench base2 carry/strata-base
load parallel-1
cp $OUT/logs/bench-new.md $OUT/logs/bench-base.md $OUT/ 2>/dev/null
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
