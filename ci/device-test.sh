#!/usr/bin/env bash
# The CUDA checks and benchmarks of issue 6, on a machine with an NVIDIA GPU and no Rust toolchain: the release
# `strata` binary and the cuda_parity test binary are built elsewhere and carried in carry/ (see README "CUDA").
#   ci/device-test.sh [parity] [routing] [bench-small] [bench-30b] [decode-30b] [ablate-30b] [harness] [regs] [profile-30b]
#                     [offload-30b]
#   (default: parity routing bench-small)
#     parity       device list, kernel start times (cold, then cached), selftest, op parity table, end-to-end KLD,
#                  greedy text CPU vs CUDA, the injected cuBLAS failure and its one fallback event
#     routing      `strata generate --dump-routing` of the tiny MoE on the CPU, on CUDA all resident and on CUDA through
#                  the expert cache (4 slots; 16 slots saving their profile, then pre-filled from it): each cached
#                  run's trace and text must equal the resident one's; the CPU's beside them
#     bench-small  `strata bench --device cuda:0` on a SmolLM2-135M-shaped model (llama, Q4_1, Q8_0 embedding)
#     bench-30b    the same on a Qwen3-30B-A3B-shaped qwen3moe (Q4_K, Q6_K output), generated here (about 17 GB)
#     harness      `strata-harness run SCENARIO $HARNESS_FLAGS` for each of $HARNESS_SCENARIOS (default
#                  scenarios/h200.yaml; scenarios/offload-h200.yaml is the expert-cache matrix) with
#                  carry/strata-harness, the report folders as one .tgz
#     decode-30b   decode of the 30B shape at cache depths 0, 1024 and 8192 (`strata bench --depth`), with
#                  programmatic dependent launch on (the default) and off (STRATA_PDL=0)
#     ablate-30b   decode (tg128) of the 30B shape with each small kernel left out in turn (STRATA_SKIP_KERNELS):
#                  what each one costs inside the decode graph (the tokens are wrong; only the time counts); then
#                  tg128 with each variant of VARIANTS (';'-separated environment assignments, such as
#                  STRATA_KERNEL_DEFINES=-DMMV_MINB=3)
#     regs         registers, spills and shared memory per thread of REGS_KERNELS (ptxas -v on the cached PTX:
#                  the driver's JIT compiles the same PTX with the same default optimisation)
#     ab-30b       before/after in one call: `strata bench` (pp512, pp2048, tg128) of the 30B shape with
#                  $BASE_BIN (default carry/strata-base, a build of the revision to compare with) and $BIN, taking
#                  turns ROUNDS times (default 2; ORDER="new base" runs the new one first in each round), then each
#                  test's best round per binary and the ratio new / base
#     offload-30b  the 30B shape with its experts in host memory and a VRAM expert cache: `strata bench` (pp512,
#                  pp4096, tg64) all resident, then under --vram-budget 10.7GiB and 1.9GiB (llama.cpp's -ncmoe 20
#                  and 48 use that much; DESIGN.md section 5), routed by a uniform trace and by the published
#                  locality (--routing-trace), from the arena and with --mmap-experts, decode misses split between
#                  the link and the CPU (--miss-policy auto, the default) and, in the -upload arms, all uploaded,
#                  with each run's sizing and miss-plan lines, hit rates and bytes uploaded and computed by the CPU
#                  per token (OFFLOAD_CONFIGS: "name|bench args;..." replaces the set)
#     llamacpp-30b llama.cpp's llama-bench beside on the same 30B-shaped file: built here with CUDA from
#                  $LLAMA_SRC (default carry/llama.cpp-src.tar.xz, made by fixtures/llamacpp/build-cuda.sh pack), then
#                  pp512 and tg64 with flash attention, all layers on the GPU and the experts of the first
#                  $NCMOE layers (default 0,20,48) on the CPU (-ncmoe), with nvidia-smi's peak VRAM of each run
#     profile-30b  Nsight Compute (ncu, clocks left alone) over the first decode steps of the 30B shape: every
#                  kernel's duration and DRAM bytes, one CSV row per launch (graph nodes one by one)
# Logs and reports go to $OUT (or ./device-out); a short table is printed last.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
BIN=${STRATA_BIN:-carry/strata}
TESTS=${STRATA_CUDA_TESTS:-carry/cuda_parity}
export STRATA_KERNEL_CACHE=$(mktemp -d)
WORK=${STRATA_WORK:-$(mktemp -d)}
mkdir -p "$WORK"
MODES=${*:-parity routing bench-small}
NCMOE=${NCMOE:-0,20,48}
declare -a ROWS
row() { ROWS+=("$(printf '%-44s %s' "$1" "$2")"); }

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia-smi.txt"

for mode in $MODES; do
case $mode in
parity)
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
  row "  op rows within tolerance" "$(grep -c 'rel err.* ok$' "$OUT/parity.txt") of $(grep -c 'rel err' "$OUT/parity.txt")"
  while read -r l; do row "  KLD" "$l"; done < <(grep -E 'mean KLD' "$OUT/parity.txt")
  row "  fallback events (gemm test)" "$(grep -c 'strata: fallback:' "$OUT/parity.txt")"
  # The tiny MoE through `strata generate`, CPU and CUDA, greedy; then an injected cuBLAS failure.
  "$BIN" fixtures synth --out "$WORK/moe.gguf" --preset tiny-qwen3moe 2>&1 | tail -1
  for dev in cpu cuda:0; do
    f=gen-${dev//:/}   # no ':' in names of files that come back
    STRATA_SYNC_LAUNCHES=1 "$BIN" generate --model "$WORK/moe.gguf" --device $dev --prompt "hello" --max-tokens 32 \
      > "$OUT/$f.txt" 2> "$OUT/$f.err"
    row "generate tiny-qwen3moe $dev" "rc=$? $(tail -1 "$OUT/$f.err")"
  done
  cmp -s "$OUT/gen-cpu.txt" "$OUT/gen-cuda0.txt" && row "greedy text cpu == cuda" "same" || row "greedy text cpu == cuda" "differs"
  long=$(printf 'the quick brown fox %.0s' $(seq 1 60))
  STRATA_FAULT='prefill_gemm:m>64' "$BIN" generate --model "$WORK/moe.gguf" --device cuda:0 --prompt "$long" \
    --max-tokens 8 --prefill 256 > "$OUT/gen-fault.txt" 2> "$OUT/gen-fault.err"
  row "STRATA_FAULT=prefill_gemm:m>64, fallback on" "rc=$? fallback events: $(grep -c 'strata: fallback:' "$OUT/gen-fault.err")"
  ;;
routing)
  [ -f "$WORK/moe.gguf" ] || "$BIN" fixtures synth --out "$WORK/moe.gguf" --preset tiny-qwen3moe 2>&1 | tail -1
  # --dump-routing: every step's routed experts, CPU, CUDA all resident, and CUDA through the expert cache (4 slots
  # on the device's table; 16 slots saving the profile they learn, then pre-filled from it, LRU and pinned): every
  # cached run routes, and writes, exactly as the resident one; the CPU's routing beside them.
  P=$WORK/profile.json; rm -f "$P"
  for name in cpu cuda0 cuda0-cache4 cuda0-cache16-save cuda0-cache16-lru-profile cuda0-cache16-pinned-profile; do
    case $name in
      cpu) args=(--device cpu) ;;
      cuda0) args=(--device cuda:0) ;;
      cuda0-cache4) args=(--device cuda:0 --expert-cache 4) ;;
      cuda0-cache16-save) args=(--device cuda:0 --expert-cache 16 --save-expert-profile "$P") ;;
      cuda0-cache16-lru-profile) args=(--device cuda:0 --expert-cache 16 --expert-profile "$P") ;;
      cuda0-cache16-pinned-profile) args=(--device cuda:0 --expert-cache 16 --expert-profile "$P" --expert-policy profile) ;;
    esac
    "$BIN" generate --model "$WORK/moe.gguf" "${args[@]}" --prompt "hello" --max-tokens 32 \
      --dump-routing "$OUT/routing-$name.jsonl" > "$OUT/routing-$name.txt" 2> "$OUT/routing-$name.err"
    row "--dump-routing $name" "rc=$? $(($(wc -l < "$OUT/routing-$name.jsonl") - 1)) records"
    while read -r l; do row "  " "$l"; done < <(grep -E 'pre-filled|decode expert cache' "$OUT/routing-$name.err" | cut -c9-120)
    if [[ $name == cuda0-* ]]; then
      cmp -s "$OUT/routing-cuda0.jsonl" "$OUT/routing-$name.jsonl" && cmp -s "$OUT/routing-cuda0.txt" "$OUT/routing-$name.txt" \
        && row "  routing and text == cuda resident" "same" || row "  routing and text == cuda resident" "differs"
    fi
  done
  [ -f "$P" ] && cp "$P" "$OUT/profile.json"
  row "  routing records cpu == cuda" "$(paste "$OUT/routing-cpu.jsonl" "$OUT/routing-cuda0.jsonl" | awk -F'\t' '$1 == $2' | wc -l) of $(wc -l < "$OUT/routing-cpu.jsonl") lines"
  ;;
bench-small)
  "$BIN" fixtures synth --out "$WORK/smollm2-shaped.gguf" --arch llama --layers 30 --embd 576 --ff 1536 --heads 9 \
    --heads-kv 3 --head-dim 64 --experts 0 --experts-used 0 --ff-exp 0 --vocab 49152 --ctx 8192 --type Q4_1 \
    --type-embd Q8_0 --tied-output 2>&1 | tail -1
  "$BIN" bench --device cuda:0 --model "$WORK/smollm2-shaped.gguf" --llama-bench off --reps 5 \
    --prompt-tokens 128,512,2048 --gen-tokens 128 --prefill 2048 > "$OUT/bench-smollm2-shaped.md" 2> "$OUT/bench-smollm2-shaped.err"
  row "bench smollm2-shaped" "rc=$?"
  while read -r l; do row "  " "$l"; done < <(grep -E '^\| (pp|tg)' "$OUT/bench-smollm2-shaped.md" | cut -d'|' -f2,3,9)
  ;;
bench-30b|profile-30b|decode-30b|ablate-30b|ab-30b|offload-30b|llamacpp-30b)
  [ -f "$WORK/q30.gguf" ] || /usr/bin/time -v "$BIN" fixtures synth --preset qwen3-30b-a3b --random-blocks --out "$WORK/q30.gguf" > "$OUT/synth-30b.txt" 2>&1
  row "synth qwen3-30b-a3b" "$(grep -E 'Elapsed' "$OUT/synth-30b.txt" | awk '{print $NF}') $(stat -c %s "$WORK/q30.gguf") bytes"
  # The memory plan (memory/, the one `strata inspect` prints too) against the card's free memory.
  "$BIN" device --selftest --model "$WORK/q30.gguf" --max-context 32768 > "$OUT/selftest-plan-30b.txt" 2>&1
  row "memory plan 30B shape, 32k f16 KV" "rc=$? $(grep -E '^  plan  ' "$OUT/selftest-plan-30b.txt" | tr -s ' ') $(grep -o 'DOES NOT FIT\|FITS' "$OUT/selftest-plan-30b.txt")"
  if [ $mode = profile-30b ]; then
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    "$NCU" --clock-control none --graph-profiling node --csv --page raw --launch-count ${NCU_LAUNCHES:-1700} \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
      "$BIN" generate --model "$WORK/q30.gguf" --device cuda:0 --prompt "hello" --max-tokens 3 \
      > "$OUT/ncu-decode-30b.csv" 2> "$OUT/ncu-decode-30b.err"
    row "ncu decode 30b" "rc=$? $(wc -l < "$OUT/ncu-decode-30b.csv") rows"
    continue
  fi
  if [ $mode = ablate-30b ]; then
    for skip in ${ABLATE_KERNELS:-none add_rms_norm router_route moe_combine_add_rms_norm attn_decode mmv1_q4_k mmv_moe_q4_k top_logits_part,top_logits_final}; do
      STRATA_SKIP_KERNELS=${skip/none/} "$BIN" bench --device cuda:0 --model "$WORK/q30.gguf" --llama-bench off --reps 3 \
        --prompt-tokens 16 --gen-tokens 128 > "$OUT/ablate-$skip.md" 2> "$OUT/ablate-$skip.err"
      row "tg128 without $skip" "rc=$? $(grep -E '^\| tg' "$OUT/ablate-$skip.md" | cut -d'|' -f3)"
    done
    # Variants: one environment assignment each, ';'-separated, e.g. "STRATA_KERNEL_DEFINES=-DMMV_MINB=3".
    IFS=';' read -ra variants <<< "${VARIANTS:-}"
    for i in "${!variants[@]}"; do
      env "${variants[$i]}" "$BIN" bench --device cuda:0 --model "$WORK/q30.gguf" --llama-bench off \
        --reps 3 --prompt-tokens 16 --gen-tokens 128 > "$OUT/variant-$i.md" 2> "$OUT/variant-$i.err"
      row "tg128 with ${variants[$i]}" "rc=$? $(grep -E '^\| tg' "$OUT/variant-$i.md" | cut -d'|' -f3)"
    done
    continue
  fi
  if [ $mode = ab-30b ]; then
    BASE=${BASE_BIN:-carry/strata-base}
    row "ab-30b base" "$("$BASE" --version)"
    row "ab-30b new" "$("$BIN" --version)"
    for round in $(seq 1 ${ROUNDS:-2}); do
      for side in ${ORDER:-base new}; do
        b=$BIN; [ $side = base ] && b=$BASE
        "$b" bench --device cuda:0 --model "$WORK/q30.gguf" --llama-bench off --reps 3 --prompt-tokens 512,2048 \
          --gen-tokens 128 --prefill 2048 > "$OUT/ab-$side-$round.md" 2> "$OUT/ab-$side-$round.err"
        row "  $side round $round" "rc=$? $(grep -E '^\| (pp|tg)' "$OUT/ab-$side-$round.md" | cut -d'|' -f2,3 | tr -s ' ' | tr '\n' ' ')"
      done
    done
    for t in pp512 pp2048 tg128; do
      best() { cat "$OUT"/ab-$1-*.md | awk -F'|' -v t=" $t " '$2 == t {split($3, a, " "); if (a[1] + 0 > m) m = a[1] + 0} END {print m}'; }
      bb=$(best base); bn=$(best new)
      row "  $t best: base / new / ratio" "$bb / $bn / $(awk -v a="$bb" -v b="$bn" 'BEGIN {printf "%.3f", b / a}')"
    done
    continue
  fi
  if [ $mode = offload-30b ]; then
    # Routing traces (DESIGN.md section 5): the published Qwen3-30B-A3B locality, and uniform routing.
    "$BIN" experts synth-trace --out "$WORK/locality.jsonl" --tokens 4096 > "$OUT/trace-locality.txt" 2>&1
    "$BIN" experts synth-trace --out "$WORK/random.jsonl" --tokens 4096 --random > "$OUT/trace-random.txt" 2>&1
    row "routing traces" "$(grep -ho 'reused at the next token.*' "$OUT"/trace-*.txt | tr '\n' ' ' | cut -c1-100)"
    R=--routing-trace
    IFS=';' read -ra configs <<< "${OFFLOAD_CONFIGS:-resident|--prompt-tokens 512,4096 --prefill 4096;resident-random|--prompt-tokens 512,4096 --prefill 4096 $R $WORK/random.jsonl;b10.7-random|--vram-budget 10.7GiB --prompt-tokens 512,4096 --prefill 4096 $R $WORK/random.jsonl;b10.7-locality|--vram-budget 10.7GiB --prompt-tokens 512 $R $WORK/locality.jsonl;b10.7-mmap-locality|--vram-budget 10.7GiB --prompt-tokens 512 --mmap-experts $R $WORK/locality.jsonl;b1.9-random|--vram-budget 1.9GiB --prompt-tokens 512 --prefill 512 $R $WORK/random.jsonl;b1.9-random-upload|--vram-budget 1.9GiB --prompt-tokens 512 --prefill 512 --miss-policy upload $R $WORK/random.jsonl;b10.7-random-upload|--vram-budget 10.7GiB --prompt-tokens 512 --miss-policy upload $R $WORK/random.jsonl;b1.9-locality|--vram-budget 1.9GiB --prompt-tokens 512 --prefill 512 $R $WORK/locality.jsonl}"
    for c in "${configs[@]}"; do
      # Leading NAME=value words of a config are environment switches for that run (STRATA_DEVICE_SLOT_TABLE=0).
      name=${c%%|*}; read -ra words <<< "${c#*|}"; envs=(); extra=()
      for w in "${words[@]}"; do
        if [ ${#extra[@]} -eq 0 ] && [[ $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else extra+=("$w"); fi
      done
      env "${envs[@]}" "$BIN" bench --device cuda:0 --model "$WORK/q30.gguf" --llama-bench off --reps ${OFFLOAD_REPS:-2} \
        --gen-tokens 64 "${extra[@]}" > "$OUT/offload-$name.md" 2> "$OUT/offload-$name.err"
      row "offload $name" "rc=$? ${c#*|}"
      while read -r l; do row "  " "$l"; done < <(grep -E 'expert cache|expert arena|expert misses|in place|VRAM free|error' "$OUT/offload-$name.err" | cut -c1-150)
      while read -r l; do row "  " "$l"; done < <(grep -E '^\| (pp|tg)' "$OUT/offload-$name.md" | cut -d'|' -f2,3,4,5,6 | tr -s ' ')
      while read -r l; do row "  " "$l"; done < <(grep -oE 'CUDA graphs in the timed tests: .*' "$OUT/offload-$name.md")
    done
    continue
  fi
  if [ $mode = llamacpp-30b ]; then
    LB=$(bash fixtures/llamacpp/build-cuda.sh build "${LLAMA_SRC:-carry/llama.cpp-src.tar.xz}" "$WORK/llama-cuda" 2> "$OUT/llamacpp-build.txt" | tail -1)
    row "llama.cpp CUDA build" "$(tail -1 "$OUT/llamacpp-build.txt" | cut -c1-100)"
    [ -x "$LB" ] || continue
    for n in ${NCMOE//,/ }; do
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/smi-llamacpp-$n.csv" 2>/dev/null &
      SMI=$!
      "$LB" -m "$WORK/q30.gguf" -ngl 99 -fa 1 -ncmoe "$n" -p 512 -n 64 -r ${LLAMA_REPS:-2} -o md         > "$OUT/llamacpp-ncmoe$n.md" 2> "$OUT/llamacpp-ncmoe$n.err"
      rc=$?
      kill $SMI 2>/dev/null
      row "llama-bench -ncmoe $n" "rc=$rc, VRAM peak $(sort -n "$OUT/smi-llamacpp-$n.csv" | tail -1) MiB"
      while read -r l; do row "  " "$l"; done < <(grep -E '(pp|tg)[0-9]+ ' "$OUT/llamacpp-ncmoe$n.md" | awk -F'|' '{print $(NF-2), $(NF-1)}' | tr -s ' ')
    done
    continue
  fi
  if [ $mode = decode-30b ]; then
    for pdl in 1 0; do
      STRATA_PDL=$pdl "$BIN" bench --device cuda:0 --model "$WORK/q30.gguf" --llama-bench off --reps 3 \
        --prompt-tokens 512 --gen-tokens 128 --depth 0,1024,8192 > "$OUT/decode-30b-pdl$pdl.md" 2> "$OUT/decode-30b-pdl$pdl.err"
      row "decode qwen3-30b-a3b-shaped STRATA_PDL=$pdl" "rc=$?"
      while read -r l; do row "  " "$l"; done < <(grep -E '^\| (pp|tg)' "$OUT/decode-30b-pdl$pdl.md" | cut -d'|' -f2,3,9)
    done
    continue
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/smi-30b.csv" 2>/dev/null &
  SMI=$!
  "$BIN" bench --device cuda:0 --model "$WORK/q30.gguf" --llama-bench off --reps 3 \
    --prompt-tokens 512,2048,8192 --gen-tokens 128 --prefill 2048 > "$OUT/bench-30b.md" 2> "$OUT/bench-30b.err"
  row "bench qwen3-30b-a3b-shaped" "rc=$?"
  kill $SMI 2>/dev/null
  row "  nvidia-smi memory.used peak (MiB)" "$(sort -n "$OUT/smi-30b.csv" | tail -1)"
  while read -r l; do row "  " "$l"; done < <(grep -E '^\| (pp|tg)' "$OUT/bench-30b.md" | cut -d'|' -f2,3,9)
  ;;
regs)
  "$BIN" device --list-devices > /dev/null 2>&1 # compiles the kernels into the cache
  PTX=$(find "$STRATA_KERNEL_CACHE" -name '*.ptx' | head -1)
  PTXAS=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -1)
  ARCH=sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
  "$PTXAS" -arch=$ARCH -v "$PTX" -o /dev/null > "$OUT/ptxas.txt" 2>&1
  row "ptxas -v $ARCH" "rc=$? $(basename "$PTX")"
  for k in ${REGS_KERNELS:-mmv_moe_q4_k mmv_moe_q6_k mmv_q4_k mmv1_q4_k mmv_q6_k attn_decode router_route}; do
    row "  $k" "$(awk -v k="'$k'" '$0 ~ "entry function " k {f=1} f && /spill/ {s=$0} f && /Used/ {print $5, "regs,", s; exit}' "$OUT/ptxas.txt" | tr -s ' ')"
  done
  ;;
harness)
  export STRATA_MODELS_DIR=$WORK/models
  HARNESS=${STRATA_HARNESS_BIN:-carry/strata-harness}
  for sc in ${HARNESS_SCENARIOS:-scenarios/h200.yaml}; do
    n=$(basename "$sc" .yaml)
    "$HARNESS" run "$sc" ${HARNESS_FLAGS:-} --strata "$BIN" --out "$WORK/reports" > "$OUT/harness-$n.txt" 2>&1
    rc=$?
    row "strata-harness run $sc ${HARNESS_FLAGS:-}" "rc=$rc $(grep -E 'PASS|FAIL' "$OUT/harness-$n.txt" | tail -1 | cut -c1-90)"
  done
  (cd "$WORK/reports" && tar czf "$OUT/harness-reports.tgz" .)
  ;;
*) echo "unknown mode $mode" >&2; exit 2 ;;
esac
done

echo
echo "==== device-test summary (${STRATA_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')})"
printf '%s\n' "${ROWS[@]}"
