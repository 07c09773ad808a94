"""Thin adapters of ckpt + ettr for trainers: a plain loop, PyTorch Lightning, Hugging Face Transformers."""
