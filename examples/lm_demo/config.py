"""The demo's training settings, shared by the driver (which parses them) and the torchrun worker (which receives them)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from .model import HEADS

# name, type, default, least value (None: any), help; --quick replaces some defaults (see QUICK)
TRAINING = (
    ("steps", int, 300, 1, "training steps"),
    ("every", int, 25, 1, "checkpoint every this many steps"),
    ("batch", int, 16, 1, "sequences per step"),
    ("context", int, 64, 2, "bytes per sequence"),  # the sampler's stride is half of it
    ("d_model", int, 64, HEADS, f"model width, a multiple of {HEADS} (the attention heads)"),
    ("layers", int, 2, 1, "transformer blocks"),
    ("lr", float, 3e-3, None, "AdamW learning rate"),
    ("seed", int, 0, 0, "seed of the model, the data order and dropout"),
    ("threads", int, 1, 1, "torch intra-op threads (fixed, for bitwise reproducibility)"),
    ("workers", int, 0, 0, "DataLoader worker processes"),
    ("log_every", int, 25, 1, "print a progress line every this many steps"),
)
QUICK = {"steps": 40, "every": 5, "batch": 8, "context": 32, "d_model": 32, "log_every": 10}


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= `minimum`, refused when parsed rather than seconds later inside a torchrun worker."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The training flags, identical in driver and worker."""
    for name, kind, default, least, text in TRAINING:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind if least is None else at_least(least),
            default=default,
            help=f"{text} (default {default})",
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
        type=at_least(1),
        default=3,
        help="with --local: persist every this many local saves (default 3)",
    )
    parser.add_argument(
        "--node-loss",
        metavar="N",
        type=at_least(0),
        default=0,
        help="with --local: the N-th SIGKILL also loses the node, so the next attempt finds the local tier wiped "
        "and restores from the durable tier (default 0: none)",
    )
