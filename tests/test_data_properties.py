"""Property: a stream cut anywhere (epoch boundaries included), saved to JSON and resumed equals the uninterrupted one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt import RandomWindowSampler, TokenWindowDataset, make_loader
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


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_resumed_stream_equals_uninterrupted(token_file, sc):
    whole, _ = _stream(token_file, sc, sc["steps"])
    head, state = _stream(token_file, sc, sc["cut"])
    tail, _ = _stream(token_file, sc, sc["steps"] - sc["cut"], state)
    assert head + tail == whole
