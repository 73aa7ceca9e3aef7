#!/usr/bin/env bash
# Compile-checks every kernel of kernels/ without a GPU (DESIGN.md section 6): NVRTC 13.0 from PyPI
# (nvidia-cuda-nvrtc, no driver needed) into a venv under target/, then `strata device --check-kernels`, which
# compiles the whole program for sm_90 and sm_80. A syntax error fails here instead of costing device time.
# Exit 77 means skipped: no venv could be made or PyPI could not be reached (ci/test.sh reports it, not fails).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/nvrtc-venv
if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        echo "check-kernels: skipped: python3 -m venv failed (install python3-venv)" >&2
        rm -rf "$venv"
        exit 77
    fi
fi
if ! "$venv/bin/pip" install --quiet --disable-pip-version-check 'nvidia-cuda-nvrtc==13.0.*'; then
    echo "check-kernels: skipped: cannot pip install nvidia-cuda-nvrtc (is PyPI reachable?)" >&2
    exit 77
fi
lib=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
# The kernels are built into the binary: build it anew (a no-op when it is current), or a stale one checks old
# kernels.
strata=${STRATA_BIN:-target/debug/strata}
if [ -z "${STRATA_BIN:-}" ]; then
    cargo build --locked -p strata-engine --bin strata
fi
STRATA_CUDA_LIB_DIR="$lib" "$strata" device --check-kernels
