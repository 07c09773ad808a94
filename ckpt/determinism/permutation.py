"""Keyed Feistel permutation of [0, size) with cycle-walking: O(1) random access, no index array, integer-only."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from .seeding import seed_sequence

ROUNDS = 6
MAX_SIZE = 1 << 62
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 (wrapping multiply): the Feistel round function's avalanche."""
    x = x ^ (x >> _S30)
    x = x * _MUL1
    x = x ^ (x >> _S27)
    x = x * _MUL2
    return x ^ (x >> _S31)


class FeistelPermutation:
    """A bijection of [0, size): a balanced Feistel network on the next even bit width, cycle-walked into range."""

    def __init__(self, size: int, keys: Sequence[int]) -> None:
        if not 1 <= size <= MAX_SIZE:
            raise ValueError(f"permutation size must be in [1, 2**62], got {size}")
        if len(keys) < 3:
            raise ValueError(f"a Feistel permutation needs at least 3 round keys, got {len(keys)}")
        bits = max(2, (size - 1).bit_length())
        bits += bits % 2
        self.size = size
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(k) for k in keys]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over the 2^bits domain."""
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, index: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """perm(index) for indices in [0, size), as int64 of the same shape (1-d internally: scalars would warn on wraparound)."""
        shape = np.shape(index)
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            raise IndexError(f"permutation index out of range [0, {self.size}): min {idx.min()}, max {idx.max()}")
        out = self._encrypt(idx.astype(np.uint64))
        todo = np.flatnonzero(out >= self.size)
        while todo.size:
            out[todo] = self._encrypt(out[todo])
            todo = todo[out[todo] >= self.size]
        return out.astype(np.int64).reshape(shape)


@lru_cache(maxsize=64)
def epoch_permutation(size: int, seed: int, epoch: int) -> FeistelPermutation:
    """The permutation of epoch `epoch` under `seed`: round keys from SeedSequence(seed, spawn_key=(perm, epoch)).
    Cached (a permutation is immutable): samplers ask for the same epoch's once per batch, the reader's read-ahead
    again for the next batches."""
    keys = seed_sequence(seed, "permutation", epoch).generate_state(ROUNDS, dtype=np.uint64)
    return FeistelPermutation(size, [int(k) for k in keys])
