"""Steps of the formats before ckpt/5 are still read, checked and refused when crafted: ckpt/4 and ckpt/3 (small
tensors packed whole into one chunk each of a pack, chunk files with a crc32c trailer) from steps that ckpt/4's
writer wrote (tests/data), ckpt/2 (an array per tensor)."""

import json
import math
import os
import re
import shutil
from pathlib import Path

import crc32c
import pytest

import ckpt
from ckpt import catalog
from ckpt.errors import CorruptCheckpointError
from ckpt.format import numpy_dtype
from ckpt.storage import open_storage
from step_paths import data_dir, to_old_layout
from test_ckpt_packed import _flip, _manifest, _resign, _same, _small, _zeros, restore_falls_back_from_damaged_layers_7

DATA = Path(__file__).parent / "data"


def _old_root(tmp_path, name: str = "ckpt4_packed") -> Path:
    """A copy of a root that ckpt/4 wrote: steps 1 and 2 of `_small` (`ckpt4_packed_64`: step 1, 64-byte chunks)."""
    root = tmp_path / name
    shutil.copytree(DATA / name, root)
    return root


def _packed_byte(root, step: int, name: str) -> tuple[str, int]:
    """The pack chunk file holding a packed tensor, and the offset of its first byte in that file."""
    body = _manifest(root, step)
    pack, offset = body["arrays"][name]["pack"]
    chunk = body["packs"][pack]["chunk"][0]
    return os.path.join(data_dir(root, step), "packs", pack, "c", str(offset // chunk)), offset % chunk


@pytest.mark.parametrize("name", ["ckpt4_packed", "ckpt4_packed_64"])
def test_format_4_steps_are_still_read(tmp_path, name):
    root = _old_root(tmp_path, name)
    body = _manifest(root, 1)
    assert body["format"] == "ckpt/4" and any("pack" in a for a in body["arrays"].values())
    assert not list(catalog.verify(open_storage(str(root)), 1))
    assert _same(ckpt.load(root, step=1), _small(1))
    got = ckpt.load(root, step=1, keys=["layers.3.bias", "bf16"])
    assert _same(got["layers"]["3.bias"], _small(1)["layers"]["3.bias"]) and _same(got["bf16"], _small(1)["bf16"])
    region = ckpt.load(root, step=1, keys=["bf16"], region=(slice(1, 3),))
    assert _same(region["bf16"], _small(1)["bf16"][1:3])
    target = _zeros(_small(0))
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(target, step=1) == 1
        assert _same(target, _small(1))
        m.save(3, _small(3)).wait()  # a new step beside them is written in today's format
    assert _manifest(root, 3)["format"] == "ckpt/5" and _same(ckpt.load(root), _small(3))


def test_format_3_steps_are_still_read(tmp_path):
    """ckpt/3 kept a step's arrays and packs in its step directory itself, and its manifest names no data directory."""
    root = _old_root(tmp_path)

    def downgrade(body):
        assert body["packs"] and body.pop("data")
        body["format"] = "ckpt/3"

    to_old_layout(root, 1)
    _resign(root, 1, downgrade)
    assert not list(catalog.verify(open_storage(str(root)), 1))
    assert _same(ckpt.load(root, step=1), _small(1))
    target = _zeros(_small(0))
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(target, step=1) == 1
    assert _same(target, _small(1))


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


def test_damaged_packed_tensor_is_named_and_restore_falls_back(tmp_path):
    root = _old_root(tmp_path)
    path, at = _packed_byte(root, 2, "layers/7.bias")
    _flip(path, at + 5)
    problems = list(catalog.verify(open_storage(str(root)), 2))
    assert ("layers/7.bias", path) in [(p.key, p.file) for p in problems], problems
    restore_falls_back_from_damaged_layers_7(root, path)


@pytest.mark.parametrize("craft", ["outside_the_pack", "across_chunks", "unknown_pack", "in_format_2"])
def test_crafted_pack_entries_are_damage(tmp_path, craft):
    root = _old_root(tmp_path, "ckpt4_packed_64")

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

    _resign(root, 1, mutate)
    with pytest.raises(CorruptCheckpointError, match="malformed") as info:
        ckpt.load(root, step=1)
    assert info.value.key == ("f16" if craft == "in_format_2" else "f64")  # in_format_2: the first packed one


def test_forged_packed_bytes_are_found_by_verify(tmp_path):
    """Bytes edited and the manifest re-signed with their digest: the pack chunk's own crc32c trailer (or, recomputed,
    the manifest's digest of the chunk) still tells; verify reads every pack chunk whole."""
    root = _old_root(tmp_path)
    path, at = _packed_byte(root, 2, "layers/7.bias")
    data = bytearray(open(path, "rb").read())
    n = _manifest(root, 2)["arrays"]["layers/7.bias"]
    nbytes = math.prod(n["shape"]) * numpy_dtype(n["dtype"]).itemsize
    data[at] ^= 0x10
    with open(path, "wb") as f:
        f.write(data)
    digest = crc32c.crc32c(bytes(data[at : at + nbytes]))
    _resign(root, 2, lambda body: body["arrays"]["layers/7.bias"].__setitem__("digests", [digest]))
    pack = n["pack"][0]
    problems = list(catalog.verify(open_storage(str(root)), 2))
    assert [(p.key, p.file) for p in problems] == [(pack, path)], problems
    assert "checksum (crc32c) mismatch" in str(problems[0])


def test_overlapping_packed_tensors_are_refused_by_every_reader(tmp_path):
    root = _old_root(tmp_path)
    body = _manifest(root, 2)
    pack, offset = body["arrays"]["layers/3.bias"]["pack"]

    def overlap(body):  # layers/4.bias (20 bytes) starts inside layers/3.bias's 16, a digest that fits its bytes
        entry = body["arrays"]["layers/4.bias"]
        entry["pack"][1] = offset + 8
        data = open(_packed_byte(root, 2, "layers/3.bias")[0], "rb").read()
        start = (offset + 8) % body["packs"][pack]["chunk"][0]
        entry["digests"] = [crc32c.crc32c(data[start : start + 20])]

    _resign(root, 2, overlap)
    match = rf"placed tensors 'layers/3.bias' \(box 0\) and 'layers/4.bias' \(box 0\) overlap in pack '{pack}'"
    problems = list(catalog.verify(open_storage(str(root)), 2))
    assert len(problems) == 1 and re.search(match, str(problems[0])), problems
    with pytest.raises(CorruptCheckpointError, match=match):
        ckpt.load(root, step=2)
    with pytest.warns(RuntimeWarning, match=f"step 2 is damaged.*{match}"):
        assert _same(ckpt.load(root), _small(1))


def test_fixtures_are_the_steps_ckpt4_wrote():
    """The committed roots are ckpt/4's, unchanged: their manifests' own checksums hold."""
    for name in ("ckpt4_packed", "ckpt4_packed_64"):
        for step in sorted((DATA / name).glob("step_*/manifest.json")):
            outer = json.loads(step.read_bytes())
            assert outer["body"]["format"] == "ckpt/4"
