#!/usr/bin/env bash
# Sets everything up and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,lightning,hf
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
