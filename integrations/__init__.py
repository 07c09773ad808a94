"""Thin adapters of ckpt + ettr for trainers: a plain loop, PyTorch Lightning, Hugging Face Transformers."""

from .loop import Preempted, TrainLoop

__all__ = ["Preempted", "TrainLoop"]
