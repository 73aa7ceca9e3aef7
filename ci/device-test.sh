#!/usr/bin/env bash
# The CUDA checks of issue 6, on a machine with an NVIDIA GPU and no Rust toolchain: the release `strata` binary
# and the cuda_parity test binary are built elsewhere and carried in carry/ (see README "CUDA").
#   ci/device-test.sh            device list, kernel start times (cold, then cached), selftest, parity, KLD,
#                                sync-launch mode, a quick generate on a synthetic model
# Logs go to $OUT (or ./device-out); a short table is printed last.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
BIN=${STRATA_BIN:-carry/strata}
TESTS=${STRATA_CUDA_TESTS:-carry/cuda_parity}
export STRATA_KERNEL_CACHE=$(mktemp -d)
export STRATA_EVENTS=$OUT/events.jsonl
WORK=$(mktemp -d)
declare -a ROWS
row() { ROWS+=("$(printf '%-44s %s' "$1" "$2")"); }

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia-smi.txt"
"$BIN" device --list-devices 2>&1 | tee "$OUT/list-devices.txt"
row "list-devices" "$(grep -c '^device ' "$OUT/list-devices.txt") device(s)"
# --list-devices compiles the kernels (and fills the cache): the cold start gets an empty cache of its own.
STRATA_KERNEL_CACHE=$(mktemp -d) "$BIN" device --selftest 2>&1 | tee "$OUT/selftest-cold.txt"
row "start, kernels compiled (cold cache)" "$(grep -o 'start .*' "$OUT/selftest-cold.txt")"
"$BIN" device --selftest 2>&1 | tee "$OUT/selftest-warm.txt"
row "start, kernels from the cache" "$(grep -o 'start .*' "$OUT/selftest-warm.txt")"
row "selftest" "$(tail -1 "$OUT/selftest-warm.txt")"

# Parity and KLD (single-threaded tests: one GPU context at a time keeps the logs readable).
"$TESTS" --ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/parity.txt"
row "parity tests" "$(grep -E '^test result' "$OUT/parity.txt" | tail -1)"
while read -r l; do row "  KLD" "$l"; done < <(grep -E 'mean KLD' "$OUT/parity.txt")
row "  worst op rows" "$(grep -E 'rel err' "$OUT/parity.txt" | sort -k5 -g -r 2>/dev/null | head -1)"
row "fallback events" "$(grep -c '"fallback"' "$STRATA_EVENTS" 2>/dev/null || echo 0)"

# A synthetic SmolLM2-shaped model and the tiny MoE through `strata generate`, CPU and CUDA, greedy.
"$BIN" fixtures synth --out "$WORK/moe.gguf" --preset tiny-qwen3moe 2>&1 | tail -1
for dev in cpu cuda:0; do
  f=gen-${dev//:/}   # no ':' in names of files that come back
  STRATA_SYNC_LAUNCHES=1 "$BIN" generate --model "$WORK/moe.gguf" --device $dev --prompt "hello" --max-tokens 32 \
    > "$OUT/$f.txt" 2> "$OUT/$f.err"
  row "generate tiny-qwen3moe $dev" "rc=$? $(tail -1 "$OUT/$f.err")"
done
cmp -s "$OUT/gen-cpu.txt" "$OUT/gen-cuda0.txt" && row "greedy text cpu == cuda" "same" || row "greedy text cpu == cuda" "differs"

echo
echo "==== device-test summary (${STRATA_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')})"
printf '%s\n' "${ROWS[@]}"
