#!/usr/bin/env bash
# Issue 20: as callB, with the host launching the staged kernel (callB's new arm ran the old kernel on staged inputs).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-new.xz cuda_parity.xz && chmod +x strata strata-new cuda_parity)
M=synth:qwen3-30b-a3b
bench() { local n=$1 b=$2; shift 2; SECONDS=0; env "$@" $b bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 1,8,16 --reps 2 --llama-bench off > $OUT/bench-$n.md 2> /tmp/bench-$n.log || tail -5 /tmp/bench-$n.log; echo "bench $n ${SECONDS}s"; }
bench new carry/strata-new
grep -E "^\| tg32 x8" $OUT/bench-new.md
NCU=/usr/local/cuda/bin/ncu
$NCU --clock-control none --cache-control none -k regex:"mmv_moe_groupst_q4_k" --launch-skip 2000 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters --section LaunchStats \
    -o $OUT/ncu-new carry/strata-new bench --device cuda:0 --model $M --prompt-tokens 16 --gen-tokens 32 --sequences 8 --reps 1 --llama-bench off > /tmp/ncu-new.log 2>&1
echo "== ncu rc $?"; tail -2 /tmp/ncu-new.log
$NCU -i $OUT/ncu-new.ncu-rep --page raw --csv > /tmp/raw.csv 2>&1
python3 - /tmp/raw.csv <<'PY' | tee $OUT/ncu-new.txt
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
        keys = [k for k in d if k.startswith('gpu__time_duration.sum') or k in ('launch__grid_size', 'launch__registers_per_thread', 'sm__warps_active.avg.pct_of_peak_sustained_active')]
        print(d['Kernel Name'][:24], ' '.join(f"{k.split('.')[0][-18:]}={d[k]}" for k in keys))
        print('   stalls/issue:', ' '.join(f"{k}={v:.2f}" for k, v in top))
PY
carry/cuda_parity --ignored --test-threads 1 --nocapture grouped_experts moe_ffn tiny_qwen3moe batch_invariant batched_decode 2>&1 > $OUT/parity.txt
grep -E "^test .*(ok|FAILED)$|test result|panicked|grouped experts" $OUT/parity.txt | tail -12
bench new-stage0 carry/strata-new STRATA_MOE_STAGE=0
bench new-minb2 carry/strata-new STRATA_KERNEL_DEFINES="-DMMV_MOE_MINB=2"
bench main carry/strata
bench new-b carry/strata-new
echo "== table"
for f in $OUT/bench-*.md; do grep -E "^\| (tg|pp)" $f | awk -F'|' -v n=$(basename $f .md) '{printf "%-12s %-12s %10s %s\n", n, $2, $3, $9}'; done
