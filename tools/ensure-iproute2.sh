#!/usr/bin/env bash
# Make sure `ip` (iproute2) is on PATH for the multi-host suite (tests/test_multihost.py builds network
# namespaces). As root on Debian/Ubuntu: installs it. Otherwise nothing to do: that suite skips with its reason
# when it is not root or has no `ip`.
set -euo pipefail
if command -v ip >/dev/null 2>&1 || [ "$(id -u)" != "0" ]; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
    echo "[remote-g2] installing iproute2 (ip netns) for the multi-host tests..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
