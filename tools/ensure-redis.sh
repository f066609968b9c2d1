#!/usr/bin/env bash
# Make sure redis-server and redis-cli are on PATH (the tests start their own servers).
# As root on Debian/Ubuntu: installs Debian's redis-server. Otherwise: says what to install.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[remote-g2] installing redis-server from Debian's packages..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    # The package starts a system instance; the tests never use it, so stop it again.
    (service redis-server stop >/dev/null 2>&1 || true)
    exit 0
fi
cat >&2 <<'MSG'
[remote-g2] redis-server and redis-cli (Redis >= 7) are needed by the tests and are not on PATH.
Install them, then re-run:
    Debian/Ubuntu:  sudo apt-get install -y redis-server
    Fedora/RHEL:    sudo dnf install -y redis
    macOS:          brew install redis
MSG
exit 1
