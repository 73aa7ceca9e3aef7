#!/usr/bin/env bash
# The test command: fetches the models the tests read (once; cached outside git), then runs every test of the
# workspace in one build profile. CI runs this through .ci/run on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/fetch-models.sh
cargo test --workspace --locked "$@"
