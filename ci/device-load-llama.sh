#!/usr/bin/env bash
# Issue 20's GPU load benchmark beside llama.cpp, on the GPU machine, with the release binaries in carry/:
# builds llama-server (and llama-bench) with CUDA from carry/llama.cpp-src.tar.xz (made here by
# `fixtures/llamacpp/build-cuda.sh pack carry/llama.cpp-src.tar.xz`; about 6 MB), then runs scenarios/h200-load.yaml
# with the single stream, 32 slots and llama-server's 32 slots (ARMS overrides the arms: `--arm` names, spaces
# between). Logs and the report folder go to $OUT; a short table is printed last.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
WORK=${STRATA_WORK:-$(mktemp -d)}
nvidia-smi -L
carry/strata --version
bins=$(TARGETS="llama-bench llama-server" bash fixtures/llamacpp/build-cuda.sh build "${LLAMA_SRC:-carry/llama.cpp-src.tar.xz}" \
  "$WORK/llama-cuda" 2> "$OUT/llamacpp-build.txt") || { tail -n 20 "$OUT/llamacpp-build.txt"; exit 1; }
tail -n 1 "$OUT/llamacpp-build.txt"
server=$(echo "$bins" | grep 'llama-server$')
args=()
for a in ${ARMS:-slots=parallel-1 slots=parallel-32 slots=llama-server-np32}; do args+=(--arm "$a"); done
carry/strata-harness run scenarios/h200-load.yaml --strata carry/strata --llama-server "$server" --out "$OUT" "${args[@]}" \
  > "$OUT/h200-load.txt" 2>&1
echo "h200-load: rc $?"
tail -n 3 "$OUT/h200-load.txt"
# The report's load tables, arm by arm.
for r in "$OUT"/*/report.md; do
  awk '/^## Arm/ {arm=$3} /^\| (single|load) / {print arm, $0}' "$r"
done
