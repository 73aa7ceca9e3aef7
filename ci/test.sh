#!/usr/bin/env bash
# The test command: fetches the models the tests read (once; cached outside git), then runs every test of the
# workspace in one build profile. CI runs this through .ci/run on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/fetch-models.sh
cargo test --workspace --locked "$@"
# The official OpenAI and Anthropic Python SDKs against a live `strata serve`; skipped (exit 77) when no venv can
# be made or PyPI cannot be reached.
status=0
ci/python-clients.sh || status=$?
if [ "$status" -eq 77 ]; then
    echo "ci/test.sh: the Python SDK client tests were skipped (see above)"
elif [ "$status" -ne 0 ]; then
    exit "$status"
fi
