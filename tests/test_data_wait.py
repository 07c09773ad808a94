"""The time training waits for its batches is goodput's `data_wait`, recorded by `make_loader(..., tracker=)` with no
code in the loop: exact seconds on a fake clock, and the window reader's batches under a real tracker."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ckpt import RandomWindowSampler, ShuffledSampler, TokenWindowDataset, make_loader
from ettr import FakeClock, GoodputTracker, attribute_root
from test_data_sampler import write_tokens


class SlowItems(Dataset):
    """Each item read moves the fake clock by `seconds`: a loader as slow as the test says."""

    def __init__(self, n: int, clock: FakeClock, seconds: float) -> None:
        self.n, self.clock, self.seconds = n, clock, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.clock.advance(self.seconds)
        return torch.tensor([i])


def test_the_wait_for_each_batch_is_data_wait_to_the_microsecond(tmp_path):
    clock = FakeClock(1000.0)
    tracker = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    sampler = ShuffledSampler(64, 4, seed=3, rank=0, world_size=1)
    loader = make_loader(SlowItems(64, clock, 0.05), sampler, tracker=tracker)  # 4 items: 0.2 s a batch
    for step, batch in zip(range(1, 4), sampler.track(loader)):  # the README's loop: the wait is outside the step
        with tracker.step(step):
            clock.advance(1.0)
    with tracker.step(4):  # the same loader inside a step (TrainLoop's steps() first): still data_wait, not compute
        next(iter(sampler.track(loader)))
        clock.advance(1.0)
    tracker.end()
    seconds = attribute_root(str(tmp_path)).seconds
    assert seconds["data_wait"] == 0.8
    assert seconds["productive"] == 4.0


def test_without_a_tracker_make_loader_iterates_as_a_plain_dataloader_and_records_nothing(tmp_path):
    clock = FakeClock(1000.0)
    tracker = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    sampler = ShuffledSampler(64, 4, seed=3, rank=0, world_size=1)
    loader = make_loader(SlowItems(64, clock, 0.05), sampler)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert type(iter(loader)) is torch.utils.data.dataloader._SingleProcessDataLoaderIter  # no timing around it
    with tracker.step(1):
        next(iter(sampler.track(loader)))
    tracker.end()
    seconds = attribute_root(str(tmp_path)).seconds
    assert seconds["data_wait"] == 0.0 and seconds["productive"] == 0.2


def _data_wait_spans(root: Path) -> int:
    lines = [json.loads(line) for f in (root / "ettr").glob("ledger-*.jsonl") for line in f.read_text().splitlines()]
    return sum(1 for r in lines if r["k"] == "span" and r["c"] == "data_wait")


def test_the_window_reader_reports_one_data_wait_per_batch_with_the_same_batches(tmp_path):
    path = write_tokens(tmp_path / "tokens.bin", 1 << 16)
    dataset = TokenWindowDataset(path, np.uint16, 33, seed=1)

    def sampler() -> RandomWindowSampler:
        return RandomWindowSampler(dataset.n_tokens, 33, 16, 8, seed=5, rank=0, world_size=1)

    plain_sampler = sampler()
    plain = [b["tokens"] for _, b in zip(range(6), plain_sampler.track(make_loader(dataset, plain_sampler)))]
    with GoodputTracker(str(tmp_path / "run"), attempt_id="a1", rank=0, job_id="job") as tracker:
        timed_sampler = sampler()
        timed = []
        for step, batch in zip(range(1, 7), timed_sampler.track(make_loader(dataset, timed_sampler, tracker=tracker))):
            with tracker.step(step):
                timed.append(batch["tokens"])
    assert all(torch.equal(a, b) for a, b in zip(plain, timed)) and len(timed) == 6
    assert _data_wait_spans(tmp_path / "run") == 6
    assert attribute_root(str(tmp_path / "run")).micros["data_wait"] > 0
