#!/usr/bin/env bash
# Issue 20, on the GPU machine: mmq_moe_* at two 16-row tiles a block (the default now) against one (the build in
# carry/strata-base), STRATA_MMQ_PREFILL_TOKENS=256 (a prompt step of up to 256 tokens runs its experts on
# mmq_moe_* instead of the f16 GEMM) and STRATA_MMV_DENSE_TOKENS=256 (its dense matrices on mmq_* instead of an
# f16 copy and cuBLAS). The CUDA tests of the prompt path; `strata bench` on the 30B shape at 16 to 256 prompt
# tokens, knobs at their defaults, both at 256, each alone; scenarios/h200-load.yaml's 32-slot arm at the
# defaults, then with both at 256. Each step runs only while the call (600 s) has time. Needs in carry/: strata.xz, strata-base.xz, strata-harness.xz and
# cuda_parity.xz (release builds, stripped, xz-compressed; cuda_parity is the test binary of
# `cargo test --release -p strata-engine --test cuda_parity --no-run`). Logs and reports go to $OUT.
# BUDGET (seconds, default 600): a shorter call leaves out what would not end in time.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-600}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-base.xz strata-harness.xz cuda_parity.xz && chmod +x strata strata-base strata-harness cuda_parity)
carry/strata --version; carry/strata-base --version
M=synth:qwen3-30b-a3b
bench() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" $b bench --device cuda:0 --model $M --prompt-tokens 16,128,136,192,256 --gen-tokens 32 --sequences 1,8 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> $OUT/bench-$n.log || tail -5 $OUT/bench-$n.log
  echo "== bench $n at ${SECONDS}s"
  grep -E "^\| (tg|pp)" $OUT/bench-$n.md | awk -F'|' -v n=$n '{printf "%-8s %-14s %10s\n", n, $2, $3}'
}
timeout $((BUDGET / 4)) carry/cuda_parity --ignored --test-threads 1 --nocapture experts_with_few_tokens tensor_core_q4_k gemm_tile_heights moe_ffn tiny_qwen3moe > $OUT/parity.txt 2>&1
echo "parity rc $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|test result|panicked" $OUT/parity.txt | head -12
grep -E "moe prefill .*(200|256)" $OUT/parity.txt | head -4
load() { # arm
  [ $SECONDS -lt $((BUDGET - 100)) ] || return
  local arm=$1
  mkdir -p $OUT/load
  carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --arm slots=$arm --out $OUT/load > $OUT/load-$arm.log 2>&1; echo "== load $arm rc $? at ${SECONDS}s"
  f=$(ls -d $OUT/load/*/ | head -1); cp $f/report.md $OUT/load-$arm.md; rm -rf $OUT/load
  grep -E "^\| (single|load)" $OUT/load-$arm.md
}
ncu_pp128() { # Nsight Compute (clocks left alone) over the first mmq_* launches of a 128-token prompt, knobs at 256
  [ $SECONDS -lt $((BUDGET - 120)) ] || return
  local NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  local m=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_sector_hit_rate.pct
  m=$m,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,launch__grid_size
  m=$m,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  m=$m,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
  m=$m,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
  STRATA_MMQ_PREFILL_TOKENS=256 STRATA_MMV_DENSE_TOKENS=256 timeout 150 "$NCU" --clock-control none --csv --page raw \
    --kernel-name regex:mmq_ --launch-count 8 --metrics $m \
    carry/strata bench --device cuda:0 --model $M --prompt-tokens 128 --gen-tokens 1 --reps 1 --llama-bench off \
    > $OUT/ncu-pp128.csv 2> $OUT/ncu-pp128.err
  echo "== ncu rc $? at ${SECONDS}s"
  python3 - $OUT/ncu-pp128.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 3: print("ncu: no rows"); sys.exit()
h = rows[0]; keep = [i for i, n in enumerate(h) if n in ("Kernel Name",) or "__" in n]
short = lambda n: n.replace("smsp__average_warps_issue_stalled_", "stall_").replace("_per_issue_active.ratio", "").split(".")[0]
for r in rows[2:]:
    print(" ".join(f"{short(h[i])}={r[i]}" for i in keep))
PY
}
bench new carry/strata
if nvidia-smi -L | grep -q H200; then # the H200's serve figure first (the issue's target is on this card)
  load parallel-32
  bench all256 carry/strata STRATA_MMQ_PREFILL_TOKENS=256 STRATA_MMV_DENSE_TOKENS=256
  load parallel-32-mmq-256
else # the H100's parallel-32 is in reports/2026-12-07-h100-moe-mmq: the knobs first
  bench all256 carry/strata STRATA_MMQ_PREFILL_TOKENS=256 STRATA_MMV_DENSE_TOKENS=256
  load parallel-32-mmq-256
  load parallel-32
fi
ncu_pp128
[ $SECONDS -lt $((BUDGET - 70)) ] && bench experts256 carry/strata STRATA_MMQ_PREFILL_TOKENS=256
[ $SECONDS -lt $((BUDGET - 70)) ] && bench dense256 carry/strata STRATA_MMV_DENSE_TOKENS=256
[ $SECONDS -lt $((BUDGET - 70)) ] && bench base carry/strata-base
