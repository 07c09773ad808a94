"""Every box a rank writes is placed in its pack (format ckpt/5): at most 4 data files per rank and step whatever the
number of tensors, bitwise round trips, tensorstore reads the pack, each box checked by its own digest (damage
names its key and file), a load of one tensor reads only its bytes, crafted places are refused."""

import hashlib
import json
import math
import os
import re
import uuid

import crc32c
import pytest
import tensorstore as ts
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import catalog
from ckpt.errors import CorruptCheckpointError
from ckpt.format import MAX_CHUNK_BYTES, PACK_FILES, numpy_dtype, pack_layout
from ckpt.storage import open_storage
from step_paths import data_dir
from step_paths import pack_path as step_pack_path


def _small(step: int) -> dict:
    """Many small tensors of mixed dtypes and shapes (0-d, empty, odd sizes), values depending on the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "f32": torch.randn(7, 3, generator=g),
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
        "bool": torch.rand(13, generator=g) > 0.5,
        "i8": torch.randint(-128, 127, (11,), generator=g, dtype=torch.int8),
        "i64": torch.randint(0, 1 << 40, (3, 1), generator=g),
        "u8": torch.randint(0, 255, (1, 1, 5), generator=g, dtype=torch.uint8),
        "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "zero_d": torch.tensor(float(step)),
        "zero_d_int": torch.tensor(step, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
        "layers": {f"{i}.bias": torch.randn(i + 1, generator=g) for i in range(40)},
        "n": step,
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _zeros(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    return None


def _manifest(root, step: int) -> dict:
    return json.loads((root / f"step_{step:08d}" / "manifest.json").read_bytes())["body"]


def _resign(root, step: int, mutate) -> None:
    path = root / f"step_{step:08d}" / "manifest.json"
    body = json.loads(path.read_bytes())["body"]
    mutate(body)
    text = json.dumps(body, separators=(",", ":"))
    path.write_text(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}))


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _placed_byte(root, step: int, name: str, skip: int = 0) -> tuple[str, int]:
    """The pack file holding byte `skip` of a placed tensor's (one) box, and that byte's offset in the file."""
    body = _manifest(root, step)
    pack, offset = body["arrays"][name]["places"][0]
    chunk = body["packs"][pack]["chunk"][0]
    return os.path.join(data_dir(root, step), "packs", pack, "c", str((offset + skip) // chunk)), (
        offset + skip
    ) % chunk


def _data_files(root, step: int) -> list[str]:
    """The chunk files of a step (its data: pack files and any array's chunks)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(data_dir(root, step)) for f in fs if f != "zarr.json"]


@pytest.mark.parametrize(
    "kw",
    [{}, {"chunk_bytes": 64}, {"max_staging_bytes": 64 << 10}],
    ids=["one_file", "four_files", "staged_in_waves"],
)
def test_every_tensor_round_trips_bitwise_from_at_most_four_files(tmp_path, kw):
    # big (1.4 MB) starts 4096-aligned and crosses files when they are small; mid (80 kB) is cut by rows when staged
    saved = {**_small(1), "mid": torch.randn(100, 200), "big": torch.randn(40, 9000)}
    with ckpt.CheckpointManager(tmp_path, **kw) as m:
        m.save(1, saved).wait()
    body = _manifest(tmp_path, 1)
    assert body["format"] == "ckpt/5"
    sizes = {n: math.prod(a["shape"]) * numpy_dtype(a["dtype"]).itemsize for n, a in body["arrays"].items()}
    assert {n for n, a in body["arrays"].items() if "places" in a} == {n for n, b in sizes.items() if b}
    assert body["arrays"]["big"]["places"][0][1] % 4096 == 0
    (pack,) = body["packs"]
    files = _data_files(tmp_path, 1)
    assert len(files) == (1 if not kw.get("chunk_bytes") else PACK_FILES), files
    assert all(os.path.getsize(f) == body["packs"][pack]["chunk"][0] for f in files)  # raw bytes, no trailer
    target = _zeros(saved)
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert _same(target, saved)
    assert _same(ckpt.load(tmp_path), saved)
    assert not list(catalog.verify(open_storage(str(tmp_path)), 1))
    # tensorstore reads the pack as a zarr3 array: each tensor's bytes are at its place
    where = os.path.join(str(tmp_path), step_pack_path(open_storage(str(tmp_path)), 1, pack))
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": where + "/"}}).result()
    data = array.read().result()
    for name in ("big", "mid", "f32"):
        at = body["arrays"][name]["places"][0][1]
        assert data[at : at + sizes[name]].tobytes() == _bits(saved[name]), name


def test_a_thousand_tensors_are_four_files(tmp_path):
    saved = {f"t{i}": torch.full((i % 50 + 1,), float(i)) for i in range(1000)}
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=4096) as m:
        m.save(1, saved).wait()
    assert len(_data_files(tmp_path, 1)) == PACK_FILES
    step_files = [f for _, _, fs in os.walk(tmp_path / "step_00000001") for f in fs]
    assert len(step_files) == PACK_FILES + 2  # the pack's files, its zarr.json, the manifest
    assert _same(ckpt.load(tmp_path), saved)


def test_pack_bytes_zero_keeps_an_array_per_tensor(tmp_path):
    saved = _small(1)
    with ckpt.CheckpointManager(tmp_path, pack_bytes=0) as m:
        m.save(1, saved).wait()
    body = _manifest(tmp_path, 1)
    assert body["packs"] == {} and not any("places" in a for a in body["arrays"].values())
    assert _same(ckpt.load(tmp_path), saved)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 3 << 20), min_size=1, max_size=30), chunk=st.sampled_from([64, 4096, 1 << 20]))
def test_pack_layout_keeps_boxes_apart_in_at_most_four_equal_files(sizes, chunk):
    offsets, total, size = pack_layout(sizes, chunk)
    ends = [o + n for o, n in zip(offsets, sizes)]
    assert all(a >= b for a, b in zip(offsets[1:], ends)) and total == ends[-1]
    assert all(o % 4096 == 0 for o, n in zip(offsets, sizes) if n >= 1 << 20)
    files = -(-total // size)
    assert files <= PACK_FILES and size <= max(MAX_CHUNK_BYTES, 1) and size <= total
    assert files * size - total < files * 4096 or files == 1


@pytest.mark.parametrize("where", ["local", "memory"])
def test_damaged_placed_tensor_is_named_and_restore_falls_back(tmp_path, where):
    root = str(tmp_path) if where == "local" else f"memory://{uuid.uuid4().hex}"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, _small(1)).wait()
        m.save(2, _small(2)).wait()
    storage = open_storage(root)
    body = json.loads(storage.read("step_00000002/manifest.json"))["body"]
    pack, offset = body["arrays"]["layers/7.bias"]["places"][0]
    chunk = f"{step_pack_path(storage, 2, pack)}/c/{offset // body['packs'][pack]['chunk'][0]}"
    data = bytearray(storage.read(chunk))
    data[offset % body["packs"][pack]["chunk"][0] + 5] ^= 0x10
    storage.write_atomic(chunk, bytes(data))
    path = storage.local_path(chunk) or f"{storage.url}{chunk}"
    problems = list(catalog.verify(storage, 2))
    assert [(p.key, p.file) for p in problems] == [("layers/7.bias", path)], problems
    restore_falls_back_from_damaged_layers_7(root, path)


def restore_falls_back_from_damaged_layers_7(root, path: str) -> None:
    """Step 2's layers/7.bias is damaged in `path`: its restore fails naming both and changes nothing, a restore of
    the newest intact step warns and takes step 1."""
    target = _zeros(_small(0))
    before = {k: _bits(v) for k, v in target["layers"].items()}
    with ckpt.CheckpointManager(root) as m:
        with pytest.raises(CorruptCheckpointError, match="placed tensor checksum") as info:
            m.restore(target, step=2)
        assert info.value.key == "layers/7.bias" and info.value.file == path
        assert {k: _bits(v) for k, v in target["layers"].items()} == before  # all or nothing
        with pytest.warns(RuntimeWarning, match=r"step 2 is damaged.*key=layers/7.bias"):
            assert m.restore(target) == 1
    assert _same(target, _small(1))


def test_load_of_one_tensor_reads_only_its_bytes(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _small(1)).wait()
    path, at = _placed_byte(tmp_path, 1, "layers/3.bias")
    beside, _ = _placed_byte(tmp_path, 1, "layers/4.bias")
    assert beside == path  # the same file
    _flip(path, at)
    got = ckpt.load(tmp_path, step=1, keys=["layers.4.bias"])  # damage beside it is not read, not reported
    assert _same(got["layers"]["4.bias"], _small(1)["layers"]["4.bias"])
    with pytest.raises(CorruptCheckpointError, match="placed tensor checksum") as info:
        ckpt.load(tmp_path, step=1, keys=["layers.3.bias"])
    assert info.value.key == "layers/3.bias" and info.value.file == path


def _disk_bytes_read() -> int:
    """Bytes this process has had read from a block device (/proc/self/io: read-ahead it caused included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split(":")[1]) for line in f if line.startswith("read_bytes:"))


def _evict(path: str) -> None:
    """Drop a (synced) file's pages from the page cache, so that the next read of it goes to the disk (no root)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's per-process IO counters")
def test_load_of_one_tensor_reads_no_more_of_the_disk_than_its_bytes(tmp_path):
    """A tensor packed before others ends inside its pack file: the kernel's read-ahead must not pull the rest
    (up to read_ahead_kb: 8 MiB on some machines, more on network file systems) from the disk."""
    state = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(4 << 20)}  # 4 MiB, then 16 MiB
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
    path, at = _placed_byte(tmp_path, 1, "a")
    assert _placed_byte(tmp_path, 1, "b")[0] == path and os.path.getsize(path) > at + (8 << 20)
    _evict(path)
    before = _disk_bytes_read()
    with open(path, "rb") as f:
        f.read(1 << 20)
    if _disk_bytes_read() == before:
        pytest.skip("this file system does not read through a block device (tmpfs?): read_bytes stays 0")
    _evict(path)
    before = _disk_bytes_read()
    got = ckpt.load(tmp_path, step=1, keys=["a"])
    read = _disk_bytes_read() - before
    assert torch.equal(got["a"], state["a"])
    assert read <= (4 << 20) + (64 << 10), f"read {read} bytes from the disk for a 4 MiB tensor"


def test_region_of_a_placed_tensor_is_checked_whole(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _small(1)).wait()
    region = ckpt.load(tmp_path, step=1, keys=["bf16"], region=(slice(1, 3),))
    assert _same(region["bf16"], _small(1)["bf16"][1:3])
    path, at = _placed_byte(tmp_path, 1, "bf16", skip=80)  # in its last row, outside the region read
    _flip(path, at)
    with pytest.raises(CorruptCheckpointError, match="placed tensor checksum") as info:
        ckpt.load(tmp_path, step=1, keys=["bf16"], region=(slice(1, 3),))
    assert info.value.key == "bf16" and info.value.file == path


def test_a_short_pack_file_is_damage_for_verify_and_restore(tmp_path):
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=64) as m:
        m.save(1, _small(1)).wait()
    last = sorted(_data_files(tmp_path, 1))[-1]
    os.truncate(last, os.path.getsize(last) - 1)
    problems = list(catalog.verify(open_storage(str(tmp_path)), 1))
    assert problems and all(p.file == last for p in problems), problems
    with pytest.raises(CorruptCheckpointError, match="bytes, expected") as info:
        ckpt.load(tmp_path, step=1)
    assert info.value.file == last


@pytest.mark.parametrize("craft", ["outside_the_pack", "unknown_pack", "one_place_short", "absolute_name", "overlap"])
def test_crafted_places_are_damage(tmp_path, craft):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _small(1)).wait()
    body = _manifest(tmp_path, 1)
    offset3 = body["arrays"]["layers/3.bias"]["places"][0][1]
    data = open(_placed_byte(tmp_path, 1, "layers/3.bias")[0], "rb").read()

    def mutate(body):
        entry = body["arrays"]["f64"]  # 32 bytes
        pack = body["packs"][entry["places"][0][0]]
        if craft == "outside_the_pack":
            entry["places"][0][1] = pack["shape"][0] - 4
        elif craft == "unknown_pack":
            entry["places"][0][0] = "rank_00009"
        elif craft == "one_place_short":
            entry["places"] = []
        elif craft == "absolute_name":
            entry["places"][0][0] = "/etc/passwd"
        else:  # layers/4.bias (20 bytes) inside layers/3.bias's 16, with a digest that fits the bytes it names
            entry = body["arrays"]["layers/4.bias"]
            entry["places"][0][1] = offset3 + 8
            entry["digests"] = [crc32c.crc32c(data[offset3 + 8 : offset3 + 28])]

    _resign(tmp_path, 1, mutate)
    with pytest.raises(CorruptCheckpointError, match="malformed|unsafe|invalid") as info:
        ckpt.load(tmp_path, step=1)
    assert info.value.key == ("layers/4.bias" if craft == "overlap" else "f64")
    if craft == "overlap":
        assert re.search("placed tensors 'layers/3.bias' .box 0. and 'layers/4.bias' .box 0. overlap", str(info.value))
    assert list(catalog.verify(open_storage(str(tmp_path)), 1))


def test_sharded_boxes_round_trip_at_another_world_size(tmp_path):
    """Boxes of one array placed apart (as ranks write them) are read into whole tensors and into other boxes: the
    single-process view of a row-sharded save, crafted from one of a whole tensor."""
    saved = {"w": torch.arange(60, dtype=torch.float32).reshape(10, 6)}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, saved).wait()
    pack_file, _ = _placed_byte(tmp_path, 1, "w")
    raw = _bits(saved["w"])

    def split(body):  # rows [0, 4) and [4, 10) as two boxes, placed in reverse order in the pack
        entry = body["arrays"]["w"]
        entry["boxes"] = [[[0, 4], [0, 6]], [[4, 10], [0, 6]]]
        entry["places"] = [[entry["places"][0][0], 144], [entry["places"][0][0], 0]]
        entry["digests"] = [crc32c.crc32c(raw[:96]), crc32c.crc32c(raw[96:])]

    with open(pack_file, "r+b") as f:  # 240 bytes: rows 4.. first, then rows ..4
        f.write(raw[96:] + raw[:96])
    _resign(tmp_path, 1, split)
    assert _same(ckpt.load(tmp_path), saved)
    region = ckpt.load(tmp_path, step=1, keys=["w"], region=(slice(2, 7),))  # across both boxes
    assert torch.equal(region["w"], saved["w"][2:7])
    target = {"w": torch.zeros(10, 6)}
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert torch.equal(target["w"], saved["w"])
