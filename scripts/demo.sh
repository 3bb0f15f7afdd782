#!/usr/bin/env bash
# dlm's main job, offline, on the bundled trained DiffusionGemma demo
# (demo/diffusion_gemma_sort: a tiny model that sorts digits):
#   1. convert it to 4-bit MLX (mixed recipe), text-only, with dlm-convert (the demo is
#      trained on text: the vision tower in its checkpoint is transformers' untrained one),
#   2. prove the conversion faithful to the PyTorch reference with dlm-verify --parity
#      (built-in prompts plus the task prompts of demo/sort_prompts.txt),
#   3. answer a task prompt with dlm-run generate.
#
#   scripts/demo.sh [OUTPUT_DIR] [DIGITS]
#
# On a fresh machine it first sets up .venv (scripts/setup.sh: package registries
# only); DLM_SKIP_SETUP=1 uses whatever dlm is already installed. No Hub access.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/demo/diffusion_gemma_sort"
OUT="${1:-${TMPDIR:-/tmp}/dlm-demo/diffusion_gemma_sort-4bit}"
DIGITS="${2:-9081726354}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "${DLM_SKIP_SETUP:-0}" != 1 ]; then
    echo "== set-up (scripts/setup.sh)"
    bash "$ROOT/scripts/setup.sh"
fi

# Prefer the repository's virtual environment when there is one.
BIN=""
if [ -x "$ROOT/.venv/bin/dlm-convert" ]; then BIN="$ROOT/.venv/bin/"; fi

echo "== dlm-convert: $SRC -> $OUT (4-bit, mixed recipe, text-only)"
mkdir -p "$(dirname "$OUT")"
"${BIN}dlm-convert" "$SRC" -q --q-bits 4 --text-only -o "$OUT" --overwrite --no-progress

echo
echo "== dlm-verify --parity $OUT (reference: $SRC)"
"${BIN}dlm-verify" --parity "$OUT" --reference "$SRC" --prompts "$ROOT/demo/sort_prompts.txt" --torch-threads 1 --quiet

echo
echo "== dlm-run generate: \"sort $DIGITS\" (expected: $(echo "$DIGITS" | grep -o . | sort | tr -d '\n'))"
"${BIN}dlm-run" generate --model "$OUT" --prompt "sort $DIGITS" --seed 0 --profile
