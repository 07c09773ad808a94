"""Entry point of `python -m ckpt`."""

from .cli import run

run()
