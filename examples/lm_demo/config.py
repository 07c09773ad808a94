"""The demo's training settings, shared by the driver (which parses them) and the torchrun worker (which receives them)."""

from __future__ import annotations

import argparse

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
    parser.add_argument("--advise", action="store_true", help="after each save, use the interval ettr.advise fits")


def training_argv(args: argparse.Namespace) -> list[str]:
    """The training flags of `args` as a command line for the worker."""
    argv = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name, *_ in TRAINING]
    return argv + (["--advise"] if args.advise else [])
