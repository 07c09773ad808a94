"""Chunk files of a local root are written by ckpt itself (ckpt/chunk_files.py), not by tensorstore's pool: they
must hold exactly the bytes zarr3 prescribes, so that tensorstore (or any zarr3 reader) reads every array back,
whatever the chunking: aligned or not in memory, edge chunks padded, chunks cut across staging waves, and on a
filesystem without O_DIRECT."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tensorstore as ts
import torch

import ckpt
from ckpt import catalog, layout
from ckpt.chunk_files import ALIGN, DIRECT_MIN, PIECE, ChunkWriter
from ckpt.format import ArrayInfo
from ckpt.storage import open_storage
from step_paths import array_path, pack_path


@pytest.fixture
def fsyncs():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        # rows of 3000 bytes: chunks of 667 rows (2,001,000 bytes, O_DIRECT) start off the 4 KiB grid in the arena
        "emb": torch.randn(2000, 750, generator=g),
        # 4 MiB, a whole number of 4 KiB blocks per chunk
        "w": torch.randn(1024, 1024, generator=g),
        "odd": torch.randint(0, 255, (4099,), generator=g, dtype=torch.uint8),  # ends mid-block
        "i64": torch.arange(70_001, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "step": 7,
    }


def _zarr(path: str) -> np.ndarray:
    """An array read back through tensorstore's zarr3 driver, from its zarr.json and chunk files alone."""
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result().read().result()


@pytest.mark.parametrize("staging", [None, 1_000_000], ids=["one-wave", "waves"])
def test_tensorstore_reads_every_array_ckpt_wrote_itself(tmp_path, staging):
    state = _state()
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=2 << 20, pack_bytes=0, max_staging_bytes=staging) as m:
        m.save(1, state).wait()
    manifest = json.loads((tmp_path / layout.manifest_path(1)).read_text())["body"]
    chunked = {n: a["chunk"] for n, a in manifest["arrays"].items()}
    assert chunked["emb"] == [667, 750] and chunked["w"][0] < 1024  # several chunks, the last ones padded
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            got = _zarr(str(tmp_path / array_path(open_storage(str(tmp_path)), 1, name)))
            assert np.array_equal(got, tensor.numpy()), name
    restored = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(restored) == 1 and list(catalog.verify(m.storage, 1)) == []
    for name, tensor in state.items():
        assert torch.equal(restored[name], tensor) if isinstance(tensor, torch.Tensor) else restored[name] == tensor


def test_placed_tensors_are_read_back_through_tensorstore(tmp_path):
    state = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 3, dtype=torch.float16)}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
    pack = _zarr(str(tmp_path / pack_path(open_storage(str(tmp_path)), 1, layout.pack_name(0))))
    manifest = json.loads((tmp_path / layout.manifest_path(1)).read_text())["body"]
    for name, tensor in state.items():
        ((_, offset),) = manifest["arrays"][name]["places"]
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        assert np.array_equal(pack[offset : offset + raw.size], raw), name


@pytest.mark.parametrize("offset", [0, 1, 4096 - 3], ids=["aligned", "off-by-one", "unaligned"])
def test_direct_and_buffered_writes_give_the_same_file(tmp_path, offset, fsyncs):
    """The O_DIRECT path (aligned runs straight from memory or via the bounce buffer, the tail buffered) and the
    plain path of a filesystem without O_DIRECT write identical bytes, pieces fed across calls alike."""
    rows, cols = 3 * PIECE // 1000 + 7, 1000  # more than one write call per chunk, rows not a multiple of blocks
    info = ArrayInfo("x", "uint8", (rows, cols), (rows // 2 + 1, cols), (((0, rows), (0, cols)),))
    assert info.chunk_nbytes >= DIRECT_MIN and (info.chunk_nbytes) % ALIGN  # O_DIRECT, and a buffered tail
    data = np.frombuffer(np.random.default_rng(0).bytes(rows * cols + offset), np.uint8)[offset:].reshape(rows, cols)
    files = {}
    for direct in (True, False):
        out = tmp_path / f"direct={direct}"
        w = ChunkWriter(fsyncs)
        w.direct = direct and hasattr(os, "O_DIRECT")
        cut = rows // 3  # the first chunk arrives in two calls (staging waves)
        digests = w.write(str(out), info, (0, cut), data[:cut]) | w.write(str(out), info, (cut, rows), data[cut:])
        w.close()
        files[direct] = [(out / "c" / str(i) / "0").read_bytes() for i in range(2)]
        assert sorted(digests) == [0, 1]
    assert files[True] == files[False]
    first, second = files[True]
    assert len(first) == len(second) == info.chunk_nbytes + 4
    assert first[:-4] == data[: rows // 2 + 1].tobytes()
    assert second[: (rows - rows // 2 - 1) * cols] == data[rows // 2 + 1 :].tobytes()
    assert set(second[(rows - rows // 2 - 1) * cols : -4]) == {0}  # the edge chunk's padding


def test_a_failed_chunk_write_names_the_array_and_the_file(tmp_path, fsyncs):
    info = ArrayInfo("layers.0.weight", "uint8", (10,), (10,), (((0, 10),),))
    (tmp_path / "arr").write_text("a file where the array's directory should be")
    w = ChunkWriter(fsyncs)
    with pytest.raises(OSError, match=r"array 'layers.0.weight'.*arr/c/0"):
        w.write(str(tmp_path / "arr"), info, (0, 10), np.zeros(10, np.uint8))
    w.close()


def test_a_copied_chunk_file_is_byte_identical_and_a_trailer_that_disagrees_is_refused(tmp_path, fsyncs):
    """A persist copies a local tier's chunk files with `ChunkWriter.copy`: content and trailer come out as they
    went in (here from a file this writer made), and bytes whose crc32c is not their trailer are never written."""
    info = ArrayInfo("x", "uint8", (5000,), (5000,), (((0, 5000),),))
    data = np.frombuffer(np.random.default_rng(1).bytes(5000), np.uint8)
    w = ChunkWriter(fsyncs)
    w.write(str(tmp_path / "src"), info, (0, 5000), data)
    original = (tmp_path / "src" / "c" / "0").read_bytes()
    w.copy(str(tmp_path / "dst" / "c" / "0"), original)
    damaged = original[:100] + bytes([original[100] ^ 1]) + original[101:]
    with pytest.raises(OSError, match="changed while being copied"):
        w.copy(str(tmp_path / "bad" / "c" / "0"), damaged)
    w.close()
    assert (tmp_path / "dst" / "c" / "0").read_bytes() == original
