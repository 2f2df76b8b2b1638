#!/usr/bin/env bash
# Run one of the README's two commands (run | test) in a virtual environment created afresh
# (no system site packages), from the repository root, as a new user would.
# `scripts/fresh_venv.sh run` also checks that the agent loop printed its summary line.
set -euo pipefail
kind=${1:?usage: scripts/fresh_venv.sh run|test}
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
cmd=$("$python" scripts/readme_commands.py "$kind")
venv=$(mktemp -d "${TMPDIR:-/tmp}/dsv41-venv-$kind.XXXXXX")
log="$venv.log"
trap 'rm -rf "$venv"' EXIT

start=$(date +%s)
"$python" -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
echo "[fresh-venv] $kind: $(python -c 'import sys; print(sys.prefix)') created in $(( $(date +%s) - start )) s"
echo "[fresh-venv] $kind: $cmd"
start=$(date +%s)
set +e
bash -c "$cmd" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
echo "[fresh-venv] $kind: exit $rc after $(( $(date +%s) - start )) s (log $log)"
if [ "$rc" -ne 0 ]; then
    exit "$rc"
fi
if [ "$kind" = run ] && ! grep -q '^summary: ' "$log"; then
    echo "[fresh-venv] run: the agent loop printed no 'summary:' line" >&2
    exit 1
fi
