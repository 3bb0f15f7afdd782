#!/usr/bin/env bash
# Debian's chromium for the headless-browser tests of the --trace HTML view
# (tests/test_trace_browser.py). Idempotent; never fatal: where it cannot be
# installed (not root, no apt-get, no registry) it says so and the tests skip
# with that reason.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(uname -s)" != Linux ] || ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "note: chromium not installed (needs root and apt-get); the browser tests of the trace view will skip" >&2
    exit 0
fi
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; then
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
        || echo "note: could not install chromium; the browser tests of the trace view will skip" >&2
fi
exit 0
