#!/usr/bin/env bash
# One command for a new user: install, write the demo model, generate an image on the CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" worker

OUT="$ROOT/out"
echo "==> writing the demo model to $OUT/demo-model"
dlo-worker demo-model "$OUT/demo-model" --overwrite
echo "==> generating an image (CPU, resident)"
dlo-worker generate --model "$OUT/demo-model" --device cpu --steps 25 --seed 0 \
  --class-label 207 --out "$OUT/demo.png"
echo "Done: the image is at $OUT/demo.png"
