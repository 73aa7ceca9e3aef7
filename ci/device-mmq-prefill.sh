#!/usr/bin/env bash
# Issue 20, on the GPU machine: a prompt step's experts on the integer tensor cores (mmq_moe_*) past 128 tokens
# (STRATA_MMQ_PREFILL_TOKENS=256), and mmq_moe_* asked for 3 resident blocks an SM (-DMMQ_MOE_MINB=3 through
# STRATA_KERNEL_DEFINES, at most 80 registers: Nsight Compute found it at 2 blocks, 24% of the warps active, DRAM
# 24% of peak), and the dense mmq_* at two tiles a block (-DMMQ_DENSE_RT=2). In order, each step only while the call has time (BUDGET seconds, default 600):
# 1. the CUDA tests of the prompt path (their summary printed first: the parity of 200- and 256-token steps gates
#    the knob's default), then tensor_core_q4_k under -DMMQ_DENSE_RT=2 (mmq_q4_k / mmq_q6_k at two 16-row tiles
#    a block);
# 2. `strata bench` on the 30B shape at 16 to 256 prompt tokens: defaults, the knob at 256, each define (the dense
#    mmq_* run only at pp16 and tg32 x8: past STRATA_MMV_DENSE_TOKENS, 16, a step takes cuBLAS; -DMMQ_MOE_MINB=3
#    spills registers, so that arm measures occupancy and spills together);
# 3. scenarios/h200-load.yaml's 32-slot arm at the defaults (on an H200 first), then with the knob at 256;
# 4. Nsight Compute (clocks left alone) over a 128-token prompt's first mmq_moe_* launches, then over decode's
#    mmv_moe_group_* at 8 sequences, a line a launch.
# Needs in carry/: strata.xz, strata-harness.xz and cuda_parity.xz (release builds, stripped, xz-compressed;
# cuda_parity is the test binary of `cargo test --release -p strata-engine --test cuda_parity --no-run`). $OUT gets
# the bench and load reports, the parity output and the logs in one tarball (the device returns 8 files at most).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/logs"
BUDGET=${BUDGET:-600}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-harness.xz cuda_parity.xz && chmod +x strata strata-harness cuda_parity)
carry/strata --version
M=synth:qwen3-30b-a3b
timeout $((BUDGET / 4)) carry/cuda_parity --ignored --test-threads 1 --nocapture experts_with_few_tokens tensor_core_q4_k gemm_tile_heights moe_ffn tiny_qwen3moe grouped_experts > $OUT/parity.txt 2>&1
echo "parity rc $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|test result|panicked" $OUT/parity.txt | head -12
grep -E "moe prefill .*(200|256)" $OUT/parity.txt | head -4
STRATA_KERNEL_DEFINES=-DMMQ_DENSE_RT=2 timeout $((BUDGET / 8)) carry/cuda_parity --ignored --test-threads 1 tensor_core_q4_k > $OUT/logs/parity-dense-rt2.txt 2>&1
echo "parity under -DMMQ_DENSE_RT=2 rc $? at ${SECONDS}s"
grep -E "^test .*(ok|FAILED)$|panicked" $OUT/logs/parity-dense-rt2.txt | head -3
bench() { # name, env...
  [ $SECONDS -lt $((BUDGET - 60)) ] || return
  local n=$1; shift
  env "$@" timeout $((BUDGET - SECONDS - 15)) carry/strata bench --device cuda:0 --model $M --prompt-tokens 16,128,136,192,256 --gen-tokens 32 --sequences 1,8 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> $OUT/logs/bench-$n.log || tail -5 $OUT/logs/bench-$n.log
  echo "== bench $n at ${SECONDS}s"
  grep -E "^\| (tg|pp)" $OUT/bench-$n.md | awk -F'|' -v n=$n '{printf "%-10s %-14s %10s\n", n, $2, $3}'
}
load() { # arm
  [ $SECONDS -lt $((BUDGET - 100)) ] || return
  local arm=$1
  mkdir -p $OUT/load
  timeout $((BUDGET - SECONDS - 15)) carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --arm slots=$arm --out $OUT/load > $OUT/logs/load-$arm.log 2>&1; echo "== load $arm rc $? at ${SECONDS}s"
  f=$(ls -d $OUT/load/*/ | head -1); cp $f/report.md $OUT/load-$arm.md; cp -r $f/logs $OUT/logs/load-$arm; rm -rf $OUT/load
  grep -E "^\| (single|load)" $OUT/load-$arm.md
}
ncu_run() { # name, kernel regex, launches to skip, bench arguments...
  [ $SECONDS -lt $((BUDGET - 90)) ] || return
  local name=$1 re=$2 skip=$3; shift 3
  local NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  local m=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_sector_hit_rate.pct
  m=$m,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size
  m=$m,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
  timeout 80 "$NCU" --clock-control none --csv --page raw --kernel-name regex:$re --launch-skip $skip --launch-count 6 --metrics $m \
    carry/strata bench --device cuda:0 --model $M --llama-bench off "$@" \
    > $OUT/logs/ncu-$name.csv 2> $OUT/logs/ncu-$name.err
  echo "== ncu $name rc $? at ${SECONDS}s"
  python3 - $OUT/logs/ncu-$name.csv "$m" <<'PY'
import csv, sys
want = sys.argv[2].split(",")
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if len(rows) < 3: sys.exit(print("ncu: no rows"))
h = rows[0]
cols = [h.index("Kernel Name")] + [h.index(n) for n in want if n in h]
for r in rows[2:]:
    print(" | ".join(f"{h[i].split('.')[0].replace('smsp__average_warps_issue_stalled_', '')}={r[i]}" for i in cols))
PY
}
h200=$(nvidia-smi -L | grep -c H200)
bench new
if [ "$h200" -gt 0 ]; then load parallel-32; fi
bench mmq256 STRATA_MMQ_PREFILL_TOKENS=256
bench denseRT2 STRATA_KERNEL_DEFINES=-DMMQ_DENSE_RT=2
bench minb3 STRATA_KERNEL_DEFINES=-DMMQ_MOE_MINB=3
load parallel-32-mmq-prefill-256
if [ "$h200" -eq 0 ]; then load parallel-32; fi
ncu_run pp128 mmq_moe 0 --prompt-tokens 128 --gen-tokens 1 --reps 1
# decode at 8 sequences: past the prompt steps' launches (2 matrices x 48 layers each)
ncu_run x8 mmv_moe_group 200 --prompt-tokens 16 --gen-tokens 4 --sequences 8 --reps 1
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
