#!/usr/bin/env bash
# One command runs every test: install what is needed, lint, then the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" worker,operator,test
cd "$ROOT"

echo "==> ruff"
ruff check .
ruff format --check .
echo "==> control-plane binaries (built once from Go modules, then cached)"
python -m tests.cluster build
echo "==> pytest"
# pytest exits 5 when nothing was collected, which fails this script too.
pytest "$@"
