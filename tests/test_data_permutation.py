"""The keyed Feistel permutation: exhaustive bijection at every small and boundary size, golden vectors, key hygiene."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckpt import RandomWindowSampler
from ckpt.determinism.permutation import MAX_SIZE, epoch_permutation

GOLDEN = Path(__file__).parent / "golden" / "window_starts.json"


def _boundary_sizes() -> list[int]:
    sizes = {s for k in range(1, 21) for s in (2**k - 1, 2**k, 2**k + 1)}
    sizes |= {4**k + 1 for k in range(1, 11)}
    return sorted(s for s in sizes if s <= 2**20 + 1)


def _is_bijection(size: int, seed: int, epoch: int) -> bool:
    out = epoch_permutation(size, seed, epoch)(np.arange(size))
    return out.min() >= 0 and out.max() < size and np.bincount(out, minlength=size).max() == 1


def test_bijection_exhaustive_for_every_size_up_to_5000():
    bad = [size for size in range(1, 5001) if not _is_bijection(size, seed=size, epoch=size % 3)]
    assert bad == []


@pytest.mark.parametrize("seed", [0, 12345])
def test_bijection_exhaustive_at_power_boundaries(seed):
    bad = [size for size in _boundary_sizes() if not _is_bijection(size, seed, epoch=1)]
    assert bad == []


def _golden_vectors(case: dict) -> list[int]:
    sampler = RandomWindowSampler(case["n"], case["L"], case["c"], case["batch"], case["seed"])
    counters = np.arange(case["count"])
    return (sampler.indices(counters) * case["c"]).tolist()


def test_golden_window_starts_do_not_drift():
    """First 1000 window starts for fixed configs; the small one crosses three epoch boundaries."""
    for case in json.loads(GOLDEN.read_text()):
        assert _golden_vectors(case) == case["starts"], case["name"]


def test_trap_seed_plus_epoch_does_not_alias():
    idx = np.arange(1000)
    assert not np.array_equal(epoch_permutation(1000, 7, 1)(idx), epoch_permutation(1000, 8, 0)(idx))
    assert not np.array_equal(epoch_permutation(1000, 7, 0)(idx), epoch_permutation(1000, 7, 1)(idx))


def test_huge_domain_and_range_errors():
    perm = epoch_permutation(MAX_SIZE, 1, 0)
    out = perm(np.array([0, 1, MAX_SIZE - 1]))
    assert len(set(out.tolist())) == 3 and out.max() < MAX_SIZE
    assert perm(5).shape == ()
    with pytest.raises(IndexError, match="out of range"):
        epoch_permutation(10, 1, 0)(np.array([10]))
    with pytest.raises(ValueError, match="size"):
        epoch_permutation(MAX_SIZE + 1, 1, 0)
