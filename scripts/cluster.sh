#!/usr/bin/env bash
# Two nodes on this machine (network namespaces joined by a bridge, each with its hostname and tmpfs; needs root):
# node losses, partitions, a stopped rank and a slow link, with their figures. See docs/checkpointing.md,
# "Two nodes". Arguments: the scenarios (node-loss faults slow; default all), --seed N, --workdir DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
PYTHONPATH="$PWD" exec .venv/bin/python tests/cluster.py "$@"
