"""Thin adapters of ckpt + ettr for trainers: a plain loop, PyTorch Lightning, Hugging Face Transformers."""

from ._common import advised_interval, advised_two_tier
from .loop import Preempted, TrainLoop

__all__ = ["Preempted", "TrainLoop", "advised_interval", "advised_two_tier"]
