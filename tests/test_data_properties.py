"""Property: a stream cut anywhere (epoch boundaries included), saved to JSON and resumed, and the uninterrupted one
both equal a straightforward reference: each epoch's permutation materialized, concatenated and sliced into batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt import RandomWindowSampler, TokenWindowDataset, make_loader
from ckpt.determinism.permutation import epoch_permutation
from ckpt.determinism.seeding import sample_rng
from test_data_sampler import noisy, write_tokens

MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("tokens") / "tokens.bin", MAX_TOKENS)


@st.composite
def scenarios(draw):
    world_size = draw(st.sampled_from([1, 2, 4]))
    batch = world_size * draw(st.integers(1, 3))
    window, stride = draw(st.integers(1, 8)), draw(st.integers(1, 5))
    aligned = draw(st.booleans())  # epochs end on a step boundary, and the cut lands on one
    windows = batch * draw(st.integers(1, 5)) if aligned else draw(st.integers(1, 40))
    n = (windows - 1) * stride + window + draw(st.integers(0, stride - 1))
    steps = draw(st.integers(1, 3 * windows // batch + 2))
    epoch_steps = windows // batch
    cut = draw(st.sampled_from(range(0, steps + 1, epoch_steps)) if aligned else st.integers(0, steps))
    return {
        "seed": draw(st.integers(0, 2**40)), "n": n, "window": window, "stride": stride, "batch": batch,
        "world_size": world_size, "rank": draw(st.integers(0, world_size - 1)), "steps": steps, "cut": cut,
        "workers": draw(st.sampled_from([0, 1, 2])),
    }  # fmt: skip


def _stream(token_file, sc: dict, steps: int, state: dict | None = None) -> tuple[list, dict]:
    """`steps` batches through a real DataLoader from a fresh sampler (resumed from `state` if given)."""
    sampler = RandomWindowSampler(sc["n"], sc["window"], sc["stride"], sc["batch"], sc["seed"],
                                  rank=sc["rank"], world_size=sc["world_size"])  # fmt: skip
    if state is not None:
        sampler.load_state_dict(state)
    dataset = TokenWindowDataset(token_file, np.uint16, sc["window"], sc["seed"], transform=noisy)
    loader = make_loader(dataset, sampler, num_workers=sc["workers"], prefetch_factor=3 if sc["workers"] else None)
    it = sampler.track(loader)
    batches = [{k: v.tolist() for k, v in next(it).items()} for _ in range(steps)]
    return batches, json.loads(json.dumps(sampler.state_dict()))


def _reference(token_file, sc: dict) -> list[dict]:
    """The batches this rank should see for steps 1..steps, computed the slow, obvious way: every window start in
    every epoch's order (the permutation materialized, checked to be one), one long stream, cut into global batches
    of consecutive samples, this rank's slice of each; tokens read from the file and augmented with the sample's RNG."""
    windows = (sc["n"] - sc["window"]) // sc["stride"] + 1
    needed = sc["steps"] * sc["batch"]
    stream: list[int] = []
    for epoch in range(-(-needed // windows)):
        order = epoch_permutation(windows, sc["seed"], epoch)(np.arange(windows)).tolist()
        assert sorted(order) == list(range(windows)), "not a permutation"
        stream += order
    raw = np.fromfile(token_file, dtype=np.uint16)
    local = sc["batch"] // sc["world_size"]
    batches = []
    for step in range(1, sc["steps"] + 1):
        first = (step - 1) * sc["batch"] + sc["rank"] * local
        ts = list(range(first, first + local))
        starts = [stream[t] * sc["stride"] for t in ts]
        tokens = [noisy(raw[a : a + sc["window"]], sample_rng(sc["seed"], t)).tolist() for t, a in zip(ts, starts)]
        batches.append({"t": ts, "start": starts, "tokens": tokens})
    return batches


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_resumed_and_uninterrupted_streams_equal_the_reference(token_file, sc):
    expected = _reference(token_file, sc)
    whole, _ = _stream(token_file, sc, sc["steps"])
    head, state = _stream(token_file, sc, sc["cut"])
    tail, _ = _stream(token_file, sc, sc["steps"] - sc["cut"], state)
    assert (state["t"], state["step"]) == (sc["cut"] * sc["batch"], sc["cut"])
    assert whole == expected
    assert head + tail == expected
