"""Samplers with real token files and real DataLoader workers: state, fingerprint, traps, skip list, explain, elastic."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ckpt.determinism.data import (
    DataMismatchError,
    RandomWindowSampler,
    ShuffledSampler,
    TokenWindowDataset,
    data_fingerprint,
    explain,
    format_explanation,
    hash_batch,
    is_sampler_state,
    make_loader,
)

SEED = 11


def write_tokens(path: Path, n: int, vocab: int = 50_000) -> Path:
    """A token file of n uint16 tokens from a fixed generator."""
    np.random.default_rng(0).integers(vocab, size=n, dtype=np.uint16).tofile(path)
    return path


def noisy(tokens: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """Augmentation: replace ~10% of tokens, drawing only from the per-sample generator."""
    out = tokens.astype(np.int64)
    mask = rng.random(len(out)) < 0.1
    out[mask] = rng.integers(0, 64, size=int(mask.sum()))
    return torch.from_numpy(out)


@pytest.fixture
def dataset(tmp_path) -> TokenWindowDataset:
    return TokenWindowDataset(write_tokens(tmp_path / "tokens.bin", 5000), np.uint16, 16, SEED, transform=noisy)


def _sampler(ds: TokenWindowDataset, **kw) -> RandomWindowSampler:
    kw = {"global_batch_size": 8, "stride": 7, **kw}
    return RandomWindowSampler(
        ds.n_tokens, ds.window, kw.pop("stride"), kw.pop("global_batch_size"), SEED, fingerprint=ds.fingerprint(), **kw
    )


def _run(loader: DataLoader, sampler, steps: int) -> list[dict]:
    it = sampler.track(loader)
    return [next(it) for _ in range(steps)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x) for x, y in zip(a, b)
    )


def test_state_is_small_json_and_resumes(dataset):
    s = _sampler(dataset)
    ref = _run(make_loader(dataset, s), s, 6)
    s2 = _sampler(dataset)
    _run(make_loader(dataset, s2), s2, 3)
    text = json.dumps(s2.state_dict())
    assert len(text) < 200 and s2.state_dict()["t"] == 24 and s2.step == 3
    s3 = _sampler(dataset)
    s3.load_state_dict(json.loads(text))
    assert _same(_run(make_loader(dataset, s3), s3, 3), ref[3:])


def test_batches_independent_of_workers_and_worker_seeds(dataset):
    """Trap: worker global RNGs are never captured; batches (augmentation included) must not depend on them."""
    runs = []
    for workers, gen_seed in [(0, 1), (2, 2), (2, 3)]:
        s = _sampler(dataset)
        loader = DataLoader(
            dataset,
            batch_sampler=s,
            num_workers=workers,
            prefetch_factor=4 if workers else None,
            generator=torch.Generator().manual_seed(gen_seed),
        )
        runs.append(_run(loader, s, 5))
    assert _same(runs[0], runs[1]) and _same(runs[0], runs[2])


class GlobalDraws(torch.utils.data.Dataset):
    """Items drawn from the fetching process's global RNGs, as a dataset calling random, np.random or torch.rand
    (torchvision's random transforms) does."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, random.randrange(10**6), np.random.randint(10**6), int(torch.randint(10**6, ()))])


def global_noise(tokens: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """A transform that ignores its generator and draws from torch's global one."""
    return torch.from_numpy(tokens.astype(np.int64)) + torch.randint(3, (len(tokens),))


@pytest.mark.parametrize("token_windows", [False, True])
def test_what_workers_draw_from_their_global_rngs_is_the_same_after_a_resume_and_for_any_worker_count(
    dataset, token_windows
):
    """DataLoader seeded each worker once per iter() (base seed + worker id): a resumed run's workers started
    their streams over, so the draws of __getitem__, a transform or a collate_fn diverged from the run that never
    stopped. make_loader seeds a worker's global RNGs from each batch's first sample counter."""
    if token_windows:
        data = TokenWindowDataset(dataset.path, np.uint16, 16, SEED, transform=global_noise)
        new = functools.partial(_sampler, data)
    else:
        data = GlobalDraws()
        new = functools.partial(ShuffledSampler, 40, 4, SEED, world_size=1, rank=0)

    def batches(sampler, workers: int, steps: int) -> list[list]:
        loader = make_loader(data, sampler, num_workers=workers)
        return [b["tokens"].tolist() if token_windows else b.tolist() for b in _run(loader, sampler, steps)]

    straight = batches(new(), 2, 8)
    for workers in (2, 1):
        cut = new()
        batches(cut, 2, 3)
        resumed = new()
        resumed.load_state_dict(json.loads(json.dumps(cut.state_dict())))
        assert batches(resumed, workers, 5) == straight[3:], f"resumed with {workers} workers"


class Vocabulary(GlobalDraws):
    vocab = {"<eos>": 0}

    def __len__(self) -> int:
        return 40


class OwnDraws(Vocabulary):
    """Items drawn from a generator the dataset holds (the PyTorch FAQ's recipe reseeds it in worker_init_fn)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(3)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(self.rng.integers(10**6))])


def test_a_generator_the_dataset_holds_is_named_in_a_warning_when_workers_copy_it():
    """Each worker holds a copy of it that starts over at every iter(), so after a resume (or with another worker
    count) its draws differ from the run that never stopped: a kill at step 3 and a resume at 2 workers gave other
    items from step 4 on, in silence. make_loader now warns, naming the attribute and what to draw from instead."""
    sampler = functools.partial(ShuffledSampler, 40, 4, SEED, world_size=1, rank=0)
    with pytest.warns(RuntimeWarning, match=r"'rng' is a Generator: each DataLoader worker \(2\) holds a copy"):
        make_loader(OwnDraws(), sampler(), num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_loader(OwnDraws(), sampler())  # in the main process: RNGState({"rng": dataset.rng}) resumes it
        make_loader(GlobalDraws(), sampler(), num_workers=2)


def test_the_loaders_dataset_still_answers_for_the_callers(dataset):
    """make_loader hands the DataLoader a wrapper that seeds each batch (above): the caller's ``loader.dataset.vocab``
    and ``len(loader.dataset)`` still reach its own dataset."""
    loader = make_loader(Vocabulary(), ShuffledSampler(40, 4, SEED, world_size=1, rank=0), num_workers=1)
    assert (loader.dataset.vocab, len(loader.dataset)) == ({"<eos>": 0}, 40)
    with pytest.raises(AttributeError, match="no attribute 'tokenizer'"):
        loader.dataset.tokenizer


def test_trap_iter_dataloader_does_not_touch_global_torch_rng(dataset):
    s = _sampler(dataset)
    before = torch.get_rng_state()
    iter(make_loader(dataset, s))
    assert torch.equal(torch.get_rng_state(), before)
    iter(DataLoader(dataset, batch_sampler=s))  # without a generator, torch draws a base seed globally
    assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("generator", [torch.Generator().manual_seed(7), None])
def test_a_generator_given_to_make_loader_is_refused_as_iter_would_draw_from_it(dataset, generator):
    """make_loader(..., generator=g) took g for the DataLoader's base seed, drawn at every iter(): with g also drawn
    by training (registered with RNGState), the resumed run's iter() drew once more than the straight run's, and
    every loss from the first resumed step on differed (generator=None drew from the global torch RNG)."""
    with pytest.raises(
        ValueError, match=re.escape(f"generator={generator!r}: the DataLoader draws from it at every iter()")
    ):
        make_loader(dataset, _sampler(dataset), generator=generator)


@pytest.mark.parametrize("workers", [0, 2])
def test_trap_state_loaded_after_iter_is_refused(dataset, workers):
    s = _sampler(dataset)
    state = s.state_dict()
    it = s.track(make_loader(dataset, s, num_workers=workers))
    next(it)
    s.load_state_dict(state)
    with pytest.raises(RuntimeError, match="after iter"):
        next(it)


def test_prefetch_does_not_move_the_position(dataset):
    s = _sampler(dataset)
    it = s.track(make_loader(dataset, s, num_workers=2, prefetch_factor=8))
    next(it)
    next(it)
    assert (s.step, s.state_dict()["t"]) == (2, 16)


def test_fingerprint_detects_other_data(tmp_path, dataset):
    s = _sampler(dataset)
    state = s.state_dict()
    copy = shutil.copy(dataset.path, tmp_path / "copy.bin")
    assert data_fingerprint(copy) == data_fingerprint(dataset.path)
    other = TokenWindowDataset(write_tokens(tmp_path / "other.bin", 5000, vocab=7), np.uint16, 16, SEED)
    with pytest.raises(
        DataMismatchError, match=r"fingerprint: checkpoint has '\w+', this run has '\w+'.*allow_data_change"
    ):
        _sampler(other).load_state_dict(state)
    with pytest.raises(DataMismatchError, match="c: checkpoint has 7, this run has 5"):
        _sampler(dataset, stride=5).load_state_dict(state)
    with pytest.raises(DataMismatchError, match="kind"):
        ShuffledSampler(10, 2, SEED).load_state_dict(state)


def test_a_sampler_built_from_numpy_integers_saves_a_state_it_loads(tmp_path):
    """numpy integers (a batch size computed with numpy, a step from an array) are ints: the state holds Python
    ints, so it loads again, also through a checkpoint (its counter was a numpy int its own load refused)."""
    import ckpt

    windows = RandomWindowSampler(np.int64(10_000), np.int32(100), np.int64(50), np.int64(8), np.uint64(5))
    shuffled = ShuffledSampler(100, np.int64(8), np.int64(0), world_size=np.int64(1), rank=np.int64(0))
    for s in (windows, shuffled):
        s.advance(np.int64(3))
        assert all(type(v) is int for k, v in s.state_dict().items() if k not in ("kind", "fingerprint", "skip"))
        s.load_state_dict(s.state_dict())
        assert s.counter(np.int64(5)) == 32 and type(s.counter(np.int64(5))) is int
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(3, {"sampler": windows}).wait()
        resumed = RandomWindowSampler(10_000, 100, 50, 8, 5)
        assert m.restore({"sampler": resumed}) == 3 and resumed.state_dict() == windows.state_dict()
    with pytest.raises(TypeError, match="batches must be an int, got float 1.0"):
        shuffled.advance(1.0)


def test_advance_never_goes_back():
    """advance(-2) moved the position back two batches in silence: a loop's step count turned into a rewind, the
    next batches replayed and the saved position behind what training had consumed."""
    s = ShuffledSampler(100, 8, 0, world_size=1, rank=0)
    s.advance(3)
    before = s.state_dict()
    with pytest.raises(ValueError, match=r"advance\(-2\): a count of batches consumed is >= 0"):
        s.advance(-2)
    assert s.state_dict() == before


def test_allow_data_change_carries_the_position_and_the_valid_skips_over_to_the_new_data(tmp_path, dataset):
    s = _sampler(dataset)
    s.skip([3, 600])
    _run(make_loader(dataset, s), s, 3)
    state = json.loads(json.dumps(s.state_dict()))
    shorter = TokenWindowDataset(write_tokens(tmp_path / "shorter.bin", 3000, vocab=7), np.uint16, 16, SEED)
    resumed = _sampler(shorter, allow_data_change=True)  # 427 windows instead of 713: item 600 no longer exists
    resumed.load_state_dict(state)
    assert (resumed.step, resumed.state_dict()["t"], resumed.state_dict()["skip"]) == (3, 24, [3])
    assert resumed.state_dict()["fingerprint"] == shorter.fingerprint() != state["fingerprint"]  # this run's data
    batch = next(resumed.track(make_loader(shorter, resumed)))
    assert batch["t"].tolist() == list(range(24, 32)) and resumed.step == 4  # the next step's samples, on the new data
    assert batch["start"].tolist() == resumed.explain(4).starts
    assert all(3 not in resumed.explain(k).indices for k in range(4, 4 + 427 // 8 + 2)), "the skip list carried over"


def test_allow_data_change_to_another_stride_or_window_skips_every_window_over_the_skipped_tokens():
    """A skip is the tokens of its window: under another stride the saved index named another window, so the record
    of death trained again and an innocent window was dropped. Every new window overlapping them is skipped."""
    old = RandomWindowSampler(10_000, 100, 100, 8, 1, world_size=1, rank=0, fingerprint="f")
    old.skip([3])  # tokens [300, 400)
    old.advance(5)
    for window, stride, expected in ((100, 50, [5, 6, 7]), (100, 100, [3]), (50, 100, [3]), (150, 100, [2, 3])):
        new = RandomWindowSampler(
            10_000, window, stride, 8, 1, world_size=1, rank=0, fingerprint="f", allow_data_change=True
        )
        new.load_state_dict(old.state_dict())
        assert new.state_dict()["skip"] == expected, (window, stride)
        starts = new.indices(np.arange(new.num_items)) * stride
        assert not any(s < 400 and s + window > 300 for s in starts.tolist()), (window, stride)
    with pytest.raises(DataMismatchError, match="key 'c' must be a positive int, got 0"):
        new.load_state_dict({**old.state_dict(), "c": 0})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"t": 16.9}, r"key 't' must be an int"),
        ({"t": "16"}, r"key 't' must be an int"),
        ({"t": -8}, r"key 't' must be an int"),  # failed at the first batch, far from the load
        ({"t": 2**70}, r"key 't' must be an int"),  # OverflowError at the first batch
        ({"step": None}, r"key 'step' must be an int"),
        ({"skip": "12"}, r"key 'skip' must be a list"),  # read as [1, 2]
        ({"skip": [-1]}, r"key 'skip' must be a list"),
        ({"skip": [3, 713]}, r"key 'skip' must hold item indices in \[0, 713\), got 713"),  # dropped silently
        ({"skip": list(range(713))}, r"key 'skip' skips all 713 items"),  # iteration looped forever
    ],
)
def test_a_sampler_state_it_cannot_take_is_refused_at_load_naming_its_key(dataset, change, message):
    s = _sampler(dataset)
    state = {**json.loads(json.dumps(s.state_dict())), **change}
    with pytest.raises(DataMismatchError, match=message):
        _sampler(dataset).load_state_dict(state)
    with pytest.raises(TypeError, match="sampler state must be a dict"):
        s.load_state_dict([1])


def test_a_restore_refusing_one_of_several_samplers_names_its_key_and_step(tmp_path):
    """With a train and a validation sampler, a restore refused one with "batch: checkpoint has 4, this run has 8"
    and no word of which: the error now names its key path and the step."""
    from ckpt import CheckpointManager

    def samplers(val_batch: int) -> dict:
        return {"train": ShuffledSampler(40, 4, SEED, world_size=1, rank=0),
                "val": ShuffledSampler(40, val_batch, SEED, world_size=1, rank=0)}  # fmt: skip

    with CheckpointManager(str(tmp_path / "ck")) as manager:
        manager.save(3, {"samplers": samplers(4)})
        with pytest.raises(DataMismatchError, match=r"restore of key 'samplers.val' \(step 3\): resuming .*batch: che"):
            manager.restore({"samplers": samplers(8)})


def test_a_resume_onto_data_so_small_that_the_skips_cover_it_is_refused(tmp_path, dataset):
    """allow_data_change onto a 2-window stream, with both windows skipped before: iteration used to loop forever."""
    s = _sampler(dataset, global_batch_size=2)
    s.skip([0, 1])
    tiny = TokenWindowDataset(write_tokens(tmp_path / "tiny.bin", 16 + 7), np.uint16, 16, SEED)
    resumed = _sampler(tiny, global_batch_size=2, allow_data_change=True)
    with pytest.raises(DataMismatchError, match="skips all 2 items"):
        resumed.load_state_dict(json.loads(json.dumps(s.state_dict())))


def test_bad_data_arguments_are_refused_where_given(tmp_path, dataset):
    """A FIFO token file hung the fingerprint; a sampler whose windows are not the dataset's gave other batches
    than explain() names, silently; world_size=0 was a ZeroDivisionError."""
    import os

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="fifo: not a regular file"):
        TokenWindowDataset(tmp_path / "fifo", np.uint16, 16, SEED)
    with pytest.raises(TypeError, match="token dtype must be numeric"):
        TokenWindowDataset(dataset.path, object, 16, SEED)
    for window, seed, match in ((0, SEED, "need 1 <= window"), (6000, SEED, "need 1 <= window"), (16, -1, "seed")):
        with pytest.raises(ValueError, match=match):
            TokenWindowDataset(dataset.path, np.uint16, window, seed)
    with pytest.raises(TypeError, match="window must be an int, got float"):
        TokenWindowDataset(dataset.path, np.uint16, 2.5, SEED)
    other_window = RandomWindowSampler(dataset.n_tokens, 100, 7, 8, SEED, fingerprint=dataset.fingerprint())
    with pytest.raises(ValueError, match=r"sampler \(window 100.*does not fit the dataset \(window 16"):
        make_loader(dataset, other_window)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        _sampler(dataset, rank=0, world_size=0)


def test_a_shuffled_sampler_over_more_items_than_the_dataset_has_is_refused_by_make_loader():
    """ShuffledSampler(501) over 500 items failed only when its batches reached item 500, anywhere in the epoch,
    with the dataset's own IndexError."""
    with pytest.raises(ValueError, match=r"sampler \(501 items\) does not fit the dataset \(500 items\)"):
        make_loader(list(range(500)), ShuffledSampler(501, 4, SEED, world_size=1, rank=0))
    make_loader(list(range(500)), ShuffledSampler(400, 4, SEED, world_size=1, rank=0))  # a prefix: fine


def test_a_window_sampler_fingerprinted_on_other_data_is_refused_by_make_loader(tmp_path, dataset):
    """A sampler whose fingerprint names other tokens (as many of them) was served the dataset's: its resume was
    checked against data the loader does not read. make_loader now refuses it, naming both fingerprints."""
    other = TokenWindowDataset(write_tokens(tmp_path / "other.bin", 5000, vocab=7), np.uint16, 16, SEED)
    with pytest.raises(DataMismatchError, match=f"fingerprint '{other.fingerprint()}' is not the dataset's "
                       f"'{dataset.fingerprint()}' \\({dataset.path}\\)"):  # fmt: skip
        make_loader(dataset, _sampler(other))
    make_loader(dataset, RandomWindowSampler(dataset.n_tokens, 16, 7, 8, SEED))  # no fingerprint: nothing to check


def test_a_shuffled_sampler_of_a_count_that_is_not_an_int_is_a_type_error_naming_it():
    """`num_items < 1` ran before the type check: None or "100" gave "'<' not supported between instances"."""
    for num_items, kind in ((None, "NoneType"), ("100", "str"), (100.0, "float")):
        with pytest.raises(TypeError, match=f"num_items must be an int, got {kind}"):
            ShuffledSampler(num_items, 8, SEED, world_size=1, rank=0)
    with pytest.raises(ValueError, match="num_items must be >= 1 and <= 2\\*\\*62, got 0"):
        ShuffledSampler(0, 8, SEED, world_size=1, rank=0)


def test_a_fingerprint_that_is_not_a_str_is_refused_where_the_sampler_is_built():
    """A fingerprint of bytes (or the method itself, not its value) was kept: the save failed later or stored bytes
    that no resume's str fingerprint equals, a DataMismatchError of two equal-looking digests."""
    for fingerprint in (b"abc", TokenWindowDataset.fingerprint, 12):
        with pytest.raises(TypeError, match="fingerprint must be a str .* or None, got"):
            RandomWindowSampler(10_000, 16, 8, 4, SEED, rank=0, world_size=1, fingerprint=fingerprint)
        with pytest.raises(TypeError, match="fingerprint must be a str"):
            ShuffledSampler(100, 4, SEED, rank=0, world_size=1, fingerprint=fingerprint)


@pytest.mark.parametrize("items", [2**62 + 1, 2**63, 2**70])
def test_a_sampler_over_more_items_than_its_permutation_covers_is_refused_where_built(items):
    """Built without a word, such a sampler failed at its first batch or explain(): "permutation size must be in
    [1, 2**62]" past 2**62 items, an OverflowError naming nothing past 2**63."""
    with pytest.raises(ValueError, match=f"num_items must be >= 1 and <= 2\\*\\*62, got {items}"):
        ShuffledSampler(items, 8, SEED, world_size=1, rank=0)
    with pytest.raises(ValueError, match=f"n_tokens={items + 1} window=2 stride=1 give {items} windows"):
        RandomWindowSampler(items + 1, 2, 1, 8, SEED, world_size=1, rank=0)
    assert ShuffledSampler(2**62, 8, SEED, world_size=1, rank=0).explain(1).indices  # the largest it permutes


def test_batch_hash_is_the_hash_of_what_training_received_remembered_from_the_draw(dataset):
    """What the goodput ledger records per step (docs/goodput.md, replay): the loader's draw leaves each step's hash
    behind (workers fetch, the main process draws), a step never drawn is computed, a resume forgets the old draws."""
    s = _sampler(dataset, world_size=2, rank=1)  # the hash covers the global batch, whichever rank draws
    batches = _run(make_loader(dataset, s, num_workers=2), s, 3)
    assert sorted(s._hashes)[:3] == [1, 2, 3]  # drawn, and maybe a few prefetched beyond
    whole = _sampler(dataset)
    for step, batch in enumerate(batches, start=1):
        assert s.batch_hash(step) == whole.explain(step).batch_hash == s.explain(step).batch_hash
        assert batch["t"].tolist() == whole.explain(step).counters[4:]  # rank 1's half of the same global batch
    assert s.batch_hash(40) == whole.explain(40).batch_hash and 40 not in s._hashes  # never drawn: computed
    s.load_state_dict(s.state_dict())
    assert not s._hashes and s.batch_hash(2) == whole.explain(2).batch_hash


def test_a_skip_forgets_the_hashes_of_the_batches_drawn_before_it(dataset):
    """batch_hash(step) of a step the loader drew (prefetched) before a skip changed its batch gave the old batch's
    hash, not explain's: a skip, like a load, makes the next iterator draw again."""
    s = _sampler(dataset)
    drawn = iter(s)
    next(drawn), next(drawn)  # steps 1 and 2 drawn, as a loader's prefetch draws ahead of training
    old = s.batch_hash(2)
    s.skip(s.explain(2).indices[:1])
    assert s.batch_hash(2) == s.explain(2).batch_hash != old


def test_explain_matches_the_hash_of_what_training_received(dataset):
    s = _sampler(dataset)
    batches = _run(make_loader(dataset, s, num_workers=2), s, 4)
    state = json.loads(json.dumps(s.state_dict()))
    assert is_sampler_state(state)
    for step, batch in enumerate(batches, start=1):  # steps count from 1, as in logs and checkpoint names
        e = explain(state, step)
        assert e.batch_hash == hash_batch(batch["t"].tolist(), batch["start"].tolist())
        assert e.starts == batch["start"].tolist() and e.counters == batch["t"].tolist()
        raw = np.fromfile(dataset.path, dtype=np.uint16)
        assert [raw[a : a + e.window].tolist() for a in e.starts] == [raw[a : a + 16].tolist() for a in batch["start"]]
    text = format_explanation(explain(state, 2))
    assert text.splitlines()[0].startswith("step 2: global samples t=8..15, epoch 0, batch hash ")
    with pytest.raises(ValueError, match="steps count from 1"):
        explain(state, 0)
    assert f"tokens [{e.starts[0]}, {e.starts[0] + 16})" in format_explanation(e)


def test_explain_of_what_is_no_sampler_state_or_of_a_step_past_the_counters_is_a_value_error_naming_it(dataset):
    """explain(None, 1) was "'NoneType' object has no attribute 'get'", and a step whose counter passes int64 was
    "OverflowError: Python int too large to convert to C long", naming neither."""
    state = _sampler(dataset).state_dict()
    for odd in (None, [state]):
        with pytest.raises(ValueError, match=f"not a sampler state: got {type(odd).__name__}"):
            explain(odd, 1)
    with pytest.raises(ValueError, match=rf"step {2**70}: its sample counter {(2**70 - 1) * 8} is past 2\*\*62"):
        explain(state, 2**70)
    with pytest.raises(ValueError, match=r"is past 2\*\*62"):
        _sampler(dataset).advance(2**62)
    assert explain(state, 2**59).counters[0] == (2**59 - 1) * 8  # the last steps below it still explain
    cut = {
        k: v for k, v in state.items() if k != "fingerprint"
    }  # an older or edited state (was KeyError 'fingerprint')
    with pytest.raises(
        ValueError, match=r"sampler state of kind 'ckpt.RandomWindowSampler/1' has no key 'fingerprint'"
    ):
        explain(cut, 1)


def test_skip_list_removes_windows_for_every_later_resume(dataset):
    s = _sampler(dataset)
    epoch_len = s.num_items
    bad = s.explain(3).indices[:3]
    s.skip(bad)
    assert not set(bad) & set(s.explain(3).indices)
    resumed = _sampler(dataset)
    resumed.load_state_dict(json.loads(json.dumps(s.state_dict())))
    seen = np.concatenate([resumed.global_batch(k)[1] for k in range(1, 3 * epoch_len // 8 + 3)])
    assert not set(bad) & set(seen.tolist())
    clean = _sampler(dataset)
    changed = [k for k in range(1, epoch_len // 8 + 1) if clean.explain(k).indices != resumed.explain(k).indices]
    assert changed == [3]  # only the batch that held the bad windows differs in epoch 0
    with pytest.raises(ValueError, match="all"):
        ShuffledSampler(3, 1, SEED).skip([0, 1, 2])


def test_a_long_skip_list_replaces_a_batchs_skipped_items_in_a_few_vectorized_rounds(monkeypatch):
    """Half of 20,000 items skipped (a bad shard's windows): each hit was replaced in a Python loop that scanned the
    whole skip list per position tried and evaluated the permutation one position at a time, in the main process,
    every step (0.16 s a batch of 512 with a million skips). The replacements are still the scalar walk's."""
    from ckpt.determinism import permutation

    s = ShuffledSampler(20_000, 512, SEED, world_size=1, rank=0)
    s.skip(range(0, 20_000, 2))
    calls = []
    real = permutation.FeistelPermutation.__call__
    monkeypatch.setattr(permutation.FeistelPermutation, "__call__", lambda p, i: calls.append(i) or real(p, i))
    counters, indices = s.global_batch(3)
    assert len(calls) < 40, f"{len(calls)} permutation calls for one batch of 512"  # was one per position tried
    monkeypatch.undo()
    skipped = set(range(0, 20_000, 2))
    for t, item in zip(counters.tolist(), indices.tolist()):  # the next unskipped item of the epoch's order
        epoch, position = divmod(t, 20_000)
        perm = permutation.epoch_permutation(20_000, SEED, epoch)
        while int(perm(position)) in skipped:
            position = (position + 1) % 20_000
        assert item == int(perm(position)), t


def test_skip_of_indices_that_are_not_ints_is_a_type_error_naming_the_first():
    """skip("12") skipped items 1 and 2, and skip([12.5]) (an index computed as start / stride) item 12, silently."""
    s = ShuffledSampler(100, 4, SEED, world_size=1, rank=0)
    for indices, message in (
        ("12", r"indices\[0\] must be an int, got str '1'"),
        ([3, 12.5], r"indices\[1\].*float 12.5"),
    ):
        with pytest.raises(TypeError, match=message):
            s.skip(indices)
    assert s.state_dict()["skip"] == []
    s.skip(np.array([7, 3]))
    assert s.state_dict()["skip"] == [3, 7]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_elastic_same_global_batches_for_every_world_size(dataset, world_size):
    reference = _sampler(dataset)
    ranks = [_sampler(dataset, rank=r, world_size=world_size) for r in range(world_size)]
    for step in range(1, 61):  # crosses an epoch boundary (101 windows / 8)
        local = [pair for s in ranks for pair in s.local_batch(step)]
        assert local == reference.local_batch(step)


BUILT_BEFORE_INIT = """
import os, socket, torch.distributed as dist, torch.multiprocessing as mp
from ckpt import ShuffledSampler
def run(rank, port):
    found = ShuffledSampler(100, 4, 0)  # before init_process_group: rank 0 of 1
    given = ShuffledSampler(100, 4, 0, rank=rank, world_size=2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        outcome = f"iterated {next(iter(found))}"
    except RuntimeError as e:
        outcome = str(e)
    after = ShuffledSampler(100, 4, 0)
    os.write(1, f"{rank} {outcome} | {next(iter(given))} {after.local_batch(1)}\\n".encode())  # one write a rank
    dist.destroy_process_group()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
mp.start_processes(run, args=(port,), nprocs=2, start_method="fork")
"""


def test_a_sampler_built_before_init_process_group_refuses_to_iterate_in_another_rank(tmp_path):
    """Built before `init_process_group` under torchrun, a sampler took rank 0 of 1 on every rank: each rank drew the
    whole global batch and all trained the same samples, silently. Iterating now raises, naming both places."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run(
        [sys.executable, "-c", BUILT_BEFORE_INIT], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    reference = ShuffledSampler(100, 4, 0, rank=0, world_size=1).local_batch(1)
    halves = [reference[:2], reference[2:]]  # rank r of 2: its half of the global batch
    assert sorted(res.stdout.splitlines()) == [
        f"{rank} sampler built as rank 0 of 1 (torch.distributed's place when it was built), iterated in rank {rank} of"
        f" 2: build it after init_process_group, or pass rank= and world_size= | {halves[rank]} {halves[rank]}"
        for rank in (0, 1)
    ]


def test_elastic_resume_at_world_size_2_from_world_size_4(dataset):
    four = [_sampler(dataset, rank=r, world_size=4) for r in range(4)]
    for s in four:
        s.advance(13)
    states = [json.loads(json.dumps(s.state_dict())) for s in four]
    assert all(state == states[0] for state in states)
    two = [_sampler(dataset, rank=r, world_size=2) for r in range(2)]
    for s in two:
        s.load_state_dict(states[0])
    reference = _sampler(dataset)
    for step in range(14, 41):
        assert [p for s in two for p in s.local_batch(step)] == reference.local_batch(step)
    assert next(iter(two[1])) == reference.local_batch(14)[4:]


def test_shuffled_sampler_covers_each_epoch_once_and_resumes():
    data = list(range(100, 160))
    s = ShuffledSampler(len(data), 6, SEED)
    loader = make_loader(data, s, num_workers=2)
    batches = [b.tolist() for b in _run(loader, s, 20)]
    assert sorted(sum(batches[:10], [])) == data and sorted(sum(batches[10:], [])) == data
    assert batches[:10] != batches[10:]
    resumed = ShuffledSampler(len(data), 6, SEED)
    cut = ShuffledSampler(len(data), 6, SEED)
    _run(make_loader(data, cut), cut, 7)
    resumed.load_state_dict(json.loads(json.dumps(cut.state_dict())))
    assert [b.tolist() for b in _run(make_loader(data, resumed), resumed, 13)] == batches[7:]
    assert explain(resumed.state_dict(), 4).indices == [x - 100 for x in batches[3]]  # the 4th batch is step 4
