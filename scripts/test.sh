#!/usr/bin/env bash
# One command runs every test: install what is needed, lint, then the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" worker,operator,test
cd "$ROOT"

echo "==> ruff"
ruff check .
ruff format --check .
echo "==> mypy (strict on offload/ and config/, see pyproject.toml)"
mypy
echo "==> import contracts (the layers in pyproject.toml)"
lint-imports
echo "==> control-plane binaries (built once from Go modules, then cached)"
python -m tests.cluster build
echo "==> worker and operator images (buildah on a debootstrapped base; rebuilt when their sources change)"
if [ "$(id -u)" = 0 ] || python -c "import sys; from tests.harness.images import missing_host_tools; sys.exit(bool(missing_host_tools()))"; then
  python -m tests.cluster images
elif [ "${DLO_REQUIRE_REAL_NODES:-0}" = 1 ]; then
  echo "error: DLO_REQUIRE_REAL_NODES=1 (set by .ci/run) but building images needs root or buildah, debootstrap and runc installed" >&2
  exit 1
else
  echo "    skipped: building images needs root or buildah, debootstrap and runc installed"
fi
echo "==> pytest"
# pytest runs in DLO_TEST_WORKERS processes (pytest-xdist; 3 by default, 0 runs it in this
# process): the control-plane tests of tests/cluster on one worker, the real-node tier on
# another, every other module as a unit of its own (see tests/conftest.py). pytest exits 5
# when nothing was collected, which fails this script too. The 25 slowest tests are listed
# at the end: where the test command's time goes.
pytest -n "${DLO_TEST_WORKERS:-3}" --durations=25 "$@"
