#!/usr/bin/env bash
# Install the RDMA user-space libraries (rdma-core: libibverbs1, ibverbs-providers) as every RDMA host has them,
# so the tests run NIXL's bundled UCX beside the host's verbs stack as production does (remote_g2/ucx_modules.py:
# what that takes). As root on Debian/Ubuntu: installs them. Otherwise nothing to do (the suites run without them).
set -euo pipefail
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    exit 0
fi
if dpkg -s libibverbs1 ibverbs-providers >/dev/null 2>&1; then
    exit 0
fi
echo "[remote-g2] installing the RDMA user-space libraries (libibverbs1, ibverbs-providers)..."
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null 2>&1 || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null
}
