#!/usr/bin/env bash
# One-command set-up on a fresh machine: a virtualenv in .venv with torch (CPU),
# dlx-node and its test extras, and the pinned Solidity compiler + anvil (npm).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/pip install --quiet --upgrade pip
# torch first, pinned: the CPU build. A looser requirement would pull GBs of CUDA packages.
.venv/bin/pip install --quiet torch==2.13.0
.venv/bin/pip install --quiet -e ".[test]"
# solc (solcjs), anvil and forge, pinned in contracts/package-lock.json.
npm ci --prefix contracts --no-audit --no-fund --loglevel=error
# The contracts' static and symbolic analysis (slither, halmos; tests/test_static_analysis.py,
# tests/test_halmos.py) in a virtualenv of their own: slither needs web3 < 8, the node web3 8.
if [ ! -x .venv-analysis/bin/python ]; then
    "$PYTHON" -m venv .venv-analysis
fi
.venv-analysis/bin/pip install --quiet -r scripts/analysis-requirements.txt
# Headless Chromium renders the audit report in one test (Debian package).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "setup: chromium could not be installed; the HTML-report rendering test will fail" >&2
fi
# nftables: the NAT traversal tests build NATs in network namespaces (root only; they skip without it).
if ! command -v nft >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null) \
        || echo "setup: nftables could not be installed; the NAT tests will skip" >&2
fi
echo "setup: done. Run 'source .venv/bin/activate' or call .venv/bin/dlx-node directly."
