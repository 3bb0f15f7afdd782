#!/usr/bin/env bash
# The README's picture of the --trace view: the bundled demo model (converted
# to 4-bit as scripts/demo.sh does) sorting digits, its trace page drawn by
# headless chromium (scripts/install_chromium.sh).
#
#   scripts/bench/trace_screenshot.sh [PNG] [DIGITS]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PNG="${1:-$ROOT/docs/trace-demo.png}"
DIGITS="${2:-9081726354}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BIN=""
if [ -x "$ROOT/.venv/bin/dlm-run" ]; then BIN="$ROOT/.venv/bin/"; fi
CHROMIUM="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$CHROMIUM" ]; then
    echo "error: chromium not found (scripts/install_chromium.sh installs Debian's)" >&2
    exit 1
fi
"${BIN}dlm-convert" "$ROOT/demo/diffusion_gemma_sort" -q --q-bits 4 -o "$WORK/diffusion_gemma_sort-4bit" --no-progress >/dev/null
"${BIN}dlm-run" generate --model "$WORK/diffusion_gemma_sort-4bit" --prompt "sort $DIGITS" --seed 0 --trace "$WORK/trace.html"
echo
"$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync --hide-scrollbars \
    --user-data-dir="$WORK/profile" --window-size=1280,900 --screenshot="$PNG" \
    "file://$WORK/trace.html" 2>/dev/null
echo "screenshot: $PNG"
