# Sourced by demo.sh and test.sh: make ./.venv with the given extras installed.
# Idempotent: a stamp keyed by the build files and the extras skips pip when nothing changed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS="$1"

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "error: Python >= 3.11 is required (set PYTHON=/path/to/python3.11 or newer)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PYTHON_BIN="$(find_python)"
  echo "==> creating $VENV with $PYTHON_BIN"
  "$PYTHON_BIN" -m venv "$VENV"
fi

# The C sources are part of the key: the editable install builds them in place.
stamp="$VENV/.installed-$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/worker/dlo_worker/offload/feeds/*.c | sha256sum | cut -c1-16)-${EXTRAS//,/-}"
if [ ! -f "$stamp" ]; then
  echo "==> installing diffusion-dlo[$EXTRAS] into $VENV (the first run downloads torch, a few GB)"
  "$VENV/bin/python" -m pip install --upgrade --quiet pip
  "$VENV/bin/python" -m pip install --progress-bar on -e "$ROOT[$EXTRAS]"
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
