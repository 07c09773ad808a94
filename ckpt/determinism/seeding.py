"""Derived seeds: numpy SeedSequence spawn keys, never `seed + epoch`, so streams never alias across seeds."""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch


def purpose_id(purpose: str) -> int:
    """A stable 32-bit number for a purpose name, so spawn keys are readable strings in the API."""
    return zlib.crc32(purpose.encode("utf-8"))


def seed_sequence(seed: int, purpose: str, *path: int) -> np.random.SeedSequence:
    """The seed sequence for (seed, purpose, *path); distinct keys give independent streams."""
    if seed < 0 or any(p < 0 for p in path):
        raise ValueError(f"seed and path must be non-negative, got seed={seed} path={path}")
    return np.random.SeedSequence(seed, spawn_key=(purpose_id(purpose), *path))


def sample_rng(seed: int, t: int, purpose: str = "augment") -> np.random.Generator:
    """Counter-based generator for sample t (Philox keyed by seed, purpose, t): same numbers in any process."""
    return np.random.Generator(np.random.Philox(seed_sequence(seed, purpose, t)))


def torch_generator(seed: int, purpose: str, *path: int) -> torch.Generator:
    """A CPU torch.Generator seeded from (seed, purpose, *path), e.g. for DataLoader(generator=...)."""
    state = seed_sequence(seed, purpose, *path).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))


def seed_global_rngs(seed: int, purpose: str, *path: int) -> None:
    """Seed this process's global python, numpy (legacy) and torch CPU RNGs from (seed, purpose, *path)."""
    words = seed_sequence(seed, purpose, *path).generate_state(2, dtype=np.uint64)
    random.seed(int(words[0]))
    np.random.seed(words.view(np.uint32))
    torch.default_generator.manual_seed(int(words[1]) & ((1 << 63) - 1))
