#!/usr/bin/env bash
# Issue 20: the grouped expert kernel reading activations staged once per launch (mmv_moe_groupst_*, q8k_stage
# with the GLU) against staging in each block (mmv_moe_group_*). The whole CUDA parity suite with the new build,
# bench x8/x16 main vs new vs new STRATA_MOE_STAGE=0 vs MINB=2, and Nsight stalls of both kernels.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-new.xz cuda_parity.xz && chmod +x strata strata-new cuda_parity)
SECONDS=0
carry/cuda_parity --ignored --test-threads 1 --nocapture 2>&1 > $OUT/parity-all.txt
echo "parity ${SECONDS}s"; grep -E "^test .*(FAILED)$|test result|panicked|grouped experts" $OUT/parity-all.txt | tail -12
M=synth:qwen3-30b-a3b
bench() { local n=$1 b=$2; shift 2; SECONDS=0; env "$@" $b bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 1,8,16 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> /tmp/bench-$n.log || tail -5 /tmp/bench-$n.log; echo "bench $n ${SECONDS}s"; }
bench main carry/strata
bench new carry/strata-new
bench new-stage0 carry/strata-new STRATA_MOE_STAGE=0
bench new-minb2 carry/strata-new STRATA_KERNEL_DEFINES="-DMMV_MOE_MINB=2"
bench main-b carry/strata
bench new-b carry/strata-new
NCU=/usr/local/cuda/bin/ncu
for v in new-stage0:1:mmv_moe_group_q4_k new:1:mmv_moe_groupst_q4_k; do
  n=${v%%:*}; k=${v##*:}; s=0; [ $n = new-stage0 ] && s=0 || s=1
  STRATA_MOE_STAGE=$s $NCU --clock-control none --cache-control none -k regex:"$k" --launch-skip 2000 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters --section LaunchStats \
    -o $OUT/ncu-$n carry/strata-new bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 8 --reps 1 --llama-bench off > /tmp/ncu-$n.log 2>&1
  echo "== ncu $n rc $?"; tail -2 /tmp/ncu-$n.log
  $NCU -i $OUT/ncu-$n.ncu-rep --page raw --csv > /tmp/raw-$n.csv 2>&1
  $NCU -i $OUT/ncu-$n.ncu-rep --page source --csv --print-source sass > /tmp/sass-$n.csv 2>&1
  python3 - /tmp/raw-$n.csv /tmp/sass-$n.csv $k <<'PY' | tee $OUT/ncu-$n.txt
import csv, sys
def n(x):
    try: return float(str(x).replace(',', ''))
    except: return 0.0
rows = list(csv.reader(open(sys.argv[1])))
h = next((r for r in rows if 'Kernel Name' in r), None)
for r in rows:
    if h and len(r) == len(h) and r[0].isdigit():
        d = dict(zip(h, r))
        st = {k.split('stalled_')[1].split('_per')[0]: n(v) for k, v in d.items() if 'average_warps_issue_stalled' in k and k.endswith('per_issue_active.ratio')}
        top = sorted(st.items(), key=lambda kv: -kv[1])[:7]
        keys = [k for k in d if k.startswith('gpu__time_duration.sum') or k.startswith('dram__bytes_read.sum') or k in ('launch__grid_size', 'launch__registers_per_thread', 'sm__warps_active.avg.pct_of_peak_sustained_active', 'dram__throughput.avg.pct_of_peak_sustained_elapsed', 'smsp__issue_active.avg.pct_of_peak_sustained_active')]
        print(d['Kernel Name'][:24], ' '.join(f"{k.split('.')[0][-18:]}={d[k]}" for k in keys))
        print('   stalls/issue:', ' '.join(f"{k}={v:.2f}" for k, v in top))
try:
    lines = list(csv.reader(open(sys.argv[2])))
    hi = next(i for i, r in enumerate(lines) if 'Source' in r)
    hh = lines[hi]; data = [r for r in lines[hi+1:] if len(r) == len(hh)]
    sc = next(c for c in hh if 'Warp Stall Sampling (All' in c); si = hh.index(sc); src = hh.index('Source')
    tot = sum(n(r[si]) for r in data)
    print('sass: %d rows, %d samples' % (len(data), tot))
    for r in sorted(data, key=lambda r: -n(r[si]))[:16]:
        print(f"  {100*n(r[si])/max(tot,1):5.1f}% {r[src][:100]}")
except Exception as e:
    print('sass parse failed', e, open(sys.argv[2]).read()[:300])
PY
done
echo "== table"
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-12s %-12s %10s %s\n", n, $2, $3, $9}'; done
