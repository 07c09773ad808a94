#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (constraints.txt) and this package with the given extras.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[${extras}]" 2>&1 \
  | grep -v "^WARNING: Location" || true
