"""On-disk layout rules: chunk grids never let two writers share a chunk; names never leave the step."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.errors import CorruptCheckpointError
from ckpt.format import chunk_shape, escape_segment, validate_array_name


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5000), cols=st.integers(1, 300), writers=st.integers(1, 8), itemsize=st.sampled_from([1, 2, 4, 8]),
       target=st.sampled_from([1 << 10, 1 << 14, 1 << 20]))
def test_chunks_align_with_every_writer_and_respect_the_size_target(rows, cols, writers, itemsize, target):
    per = math.ceil(rows / writers)  # torch.chunk / FSDP2 row shards
    starts = tuple((r * per, 0) for r in range(writers) if r * per < rows)
    chunk = chunk_shape((rows, cols), itemsize, starts, target)
    assert all(s % chunk[0] == 0 for s, _ in starts), "a shard boundary inside a chunk means two writers share it"
    assert chunk[1] == cols or chunk[0] == 1
    if len(starts) == 1 and rows * cols * itemsize > target and cols * itemsize <= target:
        assert chunk[0] * cols * itemsize <= target
        n_chunks = math.ceil(rows / chunk[0])
        assert n_chunks * chunk[0] - rows < n_chunks, "an even split pads less than one row per chunk"


def test_zero_dim_and_empty_shapes():
    assert chunk_shape((), 4, ((),), 1 << 20) == ()
    assert chunk_shape((0, 5), 4, ((0, 0),), 1 << 20) == (1, 5)


def test_escaped_segments_are_safe_and_distinct():
    """Keys that look alike after escaping (dots, slashes, percent signs, long names cut to a hash) stay apart."""
    keys = ["..", ".", "", "a/b", "a%2Fb", "a b", "x" * 500, "x" * 499 + "y", "é", "%2E", "%2E%2E", ".a", "%2Ea", "%00",
            "%", "~", 7, "A"]
    segments = [escape_segment(k) for k in keys]
    for key, seg in zip(keys, segments):
        assert validate_array_name(seg) == seg and "/" not in seg and seg not in (".", "..") and len(seg) <= 200, key
    clashes = {seg: [k for k, s in zip(keys, segments) if s == seg] for seg in segments if segments.count(seg) > 1}
    assert clashes == {}


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/./b", "a/../b", "", "a\\b"])
def test_unsafe_manifest_names_are_rejected(name):
    with pytest.raises(CorruptCheckpointError, match="unsafe array path"):
        validate_array_name(name)
