#!/usr/bin/env bash
# Issue 20, on the GPU machine: does STRATA_MOE_MMQ_TOKENS (grouped decode experts on the integer tensor cores,
# mmq_moe_group_*) pay? `strata bench` on the 30B shape with it off (65) and at 8; the CUDA tests of the grouped
# experts; the same under the measurement defines MMQ_GROUP_RT2 and MMQ_MOE_RT2 (two 16-row tiles a block
# for the experts' down projections, decode and prompt; pp128 shows the prompt one), and =2 (every width; the
# parity run takes =2, which runs the two-tile code on both widths); scenarios/h200-load.yaml's 32-slot arm with it on
# (parallel-32-moe-mmq8: the harness passes a switch only from the scenario), then off. Each step runs only while the call (600 s) has time. Needs in carry/: strata.xz, strata-harness.xz and
# cuda_parity.xz (release builds, stripped, xz-compressed; cuda_parity is the test binary of
# `cargo test --release -p strata-engine --test cuda_parity --no-run`). Logs and reports go to $OUT.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-harness.xz cuda_parity.xz && chmod +x strata strata-harness cuda_parity)
carry/strata --version
M=synth:qwen3-30b-a3b
bench() { # name, env...
  local n=$1; shift
  env "$@" carry/strata bench --device cuda:0 --model $M --prompt-tokens 16,128 --gen-tokens 32 --sequences 1,8,16,32 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> $OUT/bench-$n.log || tail -5 $OUT/bench-$n.log
  echo "== bench $n at ${SECONDS}s"
  grep -E "^\| (tg|pp)" $OUT/bench-$n.md | awk -F'|' -v n=$n '{printf "%-12s %-14s %10s\n", n, $2, $3}'
}
bench base STRATA_MOE_MMQ_TOKENS=65
bench mmq8 STRATA_MOE_MMQ_TOKENS=8
timeout 150 carry/cuda_parity --ignored --test-threads 1 --nocapture grouped_experts > $OUT/parity.txt 2>&1
echo "parity rc $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|test result|panicked|mmq grouped|grouped experts" $OUT/parity.txt | head -12
[ $SECONDS -lt 230 ] && bench mmq8rt2 STRATA_MOE_MMQ_TOKENS=8 "STRATA_KERNEL_DEFINES=-DMMQ_GROUP_RT2=1 -DMMQ_MOE_RT2=1"
[ $SECONDS -lt 300 ] && bench mmq8rt2all STRATA_MOE_MMQ_TOKENS=8 "STRATA_KERNEL_DEFINES=-DMMQ_GROUP_RT2=2 -DMMQ_MOE_RT2=2"
if [ $SECONDS -lt 380 ]; then
  STRATA_KERNEL_DEFINES="-DMMQ_GROUP_RT2=2 -DMMQ_MOE_RT2=2" timeout 60 carry/cuda_parity --ignored --test-threads 1 --nocapture grouped_experts_on_the_tensor experts_with_few_tokens > $OUT/parity-rt2.txt 2>&1
  echo "parity rt2 rc $? at ${SECONDS}s"; grep -E "test result|panicked|mmq grouped" $OUT/parity-rt2.txt | head -5
fi
if [ $SECONDS -lt 400 ]; then
  mkdir -p $OUT/load
  carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --arm slots=parallel-32-moe-mmq8 --out $OUT/load > $OUT/load.log 2>&1; echo "== load mmq8 rc $? at ${SECONDS}s"
  f=$(ls -d $OUT/load/*/ | head -1); cp $f/report.md $OUT/load-mmq8.md; rm -rf $OUT/load
  grep -E "^\| (single|load)" $OUT/load-mmq8.md
fi
# Without the knob, the same scenario (for the A/B) when time allows.
if [ $SECONDS -lt 470 ]; then
  mkdir -p $OUT/load
  carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --arm slots=parallel-32 --out $OUT/load > $OUT/load-base.log 2>&1; echo "== load base rc $? at ${SECONDS}s"
  f=$(ls -d $OUT/load/*/ | head -1); cp $f/report.md $OUT/load-base.md; rm -rf $OUT/load
  grep -E "^\| (single|load)" $OUT/load-base.md
fi
