#!/usr/bin/env bash
# Issue 20, on the GPU machine (meant for an H200): the served figures of scenarios/h200-load.yaml at today's
# defaults beside `strata bench`'s single stream and 8-sequence decode on the same card. In order, each step only
# while the call has time (BUDGET seconds, default 420): the bench (prompt 16 and 128, decode of 1 and 8
# sequences); the scenario's 32-slot arm (1 to 32 clients) and its single stream (--parallel 1), or the arms
# LOAD_ARMS names (BENCH=0 leaves the bench out); then, with OFFLOAD=1,
# issue 16's decode figures (tg64, pp512) through the expert cache under --vram-budget 10.7GiB (locality and
# uniform routing traces) and 1.9GiB (locality).
# Needs in carry/: strata.xz and strata-harness.xz (release builds, stripped, xz-compressed). $OUT gets the bench
# and load reports, the logs in one tarball.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT/logs"
BUDGET=${BUDGET:-420}
nvidia-smi -L
(cd carry && xz -d -f -k strata.xz strata-harness.xz && chmod +x strata strata-harness)
carry/strata --version
[ "${BENCH:-1}" = 1 ] && timeout $((BUDGET / 3)) carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --prompt-tokens 16,128 --gen-tokens 32 --sequences 1,8 --reps 2 --llama-bench off > $OUT/bench.md 2> $OUT/logs/bench.log || tail -5 $OUT/logs/bench.log
echo "== bench at ${SECONDS}s"; [ -f $OUT/bench.md ] && grep -E "^\| (tg|pp)" $OUT/bench.md | awk -F'|' '{printf "%-14s %10s\n", $2, $3}'
source "$(dirname "$0")/device-load.sh" # load ARM: a scenario arm, about 90 s
for arm in ${LOAD_ARMS:-parallel-32 parallel-1}; do load $arm; done
offload() { # name, bench args
  [ "${OFFLOAD:-0}" = 1 ] && [ $SECONDS -lt $((BUDGET - 60)) ] || return
  local n=$1; shift
  timeout $((BUDGET - SECONDS - 10)) carry/strata bench --device cuda:0 --model synth:qwen3-30b-a3b --llama-bench off --reps 1 --prompt-tokens 512 --gen-tokens 64 "$@" > $OUT/offload-$n.md 2> $OUT/logs/offload-$n.log
  echo "== offload $n rc $? at ${SECONDS}s"
  grep -E "expert cache|expert misses|error" $OUT/logs/offload-$n.log | cut -c1-150 | head -4
  grep -E "^\| (pp|tg)" $OUT/offload-$n.md | cut -d'|' -f2,3,4,5,6 | tr -s ' '
}
offload b10.7-locality --vram-budget 10.7GiB --routing-trace synth:locality
offload b10.7-uniform --vram-budget 10.7GiB --routing-trace synth:uniform
offload b1.9-locality --vram-budget 1.9GiB --prefill 512 --routing-trace synth:locality
tar -C $OUT -czf $OUT/logs.tgz logs && rm -rf $OUT/logs
nvidia-smi -L
