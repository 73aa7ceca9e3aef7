#!/usr/bin/env bash
# Issue 20: dense Q4_K products of several tokens on the integer tensor cores (mmq_q4_k) against mmvt; parity,
# bench base/new/new STRATA_MMQ=0, and Nsight Compute over an 8-sequence step.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
(cd carry && xz -d -f -k *.xz && chmod +x strata strata-base strata-harness cuda_parity)
carry/cuda_parity --ignored --test-threads 1 --nocapture tensor_core_q4_k several_tokens_per_loaded grouped_experts batched_decode 2>&1 \
  | grep -E "^test |test result|panicked|mmq|differ|largest|did not" > $OUT/parity.txt
grep -E "^test |test result|panicked" $OUT/parity.txt
M=synth:qwen3-30b-a3b
bench() { # name, binary, env...
  local n=$1 b=$2; shift 2
  env "$@" $b bench --device cuda:0 --model $M --prompt-tokens 16,128 --gen-tokens 32 --sequences 1,4,8,16 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> $OUT/bench-$n.log
  echo "== $n rc $?"
}
bench base carry/strata-base
bench new carry/strata
bench new-mmq0 carry/strata STRATA_MMQ=0
bench new-b carry/strata
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-16s %-12s %10s\n", n, $2, $3}'; done
NCU=/usr/local/cuda/bin/ncu
for arm in 1 0; do
$NCU --clock-control none --cache-control none -k regex:"mmq_|mmvt|mmv_moe_group|q8k_stage" --launch-skip 3000 --launch-count 120 --csv --page raw \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
  env STRATA_MMQ=$arm carry/strata bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 8 --reps 1 --llama-bench off > $OUT/ncu-mmq$arm.csv 2> $OUT/ncu-mmq$arm.log
echo "== ncu mmq=$arm rc $?"
python3 - "$OUT/ncu-mmq$arm.csv" <<'PY'
import csv,sys
h=None; data=[]
for r in csv.reader(open(sys.argv[1])):
    if 'Kernel Name' in r: h=r; continue
    if h and len(r)==len(h) and r[0].isdigit(): data.append(dict(zip(h,r)))
def f(x):
    try: return float(x.replace(',',''))
    except: return 0.0
tot={}
for d in data:
    key=(d['Kernel Name'].split('(')[0][:22], d.get('launch__grid_size'), d.get('launch__registers_per_thread'))
    a=tot.setdefault(key,[0,0,0]); a[0]+=1; a[1]+=f(d['gpu__time_duration.sum']); a[2]+=f(d['dram__bytes_read.sum'])
print(sys.argv[1].split('/')[-1], "kernel grid regs n us_each MB_each GB/s")
for (k,g,rg),(n,t,b) in sorted(tot.items(), key=lambda x:-x[1][1]):
    print(" ",k,g,rg,n,round(t/n/1e3,2),round(b/n/1e6,2),round(b/t) if t else 0)
PY
done
$NCU --clock-control none --cache-control none -k regex:mmv_moe_group --launch-skip 2000 --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
  carry/strata bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 8 --reps 1 --llama-bench off > $OUT/ncu-moe-detail.txt 2> $OUT/ncu-moe-detail.log
echo "== ncu moe detail rc $?"
grep -E "mmv_moe_group|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit Reg|Waves Per SM|Eligible Warps|Issued Warp|No Eligible|L2 Hit|L1/TEX Hit|Grid Size|Max Bandwidth|Warp Cycles Per Issued" $OUT/ncu-moe-detail.txt | head -60
echo; echo "== table"
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-16s %-12s %10s\n", n, $2, $3}'; done
