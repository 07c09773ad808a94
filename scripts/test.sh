#!/usr/bin/env bash
# Sets everything up and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,lightning,hf
# The extras are not optional here: a test skipped for a missing framework (Lightning, Transformers, an exporter)
# fails instead (tests/require_extras.py), so the suite cannot pass by skipping what it is meant to test.
export CKPT_REQUIRE_EXTRAS=1
# Two workers (CKPT_TEST_WORKERS=0: none), each running whole files: a file's fixtures (the two-node cluster, the
# determinism runs) are set up once.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${CKPT_TEST_WORKERS:-2}" --dist loadfile "$@"
