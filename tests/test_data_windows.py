"""The batch window reader against per-item reads: same windows, order and bytes, over seeds, world sizes, workers,
a resume, shards (a window across a boundary) and every backend; real files, no mocks."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from ckpt import RandomWindowSampler, TokenWindowDataset, make_loader
from ckpt.determinism.data import WindowBatches, data_fingerprint
from ckpt.determinism.windows import TokenStream, WindowReader
from test_data_sampler import noisy, write_tokens

WINDOW = 33


class PerItem(Dataset):
    """A plain DataLoader's path: it indexes the dataset one window at a time (no `__getitems__`, no read-ahead)."""

    def __init__(self, dataset: TokenWindowDataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key):
        return self.dataset[key]


def _reference(dataset: TokenWindowDataset, sampler: RandomWindowSampler, steps: int) -> list[dict]:
    """Batches as a plain per-item DataLoader over the sampler gives them (default collate)."""
    it = sampler.track(DataLoader(PerItem(dataset), batch_sampler=sampler, collate_fn=default_collate))
    return [next(it) for _ in range(steps)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def _shards(tmp_path, sizes: list[int]) -> list:
    d = tmp_path / "shards"
    d.mkdir()
    return [write_tokens(d / f"part-{i:03d}.bin", n, vocab=1000 + i) for i, n in enumerate(sizes)]


def _sampler(ds: TokenWindowDataset, seed: int, batch: int, **kw) -> RandomWindowSampler:
    return RandomWindowSampler(ds.n_tokens, WINDOW, 5, batch, seed, fingerprint=ds.fingerprint(), **kw)


@pytest.mark.parametrize("seed", [0, 7, 2**33 + 1])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_make_loader_equals_per_item_reads_over_seeds_world_sizes_and_a_resume(tmp_path, seed, world_size):
    files = _shards(tmp_path, [700, 61, 1500])
    ds = TokenWindowDataset(files, np.uint16, WINDOW, seed)
    for rank in range(world_size):
        ref = _reference(ds, _sampler(ds, seed, 8, rank=rank, world_size=world_size), 12)
        s = _sampler(ds, seed, 8, rank=rank, world_size=world_size)
        it = s.track(make_loader(ds, s))
        first = [next(it) for _ in range(5)]
        state = json.loads(json.dumps(s.state_dict()))
        resumed = _sampler(ds, seed, 8, rank=rank, world_size=world_size)
        resumed.load_state_dict(state)
        it = resumed.track(make_loader(TokenWindowDataset(files, np.uint16, WINDOW, seed), resumed))
        assert _same(first + [next(it) for _ in range(7)], ref), (seed, world_size, rank)


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_transform_and_own_collate_equal_per_item_reads(tmp_path, workers):
    ds = TokenWindowDataset(write_tokens(tmp_path / "tokens.bin", 5000), np.uint16, WINDOW, 3, transform=noisy)
    ref = _reference(ds, _sampler(ds, 3, 6), 9)
    s = _sampler(ds, 3, 6)
    it = s.track(make_loader(ds, s, num_workers=workers, prefetch_factor=3 if workers else None))
    assert _same([next(it) for _ in range(9)], ref)
    s = _sampler(ds, 3, 6)
    it = s.track(make_loader(ds, s, num_workers=workers, collate_fn=default_collate))
    assert _same([next(it) for _ in range(9)], ref)


def test_skip_and_state_loaded_between_iterators_are_read_exactly(tmp_path):
    """A skip changes the windows of counters already read ahead, a loaded state the counters: both must be read
    anew (the read-ahead is used only for exactly the keys asked), never served stale."""
    ds = TokenWindowDataset(write_tokens(tmp_path / "tokens.bin", 4000), np.uint16, WINDOW, 5)
    s = _sampler(ds, 5, 4)
    loader = make_loader(ds, s)  # one WindowBatches across the iterators, its read-ahead still in flight
    it = s.track(loader)
    [next(it) for _ in range(3)]
    s.skip(s.explain(4).indices[:2])  # step 4's batch (counters 12..15) is in flight with the old windows
    it = s.track(loader)
    got = [next(it) for _ in range(3)]
    state = {**s.state_dict(), "t": 40, "step": 10}  # the skip list travels in the state
    s.load_state_dict(state)
    it = s.track(loader)
    got += [next(it) for _ in range(4)]
    ref_s = _sampler(ds, 5, 4)
    ref_s.load_state_dict({**state, "t": 12, "step": 3})
    ref = _reference(ds, ref_s, 3)
    ref_s.load_state_dict(state)
    assert _same(got, ref + _reference(ds, ref_s, 4))


@pytest.mark.parametrize("backend,direct", [("aio", True), ("threads", True), ("threads", False)])
def test_every_backend_reads_the_bytes_of_the_files(tmp_path, backend, direct):
    files = _shards(tmp_path, [10_000, 3, 4097, 20_001])
    stream = TokenStream([os.fspath(f) for f in files], np.uint16)
    tokens = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in files])
    window = 2049  # 4098 bytes: every window spans two or three pages
    reader = WindowReader(stream, window, backend=backend, direct=direct, threads=4)
    starts = np.random.default_rng(1).integers(0, stream.n_tokens - window + 1, 300)
    starts[:4] = [0, stream.n_tokens - window, 10_000 - 1, 10_000 - 100]  # the ends; across the 3-token shard
    expected = tokens[starts[:, None] + np.arange(window)]
    tickets = [reader.submit(starts[i::3]) for i in range(3)]  # several batches in flight at once
    for i, ticket in enumerate(tickets):
        np.testing.assert_array_equal(reader.collect(ticket), expected[i::3])
    assert reader.backend == backend


def test_window_across_a_shard_boundary_is_the_tail_then_the_head(tmp_path):
    a, b = _shards(tmp_path, [100, 100])
    ds = TokenWindowDataset([a, b], np.uint16, 10, 0)
    ta, tb = np.fromfile(a, dtype=np.uint16), np.fromfile(b, dtype=np.uint16)
    want = np.concatenate([ta[95:], tb[:5]]).astype(np.int64)
    assert ds[(0, 95)]["tokens"].tolist() == want.tolist()
    assert ds.__getitems__([(0, 95)])[0]["tokens"].tolist() == want.tolist()
    with pytest.raises(IndexError, match=r"window \[191, 201\) exceeds the 200 tokens of 2 files"):
        ds[(0, 191)]
    last = (1 << 63) - 3  # start + window overflowed int64 past the bounds check: "not enough values to unpack"
    for read in (lambda: ds[(0, last)], lambda: ds.__getitems__([(0, last)])):
        with pytest.raises(IndexError, match=rf"window \[{last}, {last + 10}\) exceeds the 200 tokens of 2 files"):
            read()


def test_an_empty_shard_is_skipped_by_both_paths(tmp_path):
    """A 0-byte shard in a directory broke every `dataset[key]` (numpy cannot map an empty file) while the batch
    path read on: it holds no tokens, so a window around it is the tail of the shard before and the head of the next."""
    a, empty, b = _shards(tmp_path, [100, 0, 100])
    ds = TokenWindowDataset(a.parent, np.uint16, 10, 0)
    assert ds.files == [os.fspath(a), os.fspath(empty), os.fspath(b)] and ds.n_tokens == 200
    ta, tb = np.fromfile(a, dtype=np.uint16), np.fromfile(b, dtype=np.uint16)
    for start, want in ((95, np.concatenate([ta[95:], tb[:5]])), (100, tb[:10]), (0, ta[:10])):
        assert ds[(0, start)]["tokens"].tolist() == want.tolist()
        assert ds.__getitems__([(0, start)])[0]["tokens"].tolist() == want.tolist()


def test_directory_is_one_stream_in_name_order_and_fingerprinted(tmp_path):
    files = _shards(tmp_path, [300, 200, 100])
    (files[0].parent / ".hidden").write_bytes(b"xx")
    by_dir = TokenWindowDataset(files[0].parent, np.uint16, WINDOW, 0)
    assert by_dir.files == [os.fspath(f) for f in files] and by_dir.n_tokens == 600
    assert by_dir.fingerprint() == TokenWindowDataset(files, np.uint16, WINDOW, 0).fingerprint()
    assert by_dir.fingerprint() != TokenWindowDataset(files[::-1], np.uint16, WINDOW, 0).fingerprint()
    single = TokenWindowDataset(files[0], np.uint16, WINDOW, 0)
    assert single.fingerprint() == data_fingerprint(files[0]) and single.path == os.fspath(files[0])


def test_errors_name_the_file_and_the_sizes(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"odd.bin: size 3 is not a multiple of uint16 itemsize 2"):
        TokenWindowDataset([write_tokens(tmp_path / "ok.bin", 10), odd], np.uint16, 4, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: directory holds no token files"):
        TokenWindowDataset(tmp_path / "empty", np.uint16, 4, 0)
    path = write_tokens(tmp_path / "t.bin", 5000)
    reader = WindowReader(TokenStream([os.fspath(path)], np.uint16), 16)
    reader.read([0, 100])
    os.truncate(path, 150)  # the file shrank under the reader: reads come back short
    with pytest.raises(OSError, match=r"t.bin: read at byte 0: expected 232 bytes, got 150 bytes"):
        reader.read([100])


def test_a_path_given_as_bytes_is_that_path(tmp_path):
    """A bytes path was taken for a list of files, its bytes for paths: "expected str, bytes or os.PathLike
    object, not int"."""
    path = write_tokens(tmp_path / "t.bin", 100)
    for source in (os.fsencode(path), [os.fsencode(path)], os.fsencode(tmp_path)):
        ds = TokenWindowDataset(source, np.uint16, WINDOW, 0)
        assert ds.files == [str(path)] and ds.fingerprint() == data_fingerprint(path)


def test_a_stream_without_tokens_names_its_files(tmp_path):
    """An empty token file (or a directory of empty shards) said only "the stream's 0 tokens", naming no file."""
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"need 1 <= window <= the 0 tokens of {empty} and seed >= 0")):
        TokenWindowDataset(empty, np.uint16, 4, 0)
    a, _ = _shards(tmp_path, [0, 0])
    with pytest.raises(ValueError, match=re.escape(f"the 0 tokens of 2 files ({a}, ...)")):
        TokenWindowDataset(a.parent, np.uint16, 4, 0)


SHRUNK_UNDER_A_JOB = """
import os, sys, numpy as np
from ckpt import TokenWindowDataset
ds = TokenWindowDataset(sys.argv[1], np.uint16, 4096, 0)
ds[(0, 0)]
os.truncate(sys.argv[1], 6000)  # the token file shrinks under the running job (rewritten in place)
for read in (lambda: ds[(1, 2048)], lambda: ds.__getitems__([(1, 2048)])):
    try:
        read()
    except OSError as e:
        print(e)
"""


def test_a_token_file_that_shrank_under_the_job_is_an_error_naming_it_on_both_paths(tmp_path):
    """`dataset[key]` read through memory maps kept since its first read: a window past the file's new end killed
    the process with SIGBUS, no exception; now both paths raise the batch path's OSError with the sizes."""
    path = write_tokens(tmp_path / "t.bin", 1 << 16)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([sys.executable, "-c", SHRUNK_UNDER_A_JOB, path], capture_output=True, text=True, env=env)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.splitlines() == [f"{path}: read at byte 4096: expected 8192 bytes, got 1904 bytes"] * 2


def test_read_ahead_serves_every_batch_after_the_first_and_a_resume_misses_once(tmp_path):
    ds = TokenWindowDataset(write_tokens(tmp_path / "tokens.bin", 5000), np.uint16, WINDOW, 0)
    s = _sampler(ds, 0, 4)
    loader = make_loader(ds, s)
    it = s.track(loader)
    [next(it) for _ in range(6)]
    assert (loader.dataset.hits, loader.dataset.misses) == (5, 1)
    s.load_state_dict({**s.state_dict(), "t": 400, "step": 100})
    it = s.track(loader)
    [next(it) for _ in range(3)]
    assert (loader.dataset.hits, loader.dataset.misses) == (7, 2)


def test_prefetch_is_bounded_per_process(tmp_path):
    ds = TokenWindowDataset(write_tokens(tmp_path / "tokens.bin", 5000), np.uint16, WINDOW, 0)
    s = _sampler(ds, 0, 4)
    view = WindowBatches(ds, s, prefetch_batches=8, max_prefetch_bytes=3 * 4 * WINDOW * 2)
    view.__getitems__(s.local_batch(1))
    assert sorted(view._pending) == [4, 8, 12]  # three batches by the byte bound, not eight
    assert len(ds.reader()._inflight) == 3
    view.__getitems__(s.local_batch(2))
    assert sorted(view._pending) == [8, 12, 16] and len(ds.reader()._inflight) == 3
    with pytest.raises(ValueError, match="must be >= 0"):
        WindowBatches(ds, s, prefetch_batches=-1)


def test_pin_memory_follows_cuda(tmp_path):
    ds = TokenWindowDataset(write_tokens(tmp_path / "tokens.bin", 1000), np.uint16, WINDOW, 0)
    s = _sampler(ds, 0, 4)
    assert make_loader(ds, s).pin_memory == torch.cuda.is_available()
    if torch.cuda.is_available():
        assert next(iter(make_loader(ds, s)))["tokens"].is_pinned()


def test_threads_indexing_one_dataset_at_once_get_the_single_thread_windows(tmp_path):
    """A thread-pool prefetcher indexes one dataset from many threads: they shared its one reader (one ticket
    counter, one AIO ring whose completions any thread reaped, shared bounce buffers), so reads came back wrong,
    raised, or waited for ever; each thread now reads through its own reader, and a pickled dataset still works."""
    files = _shards(tmp_path, [40_000, 7, 25_000])
    ds = TokenWindowDataset(files, np.uint16, WINDOW, 11, transform=noisy)
    starts = np.random.default_rng(2).integers(0, ds.n_tokens - WINDOW + 1, 600).tolist()
    keys = [(t, s) for t, s in enumerate(starts)]
    alone = TokenWindowDataset(files, np.uint16, WINDOW, 11, transform=noisy)
    want = [alone[key]["tokens"] for key in keys]
    n = 12
    got: list[list] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def work(i: int) -> None:
        try:
            barrier.wait()
            mine = keys[i::n]
            got[i] += [ds[key]["tokens"] for key in mine]  # per item
            got[i] += [sample["tokens"] for sample in ds.__getitems__(mine[::-1])]  # and as one batch
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120  # a guard against the old deadlock only: a pass takes about a second
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "threads reading one dataset deadlocked"
    assert not errors, errors[:3]
    for i in range(n):
        mine = want[i::n]
        assert all(torch.equal(a, b) for a, b in zip(got[i], mine + mine[::-1])) and len(got[i]) == 2 * len(mine)
    copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets: paths and settings, no reader
    assert all(torch.equal(copy[key]["tokens"], w) for key, w in zip(keys[:50], want[:50]))


def test_a_key_that_is_not_two_ints_is_a_type_error_on_both_paths(tmp_path):
    """`dataset[(0, 1.7)]` read the window at 1 and named its start 1.7 (the batch path named it 1), and
    `dataset[5]` said only "cannot unpack non-iterable int": keys are (t, start) pairs of ints on both paths."""
    ds = TokenWindowDataset(write_tokens(tmp_path / "t.bin", 1000), np.uint16, 10, 0)
    for key in ((0, 1.7), (0, "3"), (True, 2), 5, (0,)):
        with pytest.raises(TypeError, match="must be an int|a key is a \\(t, start\\) pair of ints"):
            ds[key]
    for keys in ([(0, 1.7)], [(0, 1), (1, 2, 3)], [(0, "3")]):
        with pytest.raises(TypeError, match="keys are \\(t, start\\) pairs of ints"):
            ds.__getitems__(keys)
    for key in ((-1, 0), (1 << 63, 0)):  # a sample counter is an int64 at or above 0 (a negative one read a
        # window and failed only in a transform's seeding; one past int64 passed here and failed in a batch)
        with pytest.raises((ValueError, TypeError), match=r"t, the sample counter, must be in|pairs of ints below"):
            ds[key]
        with pytest.raises((ValueError, TypeError), match=r"t, the sample counter, must be in|pairs of ints below"):
            ds.__getitems__([(0, 0), key])
    good = ds[(np.int64(3), np.int64(4))]
    assert (good["t"], good["start"]) == (3, 4) and type(good["start"]) is int
    assert torch.equal(ds.__getitems__(np.array([[3, 4]]))[0]["tokens"], good["tokens"])
    assert ds.__getitems__([]) == []
