#!/usr/bin/env bash
# Load benchmark for `strata serve` (not a test): N concurrent streaming clients for S seconds on loopback,
# default model. Usage: ci/serve-load.sh [CLIENTS] [SECONDS] [MAX_TOKENS] [OUT.md]
# Needs the venv ci/python-clients.sh makes; httpx is installed into it here.
set -euo pipefail
cd "$(dirname "$0")/.."
clients=${1:-4}
seconds=${2:-60}
max_tokens=${3:-32}
out=${4:-}
venv=target/python-clients-venv
[ -x "$venv/bin/python" ] || { echo "serve-load: run ci/python-clients.sh first (it makes $venv)" >&2; exit 1; }
"$venv/bin/pip" install --quiet --disable-pip-version-check httpx
# The same build as `cargo test --workspace` (ci/test.sh runs that first, so this is a no-op there); building
# only the binary would resolve other features and compile dozens of crates again.
cargo test --workspace --locked --no-run --quiet
port=$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
target/debug/strata serve --port "$port" --max-queue 64 >"$log" 2>&1 &
server=$!
# The script's own status survives the cleanup (a killed server's `wait` returns 143, which `set -e` would
# otherwise turn into the script's exit status).
trap 'status=$?; kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"; exit $status' EXIT
until curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
    kill -0 "$server" 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.2
done
STRATA_SERVE_PID=$server "$venv/bin/python" ci/serve_load.py "http://127.0.0.1:$port" --clients "$clients" \
    --seconds "$seconds" --max-tokens "$max_tokens" ${out:+--out "$out"} \
    --command "ci/serve-load.sh $clients $seconds $max_tokens (dev profile build, $(nproc) cores, rev $(git rev-parse --short HEAD))"
