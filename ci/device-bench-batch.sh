#!/usr/bin/env bash
# Issue 20 on the GPU, with the release binaries in carry/: batched decode steps, `strata bench --sequences`
# (P sequences decoding together as strata serve's batches do), this build (carry/strata) against
# carry/strata-base in the same call, after the CUDA parity tests of batching (PARITY=0 skips them).
# Env: DEVICE (default cuda:0), MODEL (default synth:qwen3-30b-a3b), SEQ (default 1,4,8,16,32), GEN (decode tokens, default 64), ARMS
# (more runs of carry/strata, separated by ";", each a list of VAR=VALUE and --flags for strata bench, e.g.
# "--batch-invariant"; default: the experts of steps up to 64
# tokens on the device's routing, per slot and grouped, and grouped with the dense matmuls of only up to 16 tokens
# as matrix-vector products, the rest on cuBLAS).
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
nvidia-smi -L
export RUST_BACKTRACE=1
MODEL=${MODEL:-synth:qwen3-30b-a3b}
if [ "${PARITY:-1}" = 1 ]; then
  carry/cuda_parity --ignored --test-threads 1 --nocapture ${PARITY_TESTS:-grouped_experts batched_decode one_step two_sequences a_prefix_taken paged_kv a_device_pool} 2>&1 \
    | grep -E "^test |test result|panicked|grouped|largest|differ" | tee "$OUT/parity.txt"
fi
arm() { # name, binary, env and flags...
  local name=$1 bin=$2 w envs=() flags=(); shift 2
  for w in "$@"; do case $w in --*) flags+=("$w") ;; *) envs+=("$w") ;; esac; done
  env "${envs[@]}" "$bin" bench --device "${DEVICE:-cuda:0}" --model "$MODEL" --prompt-tokens 512 --gen-tokens "${GEN:-64}" \
    --sequences "${SEQ:-1,4,8,16,32}" --reps 2 --llama-bench off "${flags[@]}" > "$OUT/bench-$name.md" 2> "$OUT/bench-$name.log"
  echo "== $name: rc $?"
}
# A base binary older than `strata bench --sequences` cannot run these tests: said, and skipped.
if [ -x carry/strata-base ]; then
  if carry/strata-base bench --help 2>/dev/null | grep -q -- --sequences; then
    arm base carry/strata-base
  else
    echo "== base: skipped ($(carry/strata-base --version 2>&1 | head -1) has no bench --sequences)"
  fi
fi
for b in carry/strata carry/strata-base; do [ -x $b ] && echo "$b: $($b --version 2>&1)"; done
arm new carry/strata
IFS=";" read -ra extra <<< "${ARMS-STRATA_MOE_DEVICE_TOKENS=64 STRATA_MOE_GROUPS=0;STRATA_MOE_DEVICE_TOKENS=64 STRATA_MOE_GROUPS=1;STRATA_MOE_DEVICE_TOKENS=64 STRATA_MOE_GROUPS=1 STRATA_MMV_DENSE_TOKENS=16}"
i=0
for a in "${extra[@]}"; do
  i=$((i+1))
  echo "arm $i: $a" >> "$OUT/arms.txt"
  # shellcheck disable=SC2086 # one VAR=VALUE per word
  arm "arm$i" carry/strata $a
done
[ -f "$OUT/arms.txt" ] && cat "$OUT/arms.txt"
echo
for f in "$OUT"/bench-*.md; do
  n=$(basename "$f" .md)
  grep -E "^\| (pp|tg)" "$f" | awk -F'|' -v n="${n#bench-}" '{printf "%-22s %-16s %10s %s\n", n, $2, $3, $9}'
done
