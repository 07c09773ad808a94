"""The demo's training settings, shared by the driver (which parses them) and the torchrun worker (which receives them)."""

from __future__ import annotations

import argparse
from pathlib import Path

# name, type, default, help; --quick replaces some defaults (see QUICK)
TRAINING = (
    ("steps", int, 300, "training steps"),
    ("every", int, 25, "checkpoint every this many steps"),
    ("batch", int, 16, "sequences per step"),
    ("context", int, 64, "bytes per sequence"),
    ("d_model", int, 64, "model width"),
    ("layers", int, 2, "transformer blocks"),
    ("lr", float, 3e-3, "AdamW learning rate"),
    ("seed", int, 0, "seed of the model, the data order and dropout"),
    ("threads", int, 1, "torch intra-op threads (fixed, for bitwise reproducibility)"),
    ("workers", int, 0, "DataLoader worker processes"),
    ("log_every", int, 25, "print a progress line every this many steps"),
)
QUICK = {"steps": 40, "every": 5, "batch": 8, "context": 32, "d_model": 32, "log_every": 10}


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The training flags, identical in driver and worker."""
    for name, kind, default, text in TRAINING:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, help=f"{text} (default {default})"
        )
    parser.add_argument(
        "--advise", action="store_true", help="after each save, retune the interval (and K) to what ettr.advise fits"
    )


def training_argv(args: argparse.Namespace) -> list[str]:
    """The training flags of `args` as a command line for the worker."""
    argv = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name, *_ in TRAINING]
    return argv + (["--advise"] if args.advise else [])


def add_tier_args(parser: argparse.ArgumentParser, local_flag: str = "--local") -> None:
    """The two-tier flags of driver and worker (the driver gives each run a local tier of its own, as the worker's
    `--local-tier`: torchrun would take `--local` for an abbreviation of its own `--local-addr`)."""
    parser.add_argument(
        local_flag,
        dest="local",
        metavar="DIR",
        type=Path,
        default=None,
        help="two tiers: every checkpoint commits to a local tier under this directory (e.g. /dev/shm/lm_demo), "
        "every --persist-every-th is persisted to the run's root (default: one tier)",
    )
    parser.add_argument(
        "--persist-every",
        metavar="K",
        type=int,
        default=3,
        help="with --local: persist every this many local saves (default 3)",
    )
    parser.add_argument(
        "--node-loss",
        metavar="N",
        type=int,
        default=0,
        help="with --local: the N-th SIGKILL also loses the node, so the next attempt finds the local tier wiped "
        "and restores from the durable tier (default 0: none)",
    )
