#!/usr/bin/env bash
# The README's first command: set up .venv, then train, crash, resume under torchrun and report goodput.
# Flags go to the demo (bash scripts/demo.sh --help); see docs/demo.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m examples.lm_demo "$@"
