"""On-disk layout rules: chunk grids never let two writers share a chunk; names never leave the step."""

import hashlib
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.format import ArrayInfo, Manifest, chunk_shape, escape_segment
from ckpt.paths import validate_array_name


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5000),
    cols=st.integers(1, 300),
    writers=st.integers(1, 8),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    target=st.sampled_from([1 << 10, 1 << 14, 1 << 20]),
)
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


def _placed(shape, boxes) -> dict:
    """A ckpt/5 manifest entry of a float32 array placed in packs: one place and one digest per box."""
    places, at = [], 0
    for box in boxes:
        places.append(["rank_00000", at])
        at += 4 * math.prod(b - a for a, b in box)
    return {"dtype": "float32", "shape": shape, "chunk": shape, "boxes": boxes, "digests": [0] * len(boxes),
            "places": places, "segment": 1 << 26}  # fmt: skip


TILINGS = [  # shape, boxes, why not a tiling (None: one)
    ([8, 6], [[[0, 8], [0, 6]]], None),
    ([8, 6], [[[4, 8], [0, 6]], [[0, 4], [0, 6]]], None),  # row shards, in any order
    ([8, 6], [[[0, 4], [0, 3]], [[0, 4], [3, 6]], [[4, 8], [0, 3]], [[4, 8], [3, 6]]], None),  # a 2x2 grid
    ([8, 6], [[[0, 5], [0, 3]], [[0, 5], [3, 6]], [[5, 8], [0, 6]]], None),
    ([], [[]], None),  # a 0-d array: one box
    ([8, 6], [], "hold 0 of its 48 elements"),
    ([8, 6], [[[0, 4], [0, 6]]], "hold 24 of its 48 elements"),
    ([8, 6], [[[0, 4], [0, 6]], [[0, 4], [0, 6]]], "overlap"),  # as many elements as the shape, half of it twice
    ([8, 6], [[[0, 6], [0, 3]], [[2, 8], [3, 6]], [[0, 2], [3, 6]], [[6, 8], [0, 3]], [[3, 4], [1, 2]]], "hold 49"),
    ([8, 6], [[[0, 4], [0, 6]], [[3, 7], [0, 6]]], "boxes 0 and 1 overlap"),  # row 3 twice, row 7 left out
    ([8, 6], [[[4, 8], [0, 6]], [[0, 4], [0, 3]], [[0, 4], [2, 5]]], "boxes 1 and 2 overlap"),  # column 2 twice
    ([], [], "hold 0 of its 1 elements"),
    ([], [[], []], "hold 2 of its 1 elements"),
]


@pytest.mark.parametrize("shape, boxes, why", TILINGS)
def test_a_placed_array_is_read_from_boxes_that_tile_its_shape_exactly(shape, boxes, why):
    """A read fills a placed tensor from its boxes alone: a manifest whose boxes leave an element out (or hold one
    twice, which a sum of their sizes alone would not tell) is damage, naming the key."""
    entry = _placed(shape, boxes)
    if why is None:
        assert ArrayInfo.from_json("w", entry).boxes == tuple(tuple(map(tuple, b)) for b in boxes)
    else:
        with pytest.raises(CorruptCheckpointError, match=f"do not tile its shape.*{why}") as info:
            ArrayInfo.from_json("w", entry)
        assert info.value.key == "w"


def test_escaped_segments_are_safe_and_distinct():
    """Keys that look alike after escaping (dots, slashes, percent signs, long names cut to a hash) stay apart."""
    keys = [
        "..",
        ".",
        "",
        "a/b",
        "a%2Fb",
        "a b",
        "x" * 500,
        "x" * 499 + "y",
        "é",
        "%2E",
        "%2E%2E",
        ".a",
        "%2Ea",
        "%00",
        "%",
        "~",
        7,
        "A",
    ]
    segments = [escape_segment(k) for k in keys]
    for key, seg in zip(keys, segments):
        assert validate_array_name(seg) == seg and "/" not in seg and seg not in (".", "..") and len(seg) <= 200, key
    clashes = {seg: [k for k, s in zip(keys, segments) if s == seg] for seg in segments if segments.count(seg) > 1}
    assert clashes == {}


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/./b", "a/../b", "", "a\\b", "a\n", "x/b\n"])
def test_unsafe_manifest_names_are_rejected(name):
    with pytest.raises(CorruptCheckpointError, match="unsafe array path"):
        validate_array_name(name)


def test_one_grammar_walks_every_node_of_a_saved_tree():
    """`state.walk` reads every tag of a tree the way restore and the CLI do: key paths, kinds, array names."""
    import collections

    import numpy as np
    import torch

    from ckpt import RNGState, state

    tree = state.flatten(
        {
            "model": torch.nn.Linear(2, 1),
            "opt": {"lr": 0.1, 3: (1, torch.zeros(2))},
            "rng": RNGState(),
            "od": collections.OrderedDict(a=np.zeros(3)),
        },
        rank=2,
    ).tree
    kinds: dict = {}
    for path, node in state.walk(tree):
        kinds.setdefault(path, node.kind)  # a state's tree follows its state, at the same path
    assert kinds[("model",)] == state.STATE and kinds[("model", "weight")] == state.TENSOR
    assert kinds[("opt",)] == state.MAPPING and kinds[("opt", "lr")] == state.VALUE
    assert kinds[("opt", 3)] == state.SEQUENCE and kinds[("opt", 3, 1)] == state.TENSOR
    assert kinds[("rng",)] == state.PER_RANK and kinds[("rng", 2)] == state.STATE
    assert kinds[("od",)] == state.MAPPING and kinds[("od", "a")] == state.TENSOR
    assert state.tensor_refs(tree) == ["model/weight", "model/bias", "opt/3/1", *state.tensor_refs(tree["rng"]), "od/a"]
    assert list(state.per_rank_entries(tree)) == ["rng"]


def test_encodable_says_which_leaves_have_an_exact_form():
    import numpy as np
    import torch

    from ckpt.state import encodable

    for leaf in (
        None,
        True,
        3,
        1.5,
        "s",
        b"b",
        torch.float16,
        torch.Size([2]),
        torch.zeros(1),
        np.zeros(2),
        np.float32(1),
        np.str_("x"),
    ):
        assert encodable(leaf), leaf
    masked = np.ma.masked_array([1.0], mask=[True])
    for leaf in (object(), np.array([object()]), masked, np.longdouble(1), np.datetime64("2020-01-01"), [1], {"a": 1}):
        assert not encodable(leaf), leaf


def test_a_manifest_data_directory_with_a_trailing_newline_is_refused(tmp_path):
    """The manifest's data directory is exactly w-<12 hex>: a regex's `$` also matched before a final newline, so
    a planted "w-...\\n" passed the schema check (as did array names and numpy dtypes ending in one)."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.ones(2)}).wait()
    path = tmp_path / "step_00000001" / "manifest.json"
    body = json.loads(path.read_text())["body"]
    body["data"] += "\n"
    text = json.dumps(body, allow_nan=False, separators=(",", ":"))
    planted = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}
    with pytest.raises(CorruptCheckpointError, match="bad data directory"):
        Manifest.from_bytes(json.dumps(planted).encode(), file=str(path))
