"""The manifest vouches for every byte of its step; a failed restore changes nothing; damage is named,
skipped and set aside; a step that vanishes under a reader is not damage; types and keys keep their promises."""

import collections
import functools
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import ckpt
from ckpt import catalog, layout
from ckpt.errors import CorruptCheckpointError
from ckpt.storage import open_storage
from step_paths import array_path, data_dir, to_old_layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))


def _state(step: int) -> dict:
    """Several arrays of fixed shapes whose values depend on the step, and a JSON leaf."""
    g = torch.Generator().manual_seed(step)
    return {
        "a": torch.randn(64, 32, generator=g),
        "b": torch.randn(64, 32, generator=g),
        "c": torch.randn(64, 32, generator=g),
        "n": step,
    }


# Most tests here damage the files of one array: their tensors are small, so they are saved one array each
# (UNPACKED); packed tensors have the same checks in test_ckpt_packed.py.
UNPACKED = {"pack_bytes": 0}


def _save(root, steps, state=_state, **kw) -> None:
    with ckpt.CheckpointManager(root, **{**UNPACKED, **kw}) as m:
        for s in steps:
            m.save(s, state(s))


def _step(root, step) -> str:
    return os.path.join(str(root), f"step_{step:08d}")


def _data(step_dir: str) -> str:
    """A committed step's data directory, from its step directory."""
    root, name = os.path.split(step_dir)
    return data_dir(root, layout.parse_step_dir(name))


def _flip(path: str, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _target() -> dict:
    return {"a": torch.full((64, 32), 9.0), "b": torch.full((64, 32), 9.0), "c": torch.full((64, 32), 9.0), "n": -1}


def _resign(root, step: int, mutate) -> None:
    """Rewrite a step's manifest through `mutate(body)` with a valid sha256 (a crafted, well-signed manifest)."""
    path = os.path.join(_step(root, step), "manifest.json")
    body = json.loads(open(path, "rb").read())["body"]
    body = mutate(body) or body
    text = json.dumps(body, separators=(",", ":"))
    with open(path, "w") as f:
        f.write(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}, separators=(",", ":")))


def _damaged_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "damaged" in str(w.message)]


# -- 1. all or nothing ------------------------------------------------------------------------------


def test_failed_restore_leaves_every_target_bitwise_unchanged(tmp_path):
    _save(tmp_path, [1, 2])
    _flip(os.path.join(data_dir(tmp_path, 2), "arrays", "b", "c", "0", "0"), 4000)  # the second of three arrays
    model = torch.nn.Linear(4, 3)
    with ckpt.CheckpointManager(tmp_path / "m") as m:
        m.save(1, {"model": model}).wait()
    target = _target()
    before = {k: _bits(v) for k, v in target.items() if isinstance(v, torch.Tensor)}
    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(CorruptCheckpointError, match="key=b"):
        m.restore(target, step=2)
    assert {k: _bits(v) for k, v in target.items() if isinstance(v, torch.Tensor)} == before and target["n"] == -1
    # falling back applies the previous step whole
    with pytest.warns(RuntimeWarning, match="step 2 is damaged"), ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert all(torch.equal(target[k], _state(1)[k]) for k in "abc") and target["n"] == 1


def test_failed_restore_leaves_a_module_unchanged(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    with ckpt.CheckpointManager(tmp_path, **UNPACKED) as m:
        m.save(1, {"model": model}).wait()
    _flip(os.path.join(data_dir(tmp_path, 1), "arrays", "model", "1.weight", "c", "0", "0"), 60)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    before = {k: _bits(v) for k, v in fresh.state_dict().items()}
    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(CorruptCheckpointError, match="1.weight"):
        m.restore({"model": fresh}, step=1)
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == before


def test_restore_is_planned_then_executed_then_applied(tmp_path):
    """The mechanism mirrors a save: the plan reads nothing, executing it reads and verifies without touching the
    caller's tensors read through scratch (a strided one here), and only `apply` lands the values."""
    from concurrent.futures import ThreadPoolExecutor

    from ckpt import layout, restore
    from ckpt.distributed import Ranks
    from ckpt.staging import StagingArena

    saved = {"w": torch.randn(4, 5), "n": 3}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, saved).wait()
    storage, target = open_storage(str(tmp_path)), {"w": torch.zeros(5, 4).t(), "n": 0}
    w = target["w"]
    plan = restore.plan_restore(
        layout.read_manifest(storage, 1), target, None, Ranks.local(), files=restore.step_files(storage, 1)
    )
    assert [name for name, _ in plan.reads] == ["w"] and all(r.buffer is None for r in plan.reads.values())
    with ThreadPoolExecutor(2) as pool:
        restore.execute(storage, plan, pool, StagingArena(None))
    assert torch.equal(w, torch.zeros(4, 5)) and target["n"] == 0  # read and verified, not applied
    restore.apply(plan, target)
    assert target["w"] is w and torch.equal(w, saved["w"]) and target["n"] == 3


def test_a_tensor_read_into_directly_gets_its_bytes_back_when_the_step_fails(tmp_path):
    """A plain contiguous CPU tensor (too big to be packed) is read straight into, its old bytes set aside first:
    `undo` (a step that failed here or on another rank) gives them back bitwise, and a tied pair is read via scratch."""
    from concurrent.futures import ThreadPoolExecutor

    from ckpt import layout, restore
    from ckpt.distributed import Ranks
    from ckpt.staging import StagingArena

    saved = {"w": torch.randn(512, 300), "v": torch.randn(512, 300)}
    with ckpt.CheckpointManager(tmp_path, **UNPACKED) as m:
        m.save(1, saved).wait()
    storage = open_storage(str(tmp_path))
    for tied in (False, True):
        w = torch.full((512, 300), 7.0)
        target = {"w": w, "v": w if tied else torch.zeros(512, 300)}
        plan = restore.plan_restore(layout.read_manifest(storage, 1), target, None, Ranks.local())
        with ThreadPoolExecutor(2) as pool:
            restore.execute(storage, plan, pool, StagingArena(None))
        direct = [name for (name, _), r in plan.reads.items() if r.saved is not None]
        assert direct == ([] if tied else ["w", "v"])
        assert torch.equal(w, torch.full((512, 300), 7.0) if tied else saved["w"])
        plan.undo()
        assert _bits(w) == _bits(torch.full((512, 300), 7.0)), tied


# -- 2. the manifest vouches for every chunk ---------------------------------------------------------


def _wide_state(step: int) -> dict:
    """Arrays chunked along their second dimension (chunk_bytes=4096): not readable by whole rows."""
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(1, 3000, generator=g), "b": torch.randn(1, 3000, generator=g), "n": step}


@pytest.mark.parametrize("layout", ["rows", "wide", "memory"])
def test_chunk_copied_from_another_step_is_detected(tmp_path, layout):
    root = f"memory://{uuid.uuid4().hex}" if layout == "memory" else str(tmp_path)
    state, kw = (_wide_state, {"chunk_bytes": 4096}) if layout == "wide" else (_state, {})
    _save(root, [1, 2], state, **kw)
    chunk = "c/0/1" if layout == "wide" else "c/0/0"
    storage = open_storage(root)
    two, one = (f"{array_path(storage, s, 'b')}/{chunk}" for s in (2, 1))
    storage.write_atomic(two, storage.read(one))
    where = storage.local_path(two) or f"{storage.url}{two}"
    problems = list(catalog.verify(storage, 2))
    assert len(problems) == 1 and problems[0].key == "b" and problems[0].file == where, problems
    assert not list(catalog.verify(storage, 1))
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state(0).items()}
    with ckpt.CheckpointManager(root) as m:
        with pytest.raises(CorruptCheckpointError, match="digest") as info:
            m.restore(target, step=2)
        assert info.value.key == "b" and info.value.file == where
        with pytest.warns(RuntimeWarning, match=r"step 2 is damaged.*key=b"):
            assert m.restore(target) == 1
    assert torch.equal(target["b"], state(1)["b"])


def test_manifest_records_a_digest_per_chunk_that_equals_the_chunk_crc(tmp_path):
    x = torch.randn(1000, 30)
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=16 * 1024, max_staging_bytes=64 * 1024, **UNPACKED) as m:
        m.save(
            1, {"x": x, "wide": torch.randn(3, 5000), "zero_d": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
        ).wait()
    body = json.loads((tmp_path / "step_00000001" / "manifest.json").read_bytes())["body"]
    assert body["format"] == "ckpt/5" and body["packs"] == {}
    for name, info in body["arrays"].items():
        grid = [-(-s // c) for s, c in zip(info["shape"], info["chunk"])]
        keys = ["c"] if not grid else ["c/" + "/".join(map(str, i)) for i in np.ndindex(*grid)]
        if 0 in info["shape"]:
            keys = []
        tails = [
            int.from_bytes((Path(data_dir(tmp_path, 1)) / "arrays" / name / k).read_bytes()[-4:], "little")
            for k in keys
        ]
        assert info["digests"] == tails, name


# -- 3. the manifest is authoritative over zarr.json -------------------------------------------------


@pytest.mark.parametrize("edit", ["big_endian", "no_crc", "other_shape", "extra_codec"])
def test_edited_zarr_json_is_damage(tmp_path, edit):
    _save(tmp_path, [1, 2])
    path = os.path.join(data_dir(tmp_path, 2), "arrays", "a", "zarr.json")
    meta = json.loads(open(path).read())
    if edit == "big_endian":
        meta["codecs"][0]["configuration"]["endian"] = "big"
    elif edit == "no_crc":
        meta["codecs"] = meta["codecs"][:1]
    elif edit == "other_shape":
        meta["shape"] = [32, 64]
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [32, 64]
    else:
        meta["codecs"].insert(1, {"name": "transpose", "configuration": {"order": [1, 0]}})
    open(path, "w").write(json.dumps(meta))
    problems = list(catalog.verify(open_storage(str(tmp_path)), 2))
    assert problems and problems[0].file == path and "zarr.json" in str(problems[0]), problems
    target = _target()
    with ckpt.CheckpointManager(tmp_path) as m, pytest.warns(RuntimeWarning, match="step 2 is damaged.*zarr.json"):
        assert m.restore(target) == 1
    assert torch.equal(target["a"], _state(1)["a"])


# -- 6. damaged steps are quarantined, so that the step can be saved again -----------------------------


@pytest.mark.parametrize("where", ["local", "memory"])
def test_damaged_newest_step_is_quarantined_and_can_be_saved_again(tmp_path, where):
    root = str(tmp_path) if where == "local" else f"memory://{uuid.uuid4().hex}"
    _save(root, [1, 2, 3])
    storage = open_storage(root)
    chunk = f"{array_path(storage, 3, 'c')}/c/0/0"
    data = bytearray(storage.read(chunk))
    data[100] ^= 0x10
    storage.write_atomic(chunk, bytes(data))
    target = _target()
    with ckpt.CheckpointManager(root) as m:
        with pytest.raises(CorruptCheckpointError):
            m.restore(target, step=3)  # an explicit step is only reported
        assert m.steps() == [1, 2, 3]
        with pytest.warns(RuntimeWarning, match="step 3 is damaged.*quarantined"):
            assert m.restore(target) == 2
        assert m.steps() == [1, 2]
        (moved,) = {f.split("/")[0] for f in storage.list_files("_quarantine")}
        assert moved.startswith("step_00000003-")
        marker = json.loads(storage.read(f"_quarantine/{moved}/_DAMAGED"))
        assert set(marker) == {"reason", "time", "host", "pid"} and "key=c" in marker["reason"]
        assert marker["pid"] == os.getpid()
        assert storage.read(f"_quarantine/{moved}/manifest.json"), "kept for inspection"
        m.save(3, _state(33)).wait()  # training reached step 3 again
        assert m.restore(target) == 3
    assert torch.equal(target["c"], _state(33)["c"]) and target["n"] == 33


# -- 7. readers racing retention -----------------------------------------------------------------------


class _SavesNewerOnFirstUse:
    """A Stateful target whose state_dict() (called by restore after it read the manifest, before it reads
    the chunks) makes another manager commit a newer step, whose retention (keep_last=1) deletes the step
    being read: the race of a reader with a writer's retention, made deterministic."""

    def __init__(self, writer, step):
        self.writer, self.step, self.loaded = writer, step, None

    def state_dict(self):
        if self.step is not None:
            self.step, step = None, self.step
            self.writer.save(step, _state(step)).wait()
            self.writer.wait()
        return {}

    def load_state_dict(self, state):
        self.loaded = state


def test_step_deleted_by_retention_while_being_read_is_not_damage(tmp_path):
    _save(tmp_path, [1])
    target = _target()
    with ckpt.CheckpointManager(tmp_path, keep_last=1) as writer, ckpt.CheckpointManager(tmp_path) as reader:
        target["n"] = hook = _SavesNewerOnFirstUse(writer, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "damaged" warning
            assert reader.restore(target) == 2, "re-listed after step 1 vanished and restored the newer step"
        assert writer.steps() == [2] and hook.loaded == 2
    assert not (tmp_path / "_quarantine").exists()
    assert all(torch.equal(target[k], _state(2)[k]) for k in "abc")


_READER = r"""
import sys, warnings, torch, ckpt
warnings.simplefilter("error")
root, n = sys.argv[1], int(sys.argv[2])
with ckpt.CheckpointManager(root) as m:
    done = 0
    while done < n:
        t = {"a": torch.zeros(64, 32), "b": torch.zeros(64, 32), "c": torch.zeros(64, 32), "n": None}
        s = m.restore(t)
        if s is None:
            continue
        g = torch.Generator().manual_seed(s)
        assert torch.equal(t["a"], torch.randn(64, 32, generator=g)) and t["n"] == s, s
        done += 1
print("ok", done)
"""


def test_restores_beside_a_writer_with_keep_last_1_see_no_damage(tmp_path):
    """A real second process restores in a loop while this one saves and its retention deletes old steps."""
    _save(tmp_path, [0])
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(tmp_path), "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    step = 1
    with ckpt.CheckpointManager(tmp_path, keep_last=1) as m:
        while reader.poll() is None and step < 5000:
            m.save(step, _state(step))
            step += 1
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0 and "ok 60" in out, err[-3000:]
    assert "damaged" not in err and not (tmp_path / "_quarantine").exists()


# -- 9. strict manifest validation -------------------------------------------------------------------


def _set(path, value):
    def mutate(body):
        node = body
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return mutate


def _deep(body):
    node = body["tree"]
    for _ in range(400):
        node["x"] = {}
        node = node["x"]


def _deep_list(body):
    node = []
    body["tree"]["n"] = node
    for _ in range(400):
        node.append([])
        node = node[0]


_CRAFTED = {
    "body_is_list": lambda b: [1, 2],
    "step_is_str": _set(["step"], "2"),
    "step_is_bool": _set(["step"], True),
    "world_size_0": _set(["world_size"], 0),
    "time_is_str": _set(["time"], "noon"),
    "time_past_a_float": _set(["time"], 10**400),  # OverflowError, not damage, failed every restore and `ckpt ls`
    "metadata_600_deep": _set(["metadata"], functools.reduce(lambda d, _: {"a": d}, range(600), {})),
    "metadata_is_list": _set(["metadata"], [1]),
    "versions_is_list": _set(["versions"], ["x"]),
    "tree_is_list": _set(["tree"], [1]),
    "arrays_is_list": _set(["arrays"], []),
    "array_entry_is_str": _set(["arrays", "a"], "x"),
    "dtype_missing": lambda b: b["arrays"]["a"].pop("dtype"),
    "dtype_unknown": _set(["arrays", "a", "dtype"], "float128"),
    "dtype_is_list": _set(["arrays", "a", "dtype"], ["float32"]),
    "shape_negative": _set(["arrays", "a", "shape"], [-64, 32]),
    "shape_is_str": _set(["arrays", "a", "shape"], "64,32"),
    "shape_float": _set(["arrays", "a", "shape"], [64.0, 32]),
    "shape_32TB": _set(["arrays", "a", "shape"], [1 << 31, 4096]),
    "shape_32TB_one_chunk": lambda b: b["arrays"]["a"].update(
        shape=[1 << 31, 4096], chunk=[1 << 31, 4096], boxes=[[[0, 1 << 31], [0, 4096]]]
    ),
    "fresh_32TB_4GiB_chunks": lambda b: b["arrays"]["c"].update(
        shape=[1 << 31, 4096], chunk=[1 << 18, 4096], boxes=[[[0, 1 << 31], [0, 4096]]], digests=[0] * 8192
    ),
    "chunk_zero": _set(["arrays", "a", "chunk"], [0, 32]),
    "chunk_rank": _set(["arrays", "a", "chunk"], [64]),
    "box_outside": _set(["arrays", "a", "boxes"], [[[0, 65], [0, 32]]]),
    "box_malformed": _set(["arrays", "a", "boxes"], [[[0], [0, 32]]]),
    "digests_missing": lambda b: b["arrays"]["a"].pop("digests"),
    "digests_short": _set(["arrays", "a", "digests"], []),
    "digest_not_int": _set(["arrays", "a", "digests"], ["abc"]),
    "digest_too_big": _set(["arrays", "a", "digests"], [1 << 40]),
    "tree_too_deep": _deep,
    "list_too_deep": _deep_list,
    "ref_not_listed": _set(["tree", "a"], {"$tensor": "nope"}),
    "ref_is_int": _set(["tree", "a"], {"$tensor": 5}),
    "ref_unsafe": _set(["tree", "a"], {"$tensor": "../b"}),
    "tag_extra_key": _set(["tree", "a"], {"$tensor": "a", "x": 1}),
    "unknown_tag": _set(["tree", "n"], {"$pickle": "x"}),
    "bad_float": _set(["tree", "n"], {"$float": "1e999"}),
    "bad_bytes": _set(["tree", "n"], {"$bytes": "%%%"}),
    "size_past_int64": _set(["tree", "n"], {"$size": [1 << 64]}),  # was a bare "Overflow when unpacking long long"
    "bad_np": _set(["tree", "n"], {"$np": "O", "v": 1}),
    "np_void": _set(["tree", "n"], {"$np": "V1000000000", "v": 1}),
    "np_no_such_dtype": _set(["tree", "n"], {"$np": "<f3", "v": 1.0}),
    "np_value_mismatch": _set(["tree", "n"], {"$np": "<i8", "v": "x"}),
    "bad_dict": _set(["tree", "n"], {"$dict": [[1]]}),
    "dict_key_bool": _set(["tree", "n"], {"$dict": [[True, 1]]}),
    "state_no_v": _set(["tree", "n"], {"$state": "X"}),
    "bad_dtype_tag": _set(["tree", "n"], {"$dtype": "float32; import os"}),
    "per_rank_nested": _set(["tree", "n"], {"x": {"$per_rank": [[0, 1]]}}),
    "per_rank_malformed": _set(["tree", "n"], {"$per_rank": [["zero", 1]]}),
    "per_rank_past_the_world": _set(["tree", "n"], {"$per_rank": [[10**30, 1]]}),  # world size 1: rank 0 only
    "array_name_unsafe": lambda b: b["arrays"].update({"../../x": b["arrays"]["a"]}),
    "held_is_dict": _set(["held"], {"a": 0}),
    "held_short": _set(["held"], [0]),
    "held_past_the_boxes": lambda b: b.update(held=[1] * len(b["arrays"])),  # one box each: only 0 or -1
}


def _fifo(step_dir):
    path = os.path.join(_data(step_dir), "arrays", "a", "c", "0", "0")
    os.remove(path)
    os.mkfifo(path)


def _symlink_chunk(step_dir):
    path = os.path.join(_data(step_dir), "arrays", "a", "c", "0", "0")
    other = os.path.join(_data(step_dir.replace("step_00000002", "step_00000001")), "arrays", "a", "c", "0", "0")
    os.remove(path)
    os.symlink(other, path)


def _symlink_dir(step_dir):
    path = os.path.join(_data(step_dir), "arrays", "a")
    other = os.path.join(_data(step_dir.replace("step_00000002", "step_00000001")), "arrays", "a")
    shutil.rmtree(path)
    os.symlink(other, path)


def _json_too_deep(step_dir):
    """Deeper than the JSON parser recurses (RecursionError while parsing, before any checksum)."""
    with open(os.path.join(step_dir, "manifest.json"), "w") as f:
        f.write('{"sha256":"0","body":{"tree":{"n":' + "[" * 100_000 + "]" * 100_000 + "}}}")


def _manifest_dir(step_dir):
    os.remove(os.path.join(step_dir, "manifest.json"))
    os.mkdir(os.path.join(step_dir, "manifest.json"))


def _manifest_fifo(step_dir):
    os.remove(os.path.join(step_dir, "manifest.json"))
    os.mkfifo(os.path.join(step_dir, "manifest.json"))


def _manifest_sparse(step_dir):
    with open(os.path.join(step_dir, "manifest.json"), "r+b") as f:
        f.truncate(2 << 30)  # 2 GiB that cost no disk: every reader held them in memory


def _zarr_json_symlink(step_dir):
    path = os.path.join(_data(step_dir), "arrays", "a", "zarr.json")
    other = os.path.join(_data(step_dir.replace("step_00000002", "step_00000001")), "arrays", "a", "zarr.json")
    os.remove(path)
    os.symlink(other, path)


_FILES = {
    "json_too_deep": _json_too_deep,
    "fifo_chunk": _fifo,
    "symlink_chunk": _symlink_chunk,
    "symlink_array_dir": _symlink_dir,
    "manifest_is_dir": _manifest_dir,
    "manifest_is_fifo": _manifest_fifo,
    "manifest_sparse_2GiB": _manifest_sparse,
    "symlink_zarr_json": _zarr_json_symlink,
}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_steps") / "ck"
    _save(root, [1, 2])
    return root


@pytest.mark.parametrize("case", list(_CRAFTED) + list(_FILES))
def test_crafted_manifests_and_files_are_damage_and_fall_back(tmp_path, two_steps, case):
    root = tmp_path / "ck"
    shutil.copytree(two_steps, root)
    if case in _CRAFTED:
        _resign(root, 2, _CRAFTED[case])
    else:
        _FILES[case](_step(root, 2))
    problems = list(catalog.verify(open_storage(str(root)), 2))
    assert problems and all(isinstance(p, CorruptCheckpointError) for p in problems), problems
    target = {"a": torch.zeros(64, 32), "b": torch.zeros(64, 32), "c": None, "n": None}
    with ckpt.CheckpointManager(root) as m:
        with pytest.raises(CorruptCheckpointError) as info:
            m.restore(target, step=2)
        assert info.value.file and "step_00000002" in info.value.file
        assert not target["a"].any(), "nothing applied"
        with pytest.warns(RuntimeWarning, match="step 2 is damaged"):
            assert m.restore(target) == 1
    assert torch.equal(target["a"], _state(1)["a"]) and torch.equal(target["c"], _state(1)["c"])


@pytest.mark.parametrize("case", ["manifest_is_dir", "manifest_is_fifo", "manifest_sparse_2GiB"])
def test_retention_and_delete_remove_a_step_whatever_stands_in_its_manifest(tmp_path, two_steps, case):
    """A directory in place of a step's manifest made `delete_step` fail (IsADirectoryError) at every retention
    ("retention could not delete step 1", after each save) and every `delete(1)`: the step stayed for good."""
    for how in ("delete", "retention"):
        root = tmp_path / how / "ck"
        shutil.copytree(two_steps, root)
        _FILES[case](_step(root, 1))
        with ckpt.CheckpointManager(root, keep_last=1) as m:
            if how == "delete":
                m.delete(1)
            else:
                m.save(3, {"w": torch.zeros(2)}).wait()
            m.wait()
            assert 1 not in m.steps() and not os.path.exists(_step(root, 1))


def _placed_state(step: int) -> dict:
    """Tensors placed in the rank's pack (the default format): a 2-D one, a 0-d one."""
    return {"w": torch.arange(2048.0).reshape(64, 32) + step, "s": torch.tensor(float(step)), "n": step}


def _uncover(body, pack_bytes: bytes, name: str, boxes: list, offsets: list[int]) -> None:
    """Give a placed float32 array these boxes, at these byte offsets from its place in the pack, each with the
    right digest of those bytes (`pack_bytes`: the pack's files, back to back): well signed, checks out byte for byte."""
    info = body["arrays"][name]
    pack, start = info["places"][0]
    info["boxes"], info["places"], info["digests"] = boxes, [], []
    for box, at in zip(boxes, offsets):
        n = 4 * int(np.prod([b - a for a, b in box]))
        info["places"].append([pack, start + at])
        info["digests"].append(crc32c.crc32c(pack_bytes[start + at : start + at + n]))


_UNCOVERED = {  # (array, boxes, byte offsets of each box in the array's bytes)
    "no_box": ("w", [], []),
    "half_the_rows": ("w", [[[0, 32], [0, 32]]], [0]),  # rows 32.. would keep the target's bytes, or garbage
    "two_boxes_of_the_same_rows": ("w", [[[0, 32], [0, 32]], [[0, 32], [0, 32]]], [0, 4096]),  # as many elements
    "0d_without_a_box": ("s", [], []),
}


@pytest.mark.parametrize("case", list(_UNCOVERED))
def test_a_placed_array_whose_boxes_do_not_tile_its_shape_is_damage(tmp_path, case):
    """Every element of a placed tensor is in exactly one of its boxes: a manifest whose boxes leave some out (or
    cover some twice, leaving others out) would restore the target's old bytes there, and `ckpt.load` uninitialised
    memory; it is damage, however well signed, and the restore falls back."""
    root = tmp_path / "ck"
    with ckpt.CheckpointManager(root) as m:
        for s in (1, 2):
            m.save(s, _placed_state(s))
    name, boxes, offsets = _UNCOVERED[case]
    files = sorted(Path(_data(_step(root, 2))).glob("packs/rank_00000/c/*"), key=lambda p: int(p.name))
    pack_bytes = b"".join(p.read_bytes() for p in files)
    _resign(root, 2, lambda body: _uncover(body, pack_bytes, name, boxes, offsets))
    problems = list(catalog.verify(open_storage(str(root)), 2))
    assert problems and all(isinstance(p, CorruptCheckpointError) for p in problems), problems
    assert problems[0].key == name and "step_00000002" in problems[0].file and "tile" in str(problems[0])
    res = subprocess.run([sys.executable, "-m", "ckpt", "verify", str(root)], capture_output=True, text=True)
    assert res.returncode == 1 and "do not tile" in res.stdout + res.stderr, (res.stdout, res.stderr)
    target = {"w": torch.full((64, 32), -1.0), "s": torch.tensor(-1.0), "n": None}
    with ckpt.CheckpointManager(root) as m:
        with pytest.raises(CorruptCheckpointError, match="do not tile"):
            m.restore(target, step=2)
        with pytest.warns(RuntimeWarning, match="step 2 is damaged"):
            assert m.restore(target) == 1
    assert torch.equal(target["w"], _placed_state(1)["w"]) and target["s"].item() == 1.0 and target["n"] == 1
    assert torch.equal(ckpt.load(root)["w"], _placed_state(1)["w"])  # the damaged step 2 was set aside


_BAD_PLACES = {  # the 2-D placed array's one place, and what its error says
    "place_is_str": ("rank_00000", "bad place"),
    "offset_negative": (["rank_00000", -4096], "bad place"),
    "offset_is_bool": (["rank_00000", True], "bad place"),
    "offset_is_float": (["rank_00000", 0.0], "bad place"),
    "name_unsafe": (["../rank_00000", 0], "bad place"),
    "name_not_a_pack": (["rank_00007", 0], "does not list"),
    "past_the_pack": (["rank_00000", 1 << 40], "do not lie in pack"),
}


@pytest.mark.parametrize("case", list(_BAD_PLACES))
def test_a_placed_array_with_a_malformed_place_is_damage_naming_the_key(tmp_path, case):
    root = tmp_path / "ck"
    with ckpt.CheckpointManager(root) as m:
        for s in (1, 2):
            m.save(s, _placed_state(s))
    place, says = _BAD_PLACES[case]
    _resign(root, 2, _set(["arrays", "w", "places"], [place]))
    (problem,) = catalog.verify(open_storage(str(root)), 2)
    assert isinstance(problem, CorruptCheckpointError) and problem.key == "w" and says in str(problem), problem
    with ckpt.CheckpointManager(root) as m, pytest.warns(RuntimeWarning, match="step 2 is damaged"):
        assert m.restore({"w": torch.zeros(64, 32), "s": torch.tensor(0.0), "n": None}) == 1


def test_format_1_steps_without_digests_are_still_read(tmp_path):
    _save(tmp_path, [1])

    def downgrade(body):
        body["format"] = "ckpt/1"
        del body["data"]
        for info in body["arrays"].values():
            del info["digests"]

    to_old_layout(tmp_path, 1)
    _resign(tmp_path, 1, downgrade)
    assert not list(catalog.verify(open_storage(str(tmp_path)), 1))
    target = _target()
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert torch.equal(target["b"], _state(1)["b"])


def test_unknown_format_is_refused_without_falling_back(tmp_path):
    _save(tmp_path, [1, 2])
    _resign(tmp_path, 2, _set(["format"], "ckpt/99"))
    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(ckpt.CheckpointError, match="ckpt/99") as info:
        m.restore(_target())
    assert not isinstance(info.value, CorruptCheckpointError)
    assert m.steps() == [1, 2], "a newer format is not damage: never quarantined"


# -- 10. types and keys keep their promises -----------------------------------------------------------


def test_exact_types_round_trip(tmp_path):
    scalars = {
        "f64": np.float64(1.5),
        "f32": np.float32(1.5),
        "f16": np.float16(0.5),
        "i8": np.int8(-3),
        "u64": np.uint64(1 << 63),
        "b": np.bool_(True),
        "c64": np.complex64(1 + 2j),
        "str": np.str_("s"),
        "nan32": np.float32("nan"),
    }
    state = {
        "meta": {
            "scalars": scalars,
            "in_list": [np.float64(2.5), (np.int32(4),)],
            "od": collections.OrderedDict([("z", 1), ("a", collections.OrderedDict(b=2))]),
            "size": torch.Size([3, 4]),
            "sizes": [torch.Size([])],
        }
    }
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
        out = {"meta": None}
        m.restore(out)
    got = out["meta"]
    for k, v in scalars.items():
        assert type(got["scalars"][k]) is type(v), k
        assert np.isnan(got["scalars"][k]) if k == "nan32" else got["scalars"][k] == v, k
    assert type(got["in_list"][0]) is np.float64 and type(got["in_list"][1][0]) is np.int32
    assert type(got["od"]) is collections.OrderedDict and list(got["od"]) == ["z", "a"]
    assert type(got["od"]["a"]) is collections.OrderedDict
    assert type(got["size"]) is torch.Size and got["size"] == torch.Size([3, 4])
    assert type(got["sizes"][0]) is torch.Size


@pytest.mark.parametrize(
    "value, what",
    [
        (np.longdouble("1.1"), "longdouble"),
        (torch.eye(3).to_sparse(), "sparse"),
        (torch.empty(3, device="meta"), "meta"),
        (torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "nested"),
        # a tensor subclass wrapping others (torchao's NF4 and float8 weights): a bare RuntimeError naming no key
        (TwoTensor(torch.zeros(2), torch.ones(2)), "a TwoTensor, .*wraps other tensors"),
        # saved as its data alone: it came back an ndarray, its mask lost and the masked-out values as real ones
        (np.ma.masked_array([1.0, -1.0], mask=[False, True]), "masked array.*mask would be lost"),
        # a class where its object was meant: "Module.state_dict() missing 1 required positional argument: 'self'"
        (torch.nn.Linear, "is the class torch.nn.modules.linear.Linear"),
        (torch.zeros([2] + [1] * 32), "33 dimensions: a checkpoint holds at most 32"),
        (np.zeros([1] * 40), "40 dimensions"),
    ],
)
def test_unsupported_values_fail_at_save_naming_the_key(tmp_path, value, what):
    """...and commit nothing: a 33-dimensional tensor committed a step every reader then refused as damaged."""
    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(TypeError, match=rf"key 'opt\.inner'.*{what}"):
        m.save(1, {"opt": {"inner": value}})
    assert ckpt.CheckpointManager(tmp_path).steps() == []


def test_an_error_raised_by_a_state_dict_names_the_key_of_its_object(tmp_path):
    """An object whose state_dict() raised (a sampler without its dataset) failed the save with its own error alone
    (ZeroDivisionError: division by zero), naming no key: with several such objects the user could not tell which."""

    class Broken:
        def state_dict(self):
            return {"n": 1 / 0}

        def load_state_dict(self, state):
            pass

    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(ZeroDivisionError) as info:
        m.save(1, {"data": {"train": Broken()}})
    assert "state_dict() of the Broken at key 'data.train'" in "".join(getattr(info.value, "__notes__", [])), info
    assert ckpt.CheckpointManager(tmp_path).steps() == []


def test_metadata_takes_scalar_tensors_and_numpy_scalars(tmp_path):
    loss = torch.tensor(0.25)
    with ckpt.CheckpointManager(tmp_path, keep_best=1, best_metric="loss") as m:
        m.save(1, {"w": torch.zeros(2)}, metadata={"loss": loss, "acc": np.float32(0.5), "n": np.int64(3)}).wait()
        meta = m.metadata(1)
    assert meta == {"loss": 0.25, "acc": 0.5, "n": 3} and type(meta["loss"]) is float and type(meta["n"]) is int
    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(TypeError, match="metadata"):
        m.save(2, {"w": torch.zeros(2)}, metadata={"loss": torch.zeros(3)})


def test_metadata_that_could_not_be_read_back_is_refused_at_save_and_tag_like_dicts_round_trip(tmp_path):
    """Metadata 200 levels deep used to commit (and fail later restores called deep in a stack); a huge int failed in
    the background; a user's dict shaped like the manifest's own NaN tag came back as a float."""
    deep = functools.reduce(lambda d, _: {"a": d}, range(200), {})
    with ckpt.CheckpointManager(tmp_path, keep_best=1, best_metric="loss") as m:
        with pytest.raises(TypeError, match=r"metadata\['deep'\] is nested deeper than 100 levels"):
            m.save(1, {"w": torch.zeros(2)}, metadata={"deep": deep})
        with pytest.raises(TypeError, match=r"metadata\['loss'\] must be JSON"):
            m.save(1, {"w": torch.zeros(2)}, metadata={"loss": 10**5000})
        with pytest.raises(TypeError, match=r"int at key 'n' has 16610 bits"):
            m.save(1, {"n": 10**5000})
        with pytest.raises(ValueError, match=r"below 2\*\*63"):
            m.save(1 << 63, {"w": torch.zeros(2)})
        tags = {"tag": {"$float": "inf"}, "wrapped": {"$dict": {"$float": "nan"}}, "nan": float("nan")}
        m.save(1, {"w": torch.zeros(2)}, metadata=tags).wait()
        meta = m.metadata(1)
        m.save(2, {"w": torch.zeros(2)}, metadata={"loss": 10**400}).wait()  # no float: never among the best
        m.save(3, {"w": torch.zeros(2)}, metadata={"loss": 1.0}).wait()
        m.save(4, {"w": torch.zeros(2)}, metadata={"loss": 2.0}).wait()
        assert m.steps() == [3, 4], "retention ran past the metric no float holds (it failed at every commit)"
    assert meta["tag"] == {"$float": "inf"} and meta["wrapped"] == {"$dict": {"$float": "nan"}}
    assert math.isnan(meta["nan"])


def test_metadata_that_is_no_dict_of_str_keys_is_refused_at_save_naming_what_it_is(tmp_path):
    """metadata=[...] failed with 'cannot convert dictionary update sequence element #0', metadata={1: 2} with a bare
    KeyError: 1 (JSON turned the key into '1'); both are refused saying what metadata must be, and nothing commits."""
    with ckpt.CheckpointManager(tmp_path) as m:
        with pytest.raises(TypeError, match=r"metadata must be a dict with str keys.*got list"):
            m.save(1, {"w": torch.zeros(2)}, metadata=[0.5, 0.4])
        with pytest.raises(TypeError, match=r"metadata keys must be str.*got 1 \(int\)"):
            m.save(1, {"w": torch.zeros(2)}, metadata={1: 0.5})
        assert m.steps() == []


def test_metadata_with_a_nested_key_that_is_no_str_is_refused_at_save_naming_its_path(tmp_path):
    """metadata={"per_class": {1: 0.9, "1": 0.8}} committed as {"per_class": {"1": 0.8}}: JSON writes a nested int,
    bool, None or float key as a str, so the key came back as another one and a twin's value was silently lost."""
    with ckpt.CheckpointManager(tmp_path) as m:
        for value, shown in (({1: 0.9, "1": 0.8}, "1 (int)"), ([{"a": {None: 1}}], "None (NoneType)")):
            with pytest.raises(TypeError, match=rf"metadata\['acc'\].* has a key {re.escape(shown)}"):
                m.save(1, {"w": torch.zeros(2)}, metadata={"acc": value})
        assert m.steps() == []


def test_a_step_directory_that_is_a_symbolic_link_is_never_read_through(tmp_path):
    """A link in place of a step (to a valid step elsewhere) is no step of this root: not listed, and named
    explicitly it is damage. `ckpt inspect --step` and `metadata()` used to read the other place's manifest."""
    root, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, {"w": torch.ones(2)}).wait()
        m.save(2, {"w": torch.full((2,), 2.0)}).wait()
    os.rename(root / "step_00000002", elsewhere)
    os.symlink(elsewhere, root / "step_00000002")
    with ckpt.CheckpointManager(root) as m:
        assert m.steps() == [1]
        for read in (lambda: m.metadata(2), lambda: m.restore({"w": torch.zeros(2)}, step=2)):
            with pytest.raises(CorruptCheckpointError, match="manifest is reached through a symbolic link"):
                read()
        target = {"w": torch.zeros(2)}
        assert m.restore(target) == 1 and torch.equal(target["w"], torch.ones(2))


def test_an_expanded_target_tensor_is_a_mismatch_before_anything_is_applied(tmp_path):
    """torch refuses to copy into a tensor whose elements share memory: that used to surface as a RuntimeError
    after the other targets had been overwritten."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"a": torch.ones(4), "z": torch.arange(5.0)}).wait()
        target = {"a": torch.zeros(4), "z": torch.zeros(1).expand(5)}
        with pytest.raises(ckpt.StateMismatchError, match=r"key 'z' .* share memory .* strides \[0\]"):
            m.restore(target)
    assert not target["a"].any()


def test_checkpoint_keys_missing_from_the_target_are_a_key_error_before_anything_is_applied(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.ones(3), "opt": {"lr": 0.1, "m": torch.ones(2)}, "extra": 5}).wait()
        target = {"w": torch.zeros(3), "opt": {"lr": 0.0, "m": torch.zeros(2)}}
        with pytest.raises(KeyError, match=r"'extra'.*keys="):
            m.restore(target)
        assert not target["w"].any() and target["opt"]["lr"] == 0.0
        target["extra"] = None
        del target["opt"]["lr"]
        with pytest.raises(KeyError, match=r"opt\.lr"):
            m.restore(target)
        assert not target["w"].any() and not target["opt"]["m"].any()
        target["opt"]["lr"], target["opt"]["new"] = 0.0, 1
        with pytest.raises(KeyError, match=r"opt\.new"):
            m.restore(target)
        del target["opt"]["new"]
        assert m.restore(target) == 1 and target["opt"]["lr"] == 0.1 and target["w"].all() and target["extra"] == 5
        assert m.restore({"w": torch.zeros(3)}, keys=["w"]) == 1  # a subset, said explicitly
        empty = {"w": torch.zeros(3)}
        with pytest.raises(
            ValueError, match=r"keys=\[\]\) would restore nothing"
        ):  # it returned 1, having loaded nothing
            m.restore(empty, keys=[])
        assert not empty["w"].any()


# -- 11. errors name the right file ----------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [4096, 64 << 20])
def test_damage_under_a_module_named_fc_names_the_right_file(tmp_path, chunk_bytes):
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=chunk_bytes, **UNPACKED) as m:
        m.save(1, {"fc": {"c": torch.randn(1, 3000)}}).wait()
    array = Path(data_dir(tmp_path, 1)) / "arrays" / "fc" / "c"
    chunk = array / "c" / "0" / ("1" if chunk_bytes == 4096 else "0")
    _flip(str(chunk), 8)
    problems = list(catalog.verify(open_storage(str(tmp_path)), 1))
    assert [p.file for p in problems] == [str(chunk)]
    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(CorruptCheckpointError) as info:
        m.restore({"fc": {"c": torch.zeros(1, 3000)}}, step=1)
    assert info.value.file == str(chunk) and info.value.key == "fc/c"


def test_restore_keys_given_as_a_generator_restore_the_step_fallen_back_to(tmp_path):
    """restore(state, keys=(k for k in ['a'])) with the newest step damaged read the generator on the first try,
    then restored nothing of step 1 and returned 1: the state kept its values in silence. Keys are read once."""
    _save(tmp_path, [1, 2])
    _flip(os.path.join(data_dir(tmp_path, 2), "arrays", "a", "c", "0", "0"), 4000)
    target = _target()
    with ckpt.CheckpointManager(tmp_path) as m, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert m.restore(target, keys=(k for k in ["a"])) == 1
    assert _bits(target["a"]) == _bits(_state(1)["a"])
