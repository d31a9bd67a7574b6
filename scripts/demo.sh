#!/usr/bin/env bash
# One command for a new user: install, write the demo models, generate images on the CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" worker

OUT="$ROOT/out"
echo "==> writing the demo model to $OUT/demo-model"
dlo-worker demo-model "$OUT/demo-model" --overwrite
echo "==> generating an image (CPU, resident)"
dlo-worker generate --model "$OUT/demo-model" --device cpu --steps 25 --seed 0 \
  --class-label 207 --out "$OUT/demo.png"
echo "==> writing the text-to-image demo (tiny Flux with CLIP and T5) to $OUT/flux-model"
dlo-worker demo-model "$OUT/flux-model" --kind flux --overwrite
echo "==> generating an image from a prompt (CPU, DLO streaming the Flux blocks)"
dlo-worker generate --model "$OUT/flux-model" --device cpu --steps 8 --seed 0 \
  --prompt "a lighthouse at dusk" --width 256 --height 256 --out "$OUT/flux.png" \
  --enable-distributed-layerwise-offload
echo "Done: the images are at $OUT/demo.png and $OUT/flux.png"
