#!/usr/bin/env bash
# Issue 20, on the GPU machine: decode's grouped expert kernel (mmv_moe_group_*) at 8 and 16 sequences.
# 1. `strata bench` decode of 1, 8 and 16 sequences: carry/strata-base, carry/strata, carry/strata with
#    -DMMV_MOE_GROUP_GROUPS_LAST=1 (the blocks of groups past the count launched after every block with work),
#    twice each, interleaved;
# 2. Nsight Compute's full set on two launches of mmv_moe_group_q4_k at 8 sequences (gate/up and down), kernels
#    compiled with -lineinfo, and its per-instruction source page (SASS, with stall samples) as CSV.
# Needs in carry/: strata.xz and strata-base.xz (release builds, stripped, xz-compressed). $OUT: the bench tables,
# the Nsight report and its CSV pages.
set -u
OUT=${OUT:-out}; mkdir -p $OUT/logs
BUDGET=${BUDGET:-400}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-base.xz && chmod +x strata strata-base)
carry/strata --version; carry/strata-base --version
b() { # name bin [defines]
  [ $SECONDS -lt $((BUDGET - 60)) ] || return
  STRATA_KERNEL_DEFINES="${3:-}" timeout 120 $2 bench --device cuda:0 --model synth:qwen3-30b-a3b --prompt-tokens 16 --gen-tokens 32 --sequences 1,8,16 --reps 2 --llama-bench off > $OUT/logs/$1.md 2> $OUT/logs/$1.log || tail -3 $OUT/logs/$1.log
  echo "== $1 at ${SECONDS}s"; grep -E "^\| tg" $OUT/logs/$1.md | awk -F'|' -v n=$1 '{printf "%-10s %-10s %10s\n", n, $2, $3}'
}
b base carry/strata-base
b new carry/strata
b last carry/strata -DMMV_MOE_GROUP_GROUPS_LAST=1
b base2 carry/strata-base
b last2 carry/strata -DMMV_MOE_GROUP_GROUPS_LAST=1
b new2 carry/strata
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --version | tail -1
if [ $SECONDS -lt $((BUDGET - 100)) ]; then
  STRATA_KERNEL_DEFINES=-lineinfo timeout $((BUDGET - SECONDS - 30)) "$NCU" --clock-control none --set full --import-source yes \
    --kernel-name regex:mmv_moe_group_q4_k --launch-skip 200 --launch-count 2 -o $OUT/x8 \
    carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --llama-bench off --prompt-tokens 16 --gen-tokens 4 --sequences 8 --reps 1 \
    > $OUT/logs/ncu.log 2>&1
  echo "== ncu rc $? at ${SECONDS}s"; tail -3 $OUT/logs/ncu.log
  "$NCU" -i $OUT/x8.ncu-rep --page details --csv > $OUT/x8-details.csv 2> $OUT/logs/ncu-details.err
  "$NCU" -i $OUT/x8.ncu-rep --page source --csv --print-source sass > $OUT/x8-source.csv 2> $OUT/logs/ncu-source.err \
    || "$NCU" -i $OUT/x8.ncu-rep --page source --csv > $OUT/x8-source.csv 2>> $OUT/logs/ncu-source.err
  wc -c $OUT/x8-details.csv $OUT/x8-source.csv; head -c 300 $OUT/logs/ncu-source.err
  grep -E "Duration|Achieved Occupancy|DRAM Throughput|Registers Per|Warp Cycles Per Issued|Block Limit" $OUT/x8-details.csv | cut -c1-220 | head -20
fi
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
