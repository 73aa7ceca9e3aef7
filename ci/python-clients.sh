#!/usr/bin/env bash
# The official `openai` and `anthropic` Python SDKs against a live `strata serve` on the default model.
# Creates a venv under target/ (once), pip-installs the SDKs from PyPI, builds strata, starts the server on a
# free loopback port, runs ci/python_clients_test.py, and stops the server.
# Exit 77 means skipped: no venv could be made or PyPI could not be reached (ci/test.sh reports it, not fails).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/python-clients-venv
if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        echo "python-clients: skipped: python3 -m venv failed (install python3-venv)" >&2
        rm -rf "$venv"
        exit 77
    fi
fi
if ! "$venv/bin/pip" install --quiet --disable-pip-version-check 'openai>=1.40' 'anthropic>=0.40'; then
    echo "python-clients: skipped: cannot pip install openai and anthropic (is PyPI reachable?)" >&2
    exit 77
fi
# The same build as `cargo test --workspace` (ci/test.sh runs that first, so this is a no-op there); building
# only the binary would resolve other features and compile dozens of crates again.
cargo test --workspace --locked --no-run --quiet
port=$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
target/debug/strata serve --port "$port" --threads 2 >"$log" 2>&1 &
server=$!
# The script's own status survives the cleanup (a killed server's `wait` returns 143, which `set -e` would
# otherwise turn into the script's exit status).
trap 'status=$?; kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"; exit $status' EXIT
for _ in $(seq 1 600); do
    if curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$server" 2>/dev/null; then cat "$log" >&2; echo "python-clients: strata serve exited" >&2; exit 1; fi
    sleep 0.2
done
if ! "$venv/bin/python" ci/python_clients_test.py "http://127.0.0.1:$port"; then
    echo "--- strata serve log ---" >&2
    cat "$log" >&2
    exit 1
fi
