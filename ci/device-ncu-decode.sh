#!/usr/bin/env bash
# Where a decode step's time goes, kernel by kernel, without the profiled pass's launch gaps: Nsight Compute's
# gpu__time_duration (caches kept between kernels unless CACHE=all) of every kernel of a few decode steps of `strata bench` on the Qwen3-30B-A3B shape, one
# sequence and eight, summed per kernel name and per step (a step ends at the output head, the one *_q6_k
# launch a step). Each kernel runs alone under ncu, so the sum is the kernels' own time; the bench's step time
# minus it is what launches, dependencies and overlap cost. Needs carry/strata.xz; $OUT gets the CSVs and tables.
set -u
OUT=${OUT:-out}; mkdir -p $OUT/logs
BUDGET=${BUDGET:-400}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz && chmod +x strata)
carry/strata --version
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --version | tail -1
# The bench runs the single stream first, so eight sequences' steps come later: more launches are kept (on an
# H100, 12,000 past 30,000 were still single-stream steps; raise SKIP8).
for n in ${SEQS:-1 8}; do
  [ $SECONDS -lt $((BUDGET - 60)) ] || break
  timeout $((BUDGET - SECONDS - 20)) "$NCU" --clock-control none --cache-control ${CACHE:-none} \
    --metrics gpu__time_duration.sum --csv --launch-skip $((n == 1 ? 30000 : ${SKIP8:-60000})) --launch-count $((n == 1 ? 2000 : 12000)) \
    carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --llama-bench off --prompt-tokens 16 \
    --gen-tokens 64 --sequences $n --reps 1 > $OUT/ncu-x$n.csv 2> $OUT/logs/ncu-x$n.log
  echo "== ncu x$n rc $? at ${SECONDS}s"
  python3 - $OUT/ncu-x$n.csv $n <<'PY' | tee $OUT/kernels-x$n.md
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
at = next(i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Value" in r)
head = rows[at]; rows = [r for r in rows[at + 1:] if len(r) == len(head)]
ki, mi, vi, ui = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value"), head.index("Metric Unit")
seq = []
for r in rows:
    if r[mi] != "gpu__time_duration.sum": continue
    v = float(r[vi].replace(",", ""))
    v = {"nsecond": v / 1000, "ns": v / 1000, "usecond": v, "us": v, "msecond": v * 1000, "ms": v * 1000}[r[ui]]
    seq.append((r[ki].split("(")[0].strip(), v))
heads = [i for i, (k, _) in enumerate(seq) if "q6_k" in k]
# Whole decode steps (output head to output head) of the kind asked for: a step of several sequences runs the
# grouped expert kernel, one sequence's does not; prefill steps (the GEMM kernels) are left out.
several = sys.argv[2] != "1"
win, steps = [], 0
for a, b in zip(heads, heads[1:]):
    step = seq[a + 1: b + 1]
    names = {k for k, _ in step}
    if any("gemm" in k or "mmq_moe" in k for k in names) or any("group" in k for k in names) != several:
        continue
    win += step; steps += 1
if steps == 0: sys.exit(f"no decode step of that kind among {len(seq)} kernels ({len(heads)} output heads)")
tot = collections.defaultdict(float); cnt = collections.Counter()
for k, v in win: tot[k] += v; cnt[k] += 1
print(f"x{sys.argv[2]}: {steps} decode steps, {len(win) / steps:.0f} launches and {sum(tot.values()) / steps:.1f} us of kernels a step")
print("| kernel | launches a step | us a launch | us a step |")
print("|---|---:|---:|---:|")
for k in sorted(tot, key=lambda k: -tot[k]):
    print(f"| {k} | {cnt[k] / steps:.0f} | {tot[k] / cnt[k]:.2f} | {tot[k] / steps:.1f} |")
PY
done
[ "${BENCH:-1}" = 1 ] && timeout 120 carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --llama-bench off --prompt-tokens 16 --gen-tokens 64 --sequences 1,8 --reps 2 > $OUT/bench.md 2> $OUT/logs/bench.log
grep -E "^\| tg" $OUT/bench.md | cut -d'|' -f2,3
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
