#!/usr/bin/env bash
# One command runs every test: install what is needed, lint, make everything slow the
# tests need (binaries, images, node stores) before pytest, then the whole suite within
# its budget. Each phase's time is printed at the end, also when a phase fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PHASES=()
STARTED=$SECONDS

report_phases() {
  local status=$? joined
  if [ "${#PHASES[@]}" -gt 0 ]; then
    joined="$(printf '%s, ' "${PHASES[@]}")"
    echo "==> phase times ($(nproc) CPUs): ${joined%, }; total $((SECONDS - STARTED)) s"
  fi
  return "$status"
}
trap report_phases EXIT

# timed NAME COMMAND...: run COMMAND and record how long it took as phase NAME, also when
# it fails (the script then stops with its status).
timed() {
  local name=$1 started=$SECONDS status=0
  shift
  "$@" || status=$?
  PHASES+=("$name $((SECONDS - started)) s$([ "$status" = 0 ] || echo " (failed)")")
  return "$status"
}

started=$SECONDS
source "$ROOT/scripts/bootstrap.sh" worker,operator,test
PHASES+=("venv $((SECONDS - started)) s")
cd "$ROOT"

lint() {
  echo "==> ruff"
  ruff check .
  ruff format --check .
  echo "==> mypy (strict on offload/ and config/, see pyproject.toml)"
  mypy
  echo "==> import contracts (the layers in pyproject.toml)"
  lint-imports
}
timed lint lint

# Images are built where buildah can run (root, or buildah, debootstrap and runc
# installed); the real-node tier runs as root (containerd, cgroups, bridges). .ci/run
# requires both.
IMAGES=0
REAL_NODES=0
if [ "$(id -u)" = 0 ]; then
  IMAGES=1
  REAL_NODES=2
elif python -c "import sys; from tests.harness.images import missing_host_tools; sys.exit(bool(missing_host_tools()))"; then
  IMAGES=1
fi
if [ "$REAL_NODES" = 0 ] && [ "${DLO_REQUIRE_REAL_NODES:-0}" = 1 ]; then
  echo "error: DLO_REQUIRE_REAL_NODES=1 (set by .ci/run) but real nodes need root (containerd, cgroups, bridges)" >&2
  exit 1
fi

# The binaries compile (CPU) while the images mostly download and write (network, disk):
# the two run side by side, each line of their output marked with its phase, each phase's
# time written to $PREPARED.
PREPARED="$(mktemp -d)"
prepare() {
  local name=$1 started=$SECONDS status=0
  shift
  "$@" > >(sed -u "s/^/[$name] /") 2>&1 || status=$?
  echo "$name $((SECONDS - started)) s$([ "$status" = 0 ] || echo " (failed)")" > "$PREPARED/$name"
  return "$status"
}
echo "==> control-plane binaries (built once from Go modules, then cached) and images"
prepare binaries python -m tests.cluster build --real-nodes "$REAL_NODES" &
binaries=$!
images=""
if [ "$IMAGES" = 1 ]; then
  # buildah on a debootstrapped base, rebuilt when their sources change; then imported
  # into the real nodes' containerd stores (once: the stores are kept in the cache).
  {
    prepare images python -m tests.cluster images &&
      if [ "$REAL_NODES" -gt 0 ]; then
        prepare node-stores python -m tests.cluster images --real-nodes "$REAL_NODES"
      fi
  } &
  images=$!
else
  echo "    images skipped: building images needs root or buildah, debootstrap and runc installed"
fi
failed=0
wait "$binaries" || failed=1
if [ -n "$images" ]; then wait "$images" || failed=1; fi
for name in binaries images node-stores; do
  if [ -f "$PREPARED/$name" ]; then PHASES+=("$(cat "$PREPARED/$name")"); fi
done
rm -rf "$PREPARED"
[ "$failed" = 0 ] || exit 1

echo "==> pytest"
# pytest runs in DLO_TEST_WORKERS processes (pytest-xdist; 3 by default, 0 runs it in this
# process): the control-plane tests of tests/cluster on one worker, the real-node tier on
# another, every other module as a unit of its own (see tests/conftest.py). pytest exits 5
# when nothing was collected, which fails this script too. The run fails when it takes
# longer than DLO_PYTEST_BUDGET_S (tests/support/budget.py), naming the slowest tests; the
# 25 slowest are listed at the end either way.
export DLO_PYTEST_BUDGET_S="${DLO_PYTEST_BUDGET_S:-1200}"
timed pytest pytest -n "${DLO_TEST_WORKERS:-3}" --durations=25 "$@"
