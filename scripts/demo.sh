#!/usr/bin/env bash
# One command for a new user: install, write the demo models, generate images on the CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/bootstrap.sh" worker

OUT="$ROOT/out"
echo "==> writing the demo model to $OUT/demo-model"
dlo-worker demo-model "$OUT/demo-model" --overwrite
# Class label 20 is "a yellow square on a black background"; every label: python -c 'from
# dlo_worker.pipeline.drawings import DRAWINGS; print(*enumerate(DRAWINGS), sep="\n")'.
echo "==> generating class 20, a yellow square on a black background (CPU, resident)"
dlo-worker generate --model "$OUT/demo-model" --device cpu --steps 25 --seed 0 \
  --class-label 20 --out "$OUT/demo.png"
echo "==> writing the text-to-image demo (tiny Flux with CLIP and T5) to $OUT/flux-model"
dlo-worker demo-model "$OUT/flux-model" --kind flux --overwrite
PROMPT="a red circle on a blue background"
echo "==> generating \"$PROMPT\" (CPU, DLO streaming the Flux blocks)"
dlo-worker generate --model "$OUT/flux-model" --device cpu --steps 8 --seed 0 \
  --prompt "$PROMPT" --width 128 --height 128 --out "$OUT/flux.png" \
  --enable-distributed-layerwise-offload
echo "Done:"
echo "  $OUT/demo.png: a yellow square on a black background (DiT, class label 20)"
echo "  $OUT/flux.png: $PROMPT (Flux, from the prompt)"
echo "Both demos draw a circle or a square in red, green, blue or yellow on a white, black or"
echo "blue background: the DiT by class label 0-21, the Flux (at 128x128) from the words, e.g."
echo "\"a green square on a white background\"."
