#!/usr/bin/env bash
# Issue 21's one-GPU part, on the GPU machine with carry/strata and carry/cuda_parity (release builds): the layer
# split with both stages on cuda:0 (`--device cuda:0,cuda:0`, two backends with a stream each).
#   1. cuda_parity, every test, or those whose names contain $PARITY_FILTER (the split's test and the paged KV
#      cache's, whose arrays the split changed)
#   2. the 30B shape, greedy, 32 tokens: one card against the split, and against the split under a 10 GiB budget
#      (5 GiB a stage: each stage's expert cache over its layers, misses uploaded); the logprobs files must be
#      equal byte for byte
#   3. `strata device --selftest` on the split with the 30B shape: each stage's memory plan; `strata serve` on the
#      split, one request: each card's memory readings and each stage's expert-cache counts in its events and
#      /metrics
#   4. `strata bench` pp512 and tg64 of the 30B shape, all resident, one card against the split; then under a
#      budget per card that forces offload on one card: one card at --vram-budget $BUDGET (default 10.7GiB,
#      DESIGN.md section 5's figure) against the split at twice that (its two stages on cuda:0 share a budget by
#      their layers: $BUDGET each, as two cards of $BUDGET would have)
# Logs go to $OUT; a short table is printed last.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
nvidia-smi -L
M=synth:qwen3-30b-a3b
timeout 300 carry/cuda_parity --ignored --test-threads 1 --nocapture ${PARITY_FILTER:-} > "$OUT/parity.txt" 2>&1
echo "parity rc $?"
grep -E "^test result|FAILED|panicked|layer split" "$OUT/parity.txt" | head -8
P="The capital of France is"
for arm in one split split-cache; do
  case $arm in one) dev=cuda:0 ;; split*) dev=cuda:0,cuda:0 ;; esac
  # split-cache: 5 GiB a stage, so each caches its layers' experts; misses uploaded, so the bits stay the same.
  c=(); [ $arm = split-cache ] && c=(--vram-budget 10GiB --miss-policy upload)
  timeout 400 carry/strata generate --model $M --device $dev --prompt "$P" --max-tokens 32 --temp 0 "${c[@]}" \
    --logprobs "$OUT/$arm.logprobs.jsonl" > "$OUT/$arm.txt" 2> "$OUT/$arm.gen.log"
  echo "generate $arm rc $?"; grep -E "layer split|memory plan|ready in|error" "$OUT/$arm.gen.log" | head -6
done
cmp "$OUT/one.logprobs.jsonl" "$OUT/split.logprobs.jsonl" && echo "greedy: logprobs equal byte for byte ($(wc -l < "$OUT/one.logprobs.jsonl") lines)"
cmp "$OUT/one.txt" "$OUT/split.txt" && echo "greedy: text equal"
cmp "$OUT/one.logprobs.jsonl" "$OUT/split-cache.logprobs.jsonl" && echo "greedy, split with expert caches: logprobs equal byte for byte"
grep -E "hit rate|expert cache" "$OUT/split-cache.gen.log" | head -6
# The self-test on the split: the card tested once, then each stage's memory plan as the engine places it.
timeout 120 carry/strata device --selftest --device cuda:0,cuda:0 --model $M --vram-budget 10GiB > "$OUT/selftest-split.txt" 2>&1
echo "selftest split rc $?"; grep -E "^device|^layer split|^memory plan|^  (plan|total|expert cache)|FITS|selftest OK" "$OUT/selftest-split.txt" | head -16
# strata serve on the split: one request; the events must hold each card's memory readings and each stage's
# expert-cache counts.
PORT=$((20000 + RANDOM % 20000))
carry/strata serve --device cuda:0,cuda:0 --model $M --vram-budget 10GiB --miss-policy upload --port $PORT \
  --events "$OUT/serve-split.events.jsonl" > "$OUT/serve-split.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do curl -fs "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break; sleep 1; done
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}' > "$OUT/serve-split.json"
echo "serve split: $(head -c 200 "$OUT/serve-split.json")"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^strata_expert_cache_stage_(lookups|hits)_total" | head -4
kill $SERVER; wait $SERVER 2>/dev/null
grep '"reading"' "$OUT/serve-split.events.jsonl" | head -2 | cut -c1-220
grep '"expert_cache"' "$OUT/serve-split.events.jsonl" | grep -c '"stages"' | sed 's/^/expert_cache events with stages: /'
BUDGET=${BUDGET:-10.7GiB}
for budget in none "$BUDGET"; do
  for arm in one split; do
    case $arm in one) dev=cuda:0 ;; split) dev=cuda:0,cuda:0 ;; esac
    b=()
    if [ "$budget" != none ]; then
      per=${budget%GiB}; [ $arm = split ] && per=$(python3 -c "print(2 * $per)")
      b=(--vram-budget "${per}GiB")
    fi
    timeout 300 carry/strata bench --device $dev --model $M --prompt-tokens 512 --gen-tokens 64 --reps 3 \
      --llama-bench off "${b[@]}" > "$OUT/bench-$arm-$budget.md" 2> "$OUT/bench-$arm-$budget.log"
    echo "bench $arm budget $budget: rc $?"
    grep -E "^\| (pp|tg)" "$OUT/bench-$arm-$budget.md" | awk -F'|' -v a="$arm $budget" '{printf "  %-22s %-8s %10s\n", a, $2, $3}' | tee -a "$OUT/table.txt"
    grep -E "expert cache auto" "$OUT/bench-$arm-$budget.log" | sed 's/^/    /'
  done
done
echo "== table (tok/s) =="; cat "$OUT/table.txt"
