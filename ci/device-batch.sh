#!/usr/bin/env bash
# Issue 20 on the H200, with the release binaries in carry/: bash ci/device-batch.sh
# 1. Greedy answers alone and batched (4 at once, --parallel 4) on CUDA, small MoE and the 30B shape: how many of
#    the batched answers equal the alone ones (CUDA's kernels for a step of several tokens are not the decode
#    kernels, so a near tie may part them: issue 20 point 4).
#    Before: the CUDA parity tests of batching (PARITY=0 skips them).
# 2. scenarios/h200-load.yaml: aggregate throughput and latencies at 1..32 clients against the single stream.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
B=carry/strata
nvidia-smi -L
export RUST_BACKTRACE=1
PORT=18080
declare -a ROWS
row() { ROWS+=("$(printf '%-40s %s' "$1" "$2")"); }
if [ "${PARITY:-1}" = 1 ]; then
  carry/cuda_parity --ignored --test-threads 1 --nocapture top_logits one_step two_sequences batched_decode 2>&1 \
    | grep -E "^test |test result|panicked|largest|interleaved" | tee "$OUT/parity.txt"
  row "parity (batching)" "$(grep -E '^test result' "$OUT/parity.txt" | tail -1)"
fi
content() { grep -o '"content":"[^"]*"' "$1" | head -1; }
# BATCH_MODELS="" skips part 1; HARNESS_FLAGS="--quick" shortens part 2 and HARNESS=0 skips it.
for model in ${BATCH_MODELS-synth:small-qwen3moe-q4k synth:qwen3-30b-a3b}; do
  tag=${model#synth:}
  $B serve --device cuda:0 --model $model --parallel 4 --max-context 1024 --port $PORT > "$OUT/serve-$tag.log" 2>&1 &
  pid=$!
  for i in $(seq 1 300); do curl -fs localhost:$PORT/health > /dev/null 2>&1 && break; sleep 1; done
  q() { echo "{\"prompt\": \"$1 the river runs past old stone walls $1\", \"max_tokens\": 48, \"temperature\": 0}"; }
  for i in 0 1 2 3; do curl -s localhost:$PORT/v1/completions -H 'content-type: application/json' -d "$(q "$i")" > "$OUT/alone-$tag-$i.json"; done
  curls=()
  for i in 0 1 2 3; do curl -s localhost:$PORT/v1/completions -H 'content-type: application/json' -d "$(q "$i")" > "$OUT/batched-$tag-$i.json" & curls+=($!); done
  wait "${curls[@]}"
  same=0
  for i in 0 1 2 3; do
    a=$(grep -o '"text":"[^"]*"' "$OUT/alone-$tag-$i.json"); b=$(grep -o '"text":"[^"]*"' "$OUT/batched-$tag-$i.json")
    [ -n "$a" ] && [ "$a" = "$b" ] && same=$((same+1))
  done
  errs=$(grep -l '"error"' "$OUT"/batched-$tag-*.json 2>/dev/null | wc -l)
  row "$tag: batched = alone (greedy, 48 tok)" "$same of 4 ($errs batched answers were errors)"
  kill $pid; wait $pid 2>/dev/null
done
if [ "${HARNESS:-1}" = 1 ]; then
timeout 420 carry/strata-harness run scenarios/h200-load.yaml --strata $B --out $OUT/r ${HARNESS_FLAGS:-} > $OUT/harness.txt 2>&1
row "h200-load rc" "$? $(tail -1 $OUT/harness.txt | cut -c1-120)"
R=$(ls -d $OUT/r/*/ | head -1)
sed -n '/### Load/,/Worker/p' $R/report.md | grep "^| " > $OUT/load-table.md
grep -h "slots\|panicked\|fault\|batching:" $R/logs/*.log | head -30
(cd $OUT && tar czf load-report.tgz r && rm -rf r)
echo; cat $OUT/load-table.md
fi
printf '%s\n' "${ROWS[@]}"
