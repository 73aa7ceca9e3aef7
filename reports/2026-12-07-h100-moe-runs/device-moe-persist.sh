#!/usr/bin/env bash
# Issue 20, on the GPU machine: decode's grouped expert kernels (mmv_moe_group_*) as runs of (group, row tile)
# pairs, about as many blocks as stay resident, against the build before (one block a pair, a block for every
# possible group); and a prompt step's dense Q4_K/Q6_K matrices on the integer tensor cores past 16 tokens
# (STRATA_MMV_DENSE_TOKENS=256) against cuBLAS on an f16 copy. In order, each step only while the call has time
# (BUDGET seconds, default 540):
# 1. the CUDA tests of the grouped experts (bit for bit against slot by slot) and the tiny MoE against the CPU,
#    the latter also with STRATA_MMV_DENSE_TOKENS=256;
# 2. `strata bench` on the 30B shape, decode of 1, 8 and 16 sequences and prompts of 16 to 256 tokens: the build
#    under test, carry/strata-base, and the build under test with STRATA_MMV_DENSE_TOKENS=256;
# 3. scenarios/h200-load.yaml's 32-slot arm (1 to 32 clients), then its arm with STRATA_MMV_DENSE_TOKENS=256;
# 4. the benches of the two builds again.
# Needs in carry/: strata.xz, strata-base.xz, strata-harness.xz and cuda_parity.xz (release builds, stripped,
# xz-compressed; cuda_parity is the test binary of `cargo test --release -p strata-engine --test cuda_parity
# --no-run`). $OUT gets the first bench of each arm, the load reports, the parity output and the logs (a tarball).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/logs"
BUDGET=${BUDGET:-540}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-base.xz strata-harness.xz cuda_parity.xz && chmod +x strata strata-base strata-harness cuda_parity)
carry/strata --version; carry/strata-base --version
M=synth:qwen3-30b-a3b
timeout $((BUDGET / 4)) carry/cuda_parity --ignored --test-threads 1 --nocapture grouped_experts tiny_qwen3moe moe_ffn > $OUT/parity.txt 2>&1
echo "parity rc $? at ${SECONDS}s"
STRATA_MMV_DENSE_TOKENS=256 timeout 60 carry/cuda_parity --ignored --test-threads 1 --nocapture tiny_qwen3moe > $OUT/parity-dense256.txt 2>&1
echo "parity dense256 rc $? at ${SECONDS}s"
grep -hE "^test .*(ok|FAILED)$|test result|panicked|grouped experts|mean KLD" $OUT/parity.txt $OUT/parity-dense256.txt | head -16
bench() { # name, binary, [env]
  [ $SECONDS -lt $((BUDGET - 60)) ] || return
  local n=$1 bin=$2
  timeout $((BUDGET - SECONDS - 15)) env ${3:-} $bin bench --device cuda:0 --model $M --prompt-tokens 16,128,136,256 --gen-tokens 32 --sequences 1,8,16 --reps 2 --llama-bench off > $OUT/logs/bench-$n.md 2> $OUT/logs/bench-$n.log || tail -5 $OUT/logs/bench-$n.log
  echo "== bench $n at ${SECONDS}s"
  grep -E "^\| (tg|pp)" $OUT/logs/bench-$n.md | awk -F'|' -v n=$n '{printf "%-8s %-14s %10s\n", n, $2, $3}'
}
load() { # arm (5 client counts of 15 s and a server start: about 90 s)
  [ $SECONDS -lt $((BUDGET - 100)) ] || return
  local arm=$1
  mkdir -p $OUT/load
  timeout $((BUDGET - SECONDS - 10)) carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --arm slots=$arm --out $OUT/load > $OUT/logs/load-$arm.log 2>&1; echo "== load $arm rc $? at ${SECONDS}s"
  f=$(ls -d $OUT/load/*/ 2>/dev/null | head -1)
  [ -n "$f" ] && [ -f "$f/report.md" ] || { tail -5 $OUT/logs/load-$arm.log; rm -rf $OUT/load; return; }
  cp $f/report.md $OUT/load-$arm.md; cp -r $f/logs $OUT/logs/load-$arm; rm -rf $OUT/load
  grep -E "^\| (single|load)" $OUT/load-$arm.md
}
bench new carry/strata
bench base carry/strata-base
bench dense256 carry/strata STRATA_MMV_DENSE_TOKENS=256
load parallel-32
load parallel-32-mmv-dense-256
bench new2 carry/strata
bench base2 carry/strata-base
cp $OUT/logs/bench-new.md $OUT/logs/bench-base.md $OUT/logs/bench-dense256.md $OUT/ 2>/dev/null
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
