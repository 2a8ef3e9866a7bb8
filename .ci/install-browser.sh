#!/usr/bin/env bash
# Install a headless browser (Debian's chromium) for tests/rl/test_dashboard.py, which opens the
# generated dashboard and checks the rendered DOM and a screenshot. Idempotent: does nothing when
# /usr/bin/chromium is already there. Needs root (or sudo) and the Debian package mirrors.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
    echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-browser.sh: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium
/usr/bin/chromium --version
