"""Small tensors are packed into one byte array per rank (format ckpt/3): bitwise round trips of every dtype and
shape, a few files per step, each packed tensor checked by its own digest (damage names its key), a load of one
reads only its bytes, and steps of the formats before are still read."""

import hashlib
import json
import math
import os
import re
import uuid

import crc32c
import pytest
import torch

import ckpt
from ckpt import catalog
from ckpt.errors import CorruptCheckpointError
from ckpt.format import numpy_dtype
from ckpt.storage import open_storage
from step_paths import data_dir, to_old_layout
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


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _packed_byte(root, step: int, name: str) -> tuple[str, int]:
    """The pack chunk file holding a packed tensor, and the offset of its first byte in that file."""
    body = _manifest(root, step)
    pack, offset = body["arrays"][name]["pack"]
    chunk = body["packs"][pack]["chunk"][0]
    return os.path.join(data_dir(root, step), "packs", pack, "c", str(offset // chunk)), offset % chunk


@pytest.mark.parametrize(
    "kw",
    [{}, {"chunk_bytes": 64}, {"max_staging_bytes": 64 << 10}],
    ids=["one_chunk", "many_chunks", "staged_in_waves"],
)
def test_many_small_tensors_round_trip_bitwise_in_a_few_files(tmp_path, kw):
    # big (1.4 MB) is an array of its own; mid (80 kB) is packed, and cut by rows when staged in waves of 64 kB
    saved = {**_small(1), "mid": torch.randn(100, 200)}
    if "chunk_bytes" not in kw:
        saved["big"] = torch.randn(40, 9000)
    with ckpt.CheckpointManager(tmp_path, **kw) as m:
        m.save(1, saved).wait()
    body = _manifest(tmp_path, 1)
    assert body["format"] == "ckpt/4"
    limit = min(kw.get("chunk_bytes", 1 << 20), 1 << 20)
    sizes = {n: math.prod(a["shape"]) * numpy_dtype(a["dtype"]).itemsize for n, a in body["arrays"].items()}
    assert {n for n, a in body["arrays"].items() if "pack" in a} == {n for n, b in sizes.items() if 0 < b <= limit}
    assert len(body["packs"]) == 1 and "empty" in sizes
    files = [f for _, _, fs in os.walk(tmp_path / "step_00000001") for f in fs]
    if not kw:  # manifest, the pack (zarr.json + one chunk), big (zarr.json + one chunk), empty (zarr.json)
        assert len(files) == 6, files
    target = _zeros(saved)
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert _same(target, saved)
    assert _same(ckpt.load(tmp_path), saved)
    assert not list(catalog.verify(open_storage(str(tmp_path)), 1))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_damaged_packed_tensor_is_named_and_restore_falls_back(tmp_path, where):
    root = str(tmp_path) if where == "local" else f"memory://{uuid.uuid4().hex}"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, _small(1)).wait()
        m.save(2, _small(2)).wait()
    storage = open_storage(root)
    body = json.loads(storage.read("step_00000002/manifest.json"))["body"]
    pack, offset = body["arrays"]["layers/7.bias"]["pack"]
    chunk = f"{step_pack_path(storage, 2, pack)}/c/{offset // body['packs'][pack]['chunk'][0]}"
    data = bytearray(storage.read(chunk))
    data[offset % body["packs"][pack]["chunk"][0] + 5] ^= 0x10
    storage.write_atomic(chunk, bytes(data))
    path = storage.local_path(chunk) or f"{storage.url}{chunk}"
    problems = list(catalog.verify(storage, 2))
    assert problems[0].key == "layers/7.bias" and problems[0].file == path, problems
    target = _zeros(_small(0))
    before = {k: _bits(v) for k, v in target["layers"].items()}
    with ckpt.CheckpointManager(root) as m:
        with pytest.raises(CorruptCheckpointError, match="packed tensor checksum") as info:
            m.restore(target, step=2)
        assert info.value.key == "layers/7.bias" and info.value.file == path
        assert {k: _bits(v) for k, v in target["layers"].items()} == before  # all or nothing
        with pytest.warns(RuntimeWarning, match=r"step 2 is damaged.*key=layers/7.bias"):
            assert m.restore(target) == 1
    assert _same(target, _small(1))


def test_load_of_one_packed_tensor_reads_only_its_pack_chunk(tmp_path):
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=64) as m:  # a pack of many chunks
        m.save(1, _small(1)).wait()
    body = _manifest(tmp_path, 1)
    path, at = _packed_byte(tmp_path, 1, "layers/3.bias")
    chunks = {n: _packed_byte(tmp_path, 1, n)[0] for n, a in body["arrays"].items() if "pack" in a}
    beside = [n for n, c in chunks.items() if c == path and n != "layers/3.bias"]
    elsewhere = [n for n, c in chunks.items() if c != path and n.startswith("layers/")]
    assert beside and elsewhere, chunks
    _flip(path, at)
    other = elsewhere[0]  # damage in another chunk of the pack: not read, not reported
    got = ckpt.load(tmp_path, step=1, keys=[other.replace("/", ".")])
    assert _same(got["layers"][other.split("/")[1]], _small(1)["layers"][other.split("/")[1]])
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(tmp_path, step=1, keys=["layers.3.bias"])
    assert info.value.key == "layers/3.bias" and info.value.file == path
    # beside it in the same chunk: its own digest holds, but the chunk it is read from does not
    with pytest.raises(CorruptCheckpointError, match="pack chunk checksum .crc32c. mismatch") as info:
        ckpt.load(tmp_path, step=1, keys=[beside[0].replace("/", ".")])
    assert info.value.key == body["arrays"][beside[0]]["pack"][0] and info.value.file == path
    assert beside[0] in str(info.value)


def test_region_of_a_packed_tensor_is_read_from_its_checked_chunk(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _small(1)).wait()
    region = ckpt.load(tmp_path, step=1, keys=["bf16"], region=(slice(1, 3),))
    assert _same(region["bf16"], _small(1)["bf16"][1:3])
    path, at = _packed_byte(tmp_path, 1, "layers/3.bias")
    _flip(path, at)
    with pytest.raises(CorruptCheckpointError, match="pack chunk checksum") as info:
        ckpt.load(tmp_path, step=1, keys=["bf16"], region=(slice(1, 3),))
    assert info.value.file == path


def _resign(root, step: int, mutate) -> None:
    path = root / f"step_{step:08d}" / "manifest.json"
    body = json.loads(path.read_bytes())["body"]
    mutate(body)
    text = json.dumps(body, separators=(",", ":"))
    path.write_text(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}))


def test_format_2_steps_are_still_read(tmp_path):
    with ckpt.CheckpointManager(tmp_path, pack_bytes=0) as m:  # one array per tensor, as ckpt/2 wrote
        m.save(1, _small(1)).wait()

    def downgrade(body):
        assert body.pop("packs") == {}
        del body["data"]
        body["format"] = "ckpt/2"

    to_old_layout(tmp_path, 1)
    _resign(tmp_path, 1, downgrade)
    assert not list(catalog.verify(open_storage(str(tmp_path)), 1))
    assert _same(ckpt.load(tmp_path), _small(1))


def test_format_3_steps_are_still_read(tmp_path):
    """ckpt/3 kept a step's arrays and packs in its step directory itself, and its manifest names no data directory."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _small(1)).wait()

    def downgrade(body):
        assert body["packs"] and body.pop("data")
        body["format"] = "ckpt/3"

    to_old_layout(tmp_path, 1)
    _resign(tmp_path, 1, downgrade)
    assert not list(catalog.verify(open_storage(str(tmp_path)), 1))
    assert _same(ckpt.load(tmp_path), _small(1))
    target = _zeros(_small(0))
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert _same(target, _small(1))


@pytest.mark.parametrize("craft", ["outside_the_pack", "across_chunks", "unknown_pack", "in_format_2"])
def test_crafted_pack_entries_are_damage(tmp_path, craft):
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=64) as m:
        m.save(1, _small(1)).wait()

    def mutate(body):
        entry = body["arrays"]["f64"]  # 32 bytes
        pack = body["packs"][entry["pack"][0]]
        if craft == "outside_the_pack":
            entry["pack"][1] = pack["shape"][0] - 4
        elif craft == "across_chunks":
            entry["pack"][1] = 60  # 32 bytes from 60 cross the chunk boundary at 64
        elif craft == "unknown_pack":
            entry["pack"][0] = "rank_00009"
        else:
            body["format"] = "ckpt/2"
            del body["packs"]

    _resign(tmp_path, 1, mutate)
    with pytest.raises(CorruptCheckpointError, match="malformed") as info:
        ckpt.load(tmp_path, step=1)
    assert info.value.key == ("f16" if craft == "in_format_2" else "f64")  # in_format_2: the first packed one


def _forge_packed(root, step: int, name: str, trailer: bool) -> str:
    """Edit a packed tensor's bytes and re-sign the manifest with their new digest, as `verify` would still see:
    with `trailer`, the chunk file's crc32c is recomputed too (only the manifest's digest of the chunk is then
    stale). Returns the pack chunk file."""
    path, at = _packed_byte(root, step, name)
    data = bytearray(open(path, "rb").read())
    n = _manifest(root, step)["arrays"][name]
    nbytes = math.prod(n["shape"]) * numpy_dtype(n["dtype"]).itemsize
    data[at] ^= 0x10
    if trailer:
        data[-4:] = crc32c.crc32c(bytes(data[:-4])).to_bytes(4, "little")
    with open(path, "wb") as f:
        f.write(data)
    digest = crc32c.crc32c(bytes(data[at : at + nbytes]))
    _resign(root, step, lambda body: body["arrays"][name].__setitem__("digests", [digest]))
    return path


@pytest.mark.parametrize("trailer", [False, True], ids=["stale_trailer", "forged_trailer"])
def test_forged_packed_bytes_are_damage_on_every_read(tmp_path, trailer):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _small(1)).wait()
        m.save(2, _small(2)).wait()
    path = _forge_packed(tmp_path, 2, "layers/7.bias", trailer)
    pack = _manifest(tmp_path, 2)["arrays"]["layers/7.bias"]["pack"][0]
    what = "digest" if trailer else r"checksum \(crc32c\)"
    problems = list(catalog.verify(open_storage(str(tmp_path)), 2))
    assert [(p.key, p.file) for p in problems] == [(pack, path)], problems
    with pytest.raises(CorruptCheckpointError, match=f"pack chunk {what} mismatch") as info:
        ckpt.load(tmp_path, step=2)
    assert info.value.key == pack and info.value.file == path
    with pytest.raises(CorruptCheckpointError, match=f"pack chunk {what} mismatch.*layers/7.bias"):
        ckpt.load(tmp_path, step=2, keys=["layers.7.bias"])
    with pytest.warns(RuntimeWarning, match=f"step 2 is damaged: pack chunk {what} mismatch.*key={pack}, file={path}"):
        assert _same(ckpt.load(tmp_path), _small(1))
    target = _zeros(_small(0))
    before = {k: _bits(v) for k, v in target["layers"].items()}
    with ckpt.CheckpointManager(tmp_path) as m:
        with pytest.raises(CorruptCheckpointError, match=f"pack chunk {what} mismatch"):
            m.restore(target, step=2)
        assert {k: _bits(v) for k, v in target["layers"].items()} == before  # all or nothing
        with pytest.warns(RuntimeWarning, match=f"step 2 is damaged: pack chunk {what} mismatch.*file={path}"):
            assert m.restore(target) == 1
    assert _same(target, _small(1))


def test_overlapping_packed_tensors_are_refused_by_every_reader(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _small(1)).wait()
        m.save(2, _small(2)).wait()
    body = _manifest(tmp_path, 2)
    pack, offset = body["arrays"]["layers/3.bias"]["pack"]

    def overlap(body):  # layers/4.bias (20 bytes) starts inside layers/3.bias's 16, a digest that fits its bytes
        entry = body["arrays"]["layers/4.bias"]
        entry["pack"][1] = offset + 8
        data = open(_packed_byte(tmp_path, 2, "layers/3.bias")[0], "rb").read()
        start = (offset + 8) % body["packs"][pack]["chunk"][0]
        entry["digests"] = [crc32c.crc32c(data[start : start + 20])]

    _resign(tmp_path, 2, overlap)
    match = f"packed tensors 'layers/3.bias' and 'layers/4.bias' overlap in pack '{pack}'"
    problems = list(catalog.verify(open_storage(str(tmp_path)), 2))
    assert len(problems) == 1 and re.search(match, str(problems[0])), problems
    with pytest.raises(CorruptCheckpointError, match=match):
        ckpt.load(tmp_path, step=2)
    with pytest.warns(RuntimeWarning, match=f"step 2 is damaged.*{match}"):
        assert _same(ckpt.load(tmp_path), _small(1))
    target = _zeros(_small(0))
    with ckpt.CheckpointManager(tmp_path) as m:
        with pytest.raises(CorruptCheckpointError, match=match):
            m.restore(target, step=2)
        with pytest.warns(RuntimeWarning, match=f"step 2 is damaged.*{match}"):
            assert m.restore(target) == 1
    assert _same(target, _small(1))
