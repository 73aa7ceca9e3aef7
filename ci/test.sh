#!/usr/bin/env bash
# The test command: fetches the models the tests read (once; cached outside git), then runs every test of the
# workspace in one build profile. CI runs this through .ci/run on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/fetch-models.sh
cargo test --workspace --locked "$@"
# Optional steps that need PyPI: exit 77 means skipped (no venv, or PyPI out of reach), reported, not failed.
optional() {
    local what=$1 status=0
    shift
    "$@" || status=$?
    if [ "$status" -eq 77 ]; then
        echo "ci/test.sh: $what was skipped (see above)"
    elif [ "$status" -ne 0 ]; then
        exit "$status"
    fi
}
# The official OpenAI and Anthropic Python SDKs against a live `strata serve`.
optional "the Python SDK client tests" ci/python-clients.sh
# Every CUDA kernel compiled for sm_90 and sm_80 by NVRTC from PyPI (no GPU needed).
optional "the kernel compile check" ci/check-kernels.sh
