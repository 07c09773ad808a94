"""Everything a training state holds comes back bit-exactly, in place, from local and memory:// roots."""

import json
import math
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt
from step_paths import data_dir

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def _random(shape, dtype, gen):
    """Random values; every bit pattern for the types torch cannot draw from directly (NaN payloads included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(params=["local", "file", "memory"])
def root(request, tmp_path):
    return {"local": str(tmp_path / "ck"), "file": f"file://{tmp_path}/ck", "memory": f"memory://{uuid.uuid4().hex}"}[
        request.param
    ]


def test_every_dtype_and_shape_round_trips_bit_exactly(root):
    gen = torch.Generator().manual_seed(0)
    state = {}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        state[name] = _random((7, 5), dt, gen)
        state[name + "_0d"] = _random((), dt, gen)
        state[name + "_empty"] = _random((0, 3), dt, gen)
    state["noncontig"] = torch.randn(6, 4, generator=gen).t()[1:, ::2]
    state["nan_payload"] = torch.tensor([float("nan"), -0.0, float("inf")])
    with ckpt.CheckpointManager(root) as m:
        m.save(1, state).wait()
    target = {
        k: torch.zeros_like(v) if v.is_contiguous() else torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()
    }
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(target) == 1
    for k, v in state.items():
        assert _bits_equal(target[k], v), k


def test_json_leaves_keep_their_types(root):
    state = {
        "meta": {
            "ints": {1: "a", 2: (3, 4.5)},
            "floats": [float("nan"), float("inf"), -float("inf"), 0.1],
            "none": None,
            "flag": True,
            "text": "é/..\\",
            "nested": [[1, [2, (3,)]]],
            "$weird": 1,
            "bytes": b"\x00\xff",
            "np": np.int64(7),
            "npf": np.float32(0.5),
            "dtype": torch.bfloat16,
        },
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
    }
    with ckpt.CheckpointManager(root) as m:
        m.save(3, state).wait()
    out = {"meta": None, "arr": None}
    with ckpt.CheckpointManager(root) as m:
        m.restore(out)
    meta = out["meta"]
    assert meta["ints"] == {1: "a", 2: (3, 4.5)} and isinstance(meta["ints"][2], tuple)
    assert math.isnan(meta["floats"][0]) and meta["floats"][1:] == [float("inf"), -float("inf"), 0.1]
    assert meta["none"] is None and meta["flag"] is True and meta["text"] == "é/..\\"
    assert meta["nested"] == [[1, [2, (3,)]]] and meta["$weird"] == 1 and meta["bytes"] == b"\x00\xff"
    assert type(meta["np"]) is np.int64 and meta["np"] == 7 and type(meta["npf"]) is np.float32
    assert meta["dtype"] is torch.bfloat16
    assert (
        isinstance(out["arr"], np.ndarray)
        and out["arr"].dtype == np.int16
        and (out["arr"] == np.arange(6).reshape(2, 3)).all()
    )


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _train(model, opt, sched, scaler, steps):
    for _ in range(steps):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()


def test_a_file_url_and_its_path_are_one_root(tmp_path):
    """file://PATH is the directory PATH: one lease, one set of steps, damage found and skipped either way;
    metadata(step) reads the manifest of a committed step, from any manager."""
    import subprocess
    import sys

    url, path = f"file://{tmp_path}/ck", tmp_path / "ck"
    with ckpt.CheckpointManager(url, keep_last=2, pack_bytes=0) as m:
        for s in (1, 2, 3):
            m.save(s, {"x": torch.full((1000,), float(s))}, metadata={"loss": 1.0 / s})
        m.wait()
        with pytest.raises(ckpt.LeaseHeldError, match=f"pid {os.getpid()}"):
            ckpt.CheckpointManager(path).save(4, {"x": torch.zeros(1000)})  # the same root: its one writer is m
    reader = ckpt.CheckpointManager(path)
    assert reader.steps() == [2, 3] and reader.metadata(3) == {"loss": 1.0 / 3}
    with pytest.raises(FileNotFoundError, match="step 1 is not committed"):
        reader.metadata(1)  # deleted by retention
    chunk = Path(data_dir(path, 3)) / "arrays" / "x" / "c" / "0"
    chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 1]) + chunk.read_bytes()[1:])
    target = {"x": torch.zeros(1000)}
    with pytest.warns(RuntimeWarning, match="step 3 is damaged"), ckpt.CheckpointManager(url) as m:
        assert m.restore(target) == 2 and m.metadata(2) == {"loss": 0.5}
    assert torch.equal(target["x"], torch.full((1000,), 2.0)) and reader.steps() == [2]
    ls = subprocess.run([sys.executable, "-m", "ckpt", "ls", url], capture_output=True, text=True)
    assert ls.returncode == 0 and "2  committed" in ls.stdout and "3  damaged" in ls.stdout, ls.stdout + ls.stderr


def test_module_optimizer_scheduler_scaler_restore_in_place(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _train(model, opt, sched, scaler, 3)
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(3, {"model": model, "opt": opt, "sched": sched, "scaler": scaler}).wait()

    model2 = _model()
    for p in model2.parameters():
        p.data.zero_()
    weight_ptr = model2[0].weight.data_ptr()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 2, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore({"model": model2, "opt": opt2, "sched": sched2, "scaler": scaler2}) == 3
    assert model2[0].weight.data_ptr() == weight_ptr, "parameters must be restored in place"
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert _bits_equal(a, b), k
    assert sched2.state_dict() == sched.state_dict() and scaler2.state_dict() == scaler.state_dict()
    assert json.dumps(opt2.state_dict()["param_groups"]) == json.dumps(opt.state_dict()["param_groups"])
    # the restored run continues exactly like the original
    torch.manual_seed(1)
    _train(model, opt, sched, scaler, 2)
    torch.manual_seed(1)
    _train(model2, opt2, sched2, scaler2, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert _bits_equal(a.detach(), b.detach())


def test_tied_tensors_are_stored_once_and_stay_tied(tmp_path):
    emb = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(0, {"model": model}).wait()
        manifest = json.loads((tmp_path / "step_00000000" / "manifest.json").read_bytes())["body"]
    assert len(manifest["arrays"]) == 1
    model2 = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 8), "head": torch.nn.Linear(8, 50, bias=False)})
    model2["head"].weight = model2["emb"].weight
    with ckpt.CheckpointManager(tmp_path) as m:
        m.restore({"model": model2})
    assert torch.equal(model2["emb"].weight, emb.weight) and model2["head"].weight is model2["emb"].weight


def test_partial_restore_by_keys(tmp_path):
    model = _model()
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(5, {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "step": 5}).wait()
        model2 = _model()
        for p in model2.parameters():
            p.data.fill_(7)
        target = {"model": model2, "opt": "untouched", "step": -1}
        assert m.restore(target, keys=["model"]) == 5
    assert target["opt"] == "untouched" and target["step"] == -1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_restore_returns_none_without_checkpoints_and_picks_explicit_step(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore({"x": torch.zeros(2)}) is None and m.latest_step() is None
        for s in (10, 20, 30):
            m.save(s, {"x": torch.full((2,), float(s))})
        m.wait()
        assert m.steps() == [10, 20, 30] and m.latest_step() == 30
        t = {"x": torch.zeros(2)}
        assert m.restore(t, step=20) == 20 and t["x"].tolist() == [20.0, 20.0]


def test_saves_are_async_and_snapshotted(tmp_path):
    x = torch.arange(1000.0)
    with ckpt.CheckpointManager(tmp_path) as m:
        h = m.save(1, {"x": x})
        x.add_(1)  # mutate right after save returns: the checkpoint must hold the snapshot
        h.wait()
        assert h.done()
        out = {"x": torch.zeros(1000)}
        m.restore(out)
    assert torch.equal(out["x"], torch.arange(1000.0))


def test_staging_cap_snapshots_in_waves(tmp_path):
    state = {f"t{i}": torch.randn(300, 100) for i in range(5)}  # 120 KB each
    state["big"] = torch.randn(2000, 100)  # larger than the cap: cut by rows
    with ckpt.CheckpointManager(tmp_path, max_staging_bytes=256 * 1024, chunk_bytes=64 * 1024) as m:
        m.save(1, state).wait()
        assert m._background.arena.capacity <= 256 * 1024
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        m.restore(out)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_chunking_keeps_file_count_sane_and_reads_back(tmp_path):
    x = torch.randn(1000, 300)  # 1.2 MB
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=256 * 1024, pack_bytes=0) as m:  # an array of its own
        m.save(0, {"x": x}).wait()
        chunks = os.listdir(Path(data_dir(tmp_path, 0)) / "arrays" / "x" / "c")
        assert 4 <= len(chunks) <= 6
        out = {"x": torch.zeros(1000, 300)}
        m.restore(out)
    assert torch.equal(out["x"], x)


def test_lazy_conjugate_views_are_saved_and_restored_by_their_values(tmp_path):
    """`x.conj()` and its imaginary part (a negative view) hold other bytes than their values: a save writes the
    values, and a restore into such a view gives it the values (it is read into scratch, then copied in)."""
    x = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(2))
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"c": x.conj(), "n": x.conj().imag}).wait()
    base = torch.zeros(5, dtype=torch.complex64)
    into = {"c": torch.zeros(5, dtype=torch.complex64).conj(), "n": base.conj().imag}
    assert into["c"].is_conj() and into["n"].is_neg()
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(into) == 1
    assert torch.equal(into["c"], x.conj()) and into["c"].is_conj()
    assert torch.equal(into["n"], x.conj().imag) and torch.equal(base.imag, x.imag)
    assert torch.equal(ckpt.load(tmp_path)["c"], x.conj().resolve_conj())


def test_a_conjugate_or_negative_view_saved_beside_its_base_is_not_an_alias_of_it(tmp_path):
    """Same memory, shape and strides as its base, other values: it was stored as a tie to the base and came back
    with the base's values, silently."""
    c = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, 2.0, 3.0])
    state = {"c": c, "c_conj": c.conj(), "x": x, "x_neg": torch._neg_view(x)}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
    out = ckpt.load(tmp_path)
    assert torch.equal(out["c_conj"], c.conj()) and torch.equal(out["x_neg"], -x)
    assert torch.equal(out["c"], c) and torch.equal(out["x"], x)


def test_numpy_arrays_keep_a_0d_shape_and_one_that_cannot_be_saved_names_its_key(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"a": np.array(2.5), "b": np.array(True)}).wait()
        for bad in (np.arange(3, dtype=">i4"), np.array(["ab"]), np.array(["2026-12-06"], dtype="datetime64[D]")):
            with pytest.raises(TypeError, match=r"numpy array at key 'model.stats' \(dtype"):
                m.save(2, {"model": {"stats": bad}})
    out = ckpt.load(tmp_path)
    assert out["a"].shape == () and out["a"] == 2.5 and out["b"].shape == () and out["b"].dtype == np.bool_


def test_tensor_larger_than_2gib_round_trips(tmp_path):
    n = (2 << 30) + 4096 * 3
    x = torch.empty(n, dtype=torch.uint8)
    block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    for i, piece in enumerate(x.split(1 << 20)):  # every MiB differs from its neighbours: no byte is left unchecked
        piece.copy_(block.roll(i)[: piece.numel()])
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(0, {"x": x}).wait()
    out = {"x": torch.zeros(n, dtype=torch.uint8)}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.restore(out)
    assert torch.equal(out["x"], x), "every byte of the >2 GiB tensor comes back"


def _trained(seed: int, lr: float):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


class _Buffer:
    """A Stateful object of the caller's own; `refuse`: its load_state_dict refuses (as a sampler over other data)."""

    def __init__(self, refuse: bool = False):
        self.buf, self.refuse = torch.arange(4.0), refuse

    def state_dict(self):
        return {"buf": self.buf}

    def load_state_dict(self, sd):
        if self.refuse:
            raise ValueError("this object refuses the checkpoint's state")
        self.buf = sd["buf"]


def test_a_restore_an_objects_own_load_refuses_leaves_every_object_as_it_was(tmp_path):
    """The module, optimizer, scheduler, RNG and sampler of a state whose last object refuses its state (or whose
    sampler runs over other data) are all as they were after the failed restore: values, state and tensors."""
    import copy

    model, opt = _trained(0, 0.5)
    state = {"model": model, "optim": opt, "sched": torch.optim.lr_scheduler.StepLR(opt, 3), "rng": ckpt.RNGState()}
    state["sampler"], state["last"] = ckpt.ShuffledSampler(100, 4, seed=0), _Buffer()
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
    for refusing in ("last", "sampler"):
        model, opt = _trained(5, 0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 7)
        sampler = ckpt.ShuffledSampler(120 if refusing == "sampler" else 100, 4, seed=0)
        last = _Buffer(refuse=refusing == "last")
        mine = {"model": model, "optim": opt, "sched": sched, "rng": ckpt.RNGState(), "sampler": sampler, "last": last}
        before = copy.deepcopy({k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in mine.items()})
        torch.manual_seed(123)
        rng = torch.get_rng_state()
        with pytest.raises((ValueError, ckpt.DataMismatchError)), ckpt.CheckpointManager(tmp_path) as m:
            m.restore(mine)
        after = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in mine.items()}
        assert torch.equal(torch.get_rng_state(), rng), refusing
        for k in ("model", "sched", "sampler", "last"):
            assert json.dumps(after[k], default=lambda t: t.tolist()) == json.dumps(
                before[k], default=lambda t: t.tolist()
            ), (refusing, k)
        assert after["optim"]["param_groups"] == before["optim"]["param_groups"], refusing
        for i in (0, 1):
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(after["optim"]["state"][i][name], before["optim"]["state"][i][name]), (i, name)


@pytest.mark.parametrize("where", ["top", "nested", "sibling_nested"])
def test_a_failed_restore_leaves_a_samplers_live_iterator_running(tmp_path, where):
    """A restore that fails at another object's load never touches the sampler, at the top of the state or in a
    dict of it: the loader's iterator goes on with the batch it would have given (a sampler loaded and then given
    its state back, or loaded before a nested object refused, had ended it)."""

    def state(sampler, last):
        return {
            "top": {"sampler": sampler, "last": last},
            "nested": {"data": {"sampler": sampler}, "last": last},
            "sibling_nested": {"sampler": sampler, "more": {"last": last}},
        }[where]

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state(ckpt.ShuffledSampler(100, 4, seed=0), _Buffer())).wait()
    sampler, twin = ckpt.ShuffledSampler(100, 4, seed=0), ckpt.ShuffledSampler(100, 4, seed=0)
    live, expected = sampler.track(iter(sampler)), twin.track(iter(twin))
    for _ in range(3):
        assert next(live) == next(expected)
    with pytest.raises(ValueError, match="refuses"), ckpt.CheckpointManager(tmp_path) as m:
        m.restore(state(sampler, _Buffer(refuse=True)))
    assert next(live) == next(expected)
    assert sampler.state_dict() == twin.state_dict()
    sampler.check_state_dict(twin.state_dict())  # checks, changes nothing
    with pytest.raises(ckpt.DataMismatchError, match="'kind'"):
        sampler.check_state_dict({"kind": "other"})
    assert next(live) == next(expected)


@pytest.mark.parametrize("kind", ["adamw", "adafactor", "sgd"])
def test_an_optimizer_over_other_shaped_parameters_is_refused_naming_the_key(tmp_path, kind):
    """An optimizer built over parameters of other shapes (another model of as many parameters, or the same ones in
    another order) took the checkpoint's moments: the next step failed with a broadcast error naming no key, after a
    restore that had said nothing. Now the restore refuses, naming the state and both shapes, and changes nothing;
    the shapes an optimizer keeps of its own (Adafactor's factored [rows, 1] and [1, cols]) still restore."""
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps),
        "adafactor": lambda ps: torch.optim.Adafactor(ps),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }[kind]
    model = torch.nn.Linear(4, 3)
    opt = make(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"optim": opt}).wait()
        same = torch.nn.Linear(4, 3)
        fresh = make(same.parameters())
        assert m.restore({"optim": fresh}) == 1
        assert all(torch.equal(a, b) for a, b in zip(_moments(fresh), _moments(opt)))
        other = torch.nn.Linear(3, 4)  # as many parameters, of other shapes
        moved = make([other.bias, other.weight])
        match = r"key 'optim.state.0.\w+' has shape \[3, (4|1)\] in the checkpoint, but the optimizer's parameter 0"
        with pytest.raises(ckpt.StateMismatchError, match=match + r" has shape \[4\]"):
            m.restore({"optim": moved})
        assert moved.state_dict()["state"] == {}


def _moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize(
    "case", ["module_for_tensor", "tensor_for_module", "optimizer_groups", "module_for_none", "optimizer_for_list"]
)
def test_a_restore_into_objects_of_another_kind_is_refused_before_anything_changes(tmp_path, case):
    """A module where the checkpoint holds a tensor, a tensor where it holds a module, an optimizer with other
    parameter groups: a StateMismatchError naming the key, raised before any tensor of the caller changed."""
    model, opt = _trained(0, 0.5)
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"model": model, "x": torch.zeros(2), "optim": opt}).wait()
    model, opt = _trained(5, 0.1)
    weight = model.weight.detach().clone()
    state = {"model": model, "x": torch.ones(2), "optim": opt}
    if case == "module_for_tensor":
        state["x"], match = (
            torch.nn.Linear(1, 1),
            "key 'x' is a Linear in the state passed to restore, but the checkpoint holds a tensor",
        )
    elif case == "tensor_for_module":
        state["model"], match = torch.zeros(3), "key 'model' is a tensor .* holds the state of a Linear"
    elif case == "optimizer_groups":
        state["optim"], match = torch.optim.AdamW([model.weight]), r"key 'optim': .* groups of \[2\] .* \[1\]"
    else:  # torch's own load raised 'Expected state_dict to be dict-like', 'parameter groups of None', naming no key
        with ckpt.CheckpointManager(tmp_path) as m:
            m.save(2, {"model": model, "x": None, "optim": [0.1, 0.2]}).wait()
        if case == "module_for_none":
            state["x"], match = torch.nn.Linear(1, 1), "key 'x' is a Linear .* the checkpoint holds a NoneType value"
        else:
            state["x"], match = None, "key 'optim' is an AdamW .* the checkpoint holds a list value"
    with pytest.raises(ckpt.StateMismatchError, match=match), ckpt.CheckpointManager(tmp_path) as m:
        m.restore(state)
    assert torch.equal(model.weight, weight)
    assert case in ("module_for_tensor", "module_for_none", "optimizer_for_list") or torch.equal(
        state["x"], torch.ones(2)
    )


class _Whitening:
    """A strided numpy array in an object's state, copied out by its load."""

    def __init__(self, seed: int):
        self.M = np.random.default_rng(seed).standard_normal((4, 3)).T

    def state_dict(self):
        return {"M": self.M}

    def load_state_dict(self, sd):
        self.M = np.array(sd["M"])


def test_objects_whose_state_is_read_into_strided_memory_load_after_it_and_a_tensor_lr_takes_a_float(tmp_path):
    """An object's strided numpy state gets the step's values (it loads after they are copied in), and an optimizer
    with a tensor learning rate restores a checkpoint saved with a float one (its own load judges)."""
    model, opt = _trained(0, 0.01)
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": _Whitening(0), "optim": opt}).wait()
    model, _ = _trained(5, 0.02)
    mine = {"w": _Whitening(7), "optim": torch.optim.Adam(model.parameters(), lr=torch.tensor(0.02))}
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(mine) == 1
    assert np.array_equal(mine["w"].M, _Whitening(0).M)
    assert float(mine["optim"].param_groups[0]["lr"]) == 0.01


def test_objects_in_a_list_of_the_state_load_their_state(tmp_path):
    """A GAN's two optimizers in a list (and a tuple) stay the caller's objects and get the step's whole state,
    their param_groups' learning rates included, not only the tensors read into directly."""

    def make(seed: int):
        torch.manual_seed(seed)
        g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        opts = [torch.optim.Adam(g.parameters(), lr=0.1 + seed), torch.optim.Adam(d.parameters(), lr=0.2 + seed)]
        (g(torch.ones(1, 2)).sum() + d(torch.ones(1, 2)).sum()).backward()
        for o in opts:
            o.step()
        return {"models": {"g": g, "d": d}, "opts": opts, "pair": tuple(opts[::-1]), "n": [1, 2]}

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, make(0)).wait()
    mine, saved = make(3), make(0)
    opts, numbers = mine["opts"], mine["n"]
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(mine) == 1
    assert mine["opts"] is opts and mine["n"] is numbers and all(isinstance(o, torch.optim.Adam) for o in mine["pair"])
    assert [o.param_groups[0]["lr"] for o in opts] == [0.1, 0.2]
    for got, want in zip(opts, saved["opts"]):
        assert torch.equal(got.state_dict()["state"][0]["exp_avg"], want.state_dict()["state"][0]["exp_avg"])


def test_a_list_of_objects_of_another_length_is_refused_and_a_json_list_takes_the_checkpoints(tmp_path):
    """A list (or tuple) of the caller's holding tensors or objects, of another length than the checkpoint's, was
    replaced by the checkpoint's values: the restore returned the step and the caller's optimizers kept their
    state. It is refused naming the key and both lengths, before anything changes; a JSON list takes the saved one."""
    models = [torch.nn.Linear(2, 2) for _ in range(3)]
    with ckpt.CheckpointManager(tmp_path) as m:
        saved = {"opts": [torch.optim.SGD(x.parameters(), lr=0.5) for x in models], "t": (torch.ones(2),), "h": [1, 2]}
        m.save(1, saved).wait()
    opts = [torch.optim.SGD(x.parameters(), lr=0.1) for x in models[:2]]
    for mine, key, lengths in (
        ({"opts": opts, "t": (torch.zeros(2),), "h": []}, "opts", "list of 2 .* holds 3"),
        ({"opts": saved["opts"], "t": (torch.zeros(2), torch.zeros(1)), "h": []}, "t", "tuple of 2 .* holds 1"),
    ):
        with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(ckpt.StateMismatchError, match=f"'{key}'.*{lengths}"):
            m.restore(mine)
        assert mine["h"] == [] and all(o.param_groups[0]["lr"] == 0.1 for o in opts)
    mine = {"opts": [torch.optim.SGD(x.parameters(), lr=0.1) for x in models], "t": (torch.zeros(2),), "h": []}
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(mine) == 1
    assert mine["h"] == [1, 2] and [o.param_groups[0]["lr"] for o in mine["opts"]] == [0.5] * 3


def test_a_strided_tensor_that_requires_grad_restores_in_place(tmp_path):
    """A transposed or channels_last tensor that requires grad (not read into directly: copied in once verified):
    the copy raised torch's in-place-on-a-leaf error, naming no key, after the model had been overwritten."""

    def state(v: float) -> dict:
        return {
            "t": torch.full((4, 3), v).t().detach().requires_grad_(True),
            "conv": torch.full((2, 3, 4, 4), v).to(memory_format=torch.channels_last).requires_grad_(True),
            "w": torch.full((5,), v),
        }

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state(1.0)).wait()
    target = state(2.0)
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert all(torch.equal(t.detach(), s) for t, s in zip(target.values(), state(1.0).values()))
    assert target["t"].requires_grad and target["conv"].is_contiguous(memory_format=torch.channels_last)


def test_a_large_conjugate_view_saves_its_values(tmp_path):
    """A complex conjugate view past the 16 MiB a snapshot copy is cut into: the cut viewed it as bytes, which torch
    refuses for a lazy conjugate (save failed, naming no key)."""
    base = torch.randn(1 << 20, dtype=torch.complex128)  # 16 MiB
    state = {"z": torch.cat([base, base[:1024]]).conj(), "n": torch.cat([base, base[:1024]]).conj().imag}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
    got = ckpt.load(tmp_path)
    assert torch.equal(got["z"], state["z"].resolve_conj()) and torch.equal(got["n"], state["n"].resolve_neg())


def test_a_numpy_array_with_negative_strides_restores(tmp_path):
    """A reversed numpy view saved fine, but restoring into one raised torch's negative-stride error, naming no key:
    like a read-only array, it now gets a new array in its place."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"a": np.arange(10.0)[::-2], "b": np.arange(3)}).wait()
    target = {"a": np.zeros(5)[::-1], "b": np.zeros(3, dtype=np.int64)}
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert target["a"].tolist() == [9.0, 7.0, 5.0, 3.0, 1.0] and target["b"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("kind", ["meta", "sparse_coo", "sparse_csr", "nested"])
def test_a_restore_into_a_tensor_without_dense_memory_is_refused_naming_the_key(tmp_path, kind):
    """A model built on the meta device and not materialized: restore copied into its tensors, which does nothing,
    and returned the step (the state kept no value, silently). A sparse or nested target failed inside torch, naming
    no key (or as an 'expanded view'). Each is a StateMismatchError naming the key and what the target is, raised
    before any tensor of the caller changed."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"model": torch.nn.Linear(3, 3), "w": torch.arange(6.0).reshape(3, 2)}).wait()
    if kind == "meta":
        with torch.device("meta"):
            model = torch.nn.Linear(3, 3)
        state, key, what = {"model": model, "w": torch.zeros(3, 2)}, "model.weight", "a meta tensor"
    else:
        w = {
            "sparse_coo": lambda: torch.ones(3, 2).to_sparse(),
            "sparse_csr": lambda: torch.ones(3, 2).to_sparse_csr(),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(2)] * 3),
        }[kind]()
        state, key, what = {"model": torch.nn.Linear(3, 3), "w": w}, "w", "sparse" if "sparse" in kind else "nested"
    before = {k: v.detach().clone() for k, v in state["model"].state_dict().items() if not v.is_meta}
    with pytest.raises(ckpt.StateMismatchError, match=f"key '{key}' .* the target tensor is .*{what}"):
        with ckpt.CheckpointManager(tmp_path) as m:
            m.restore(state)
    assert all(torch.equal(state["model"].state_dict()[k], v) for k, v in before.items())


def test_a_kind_mismatch_reads_as_english(tmp_path):
    """The mismatch errors said 'the checkpoint holds a int value' and 'key 'optim' is a AdamW'; now 'an'."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"epoch": 3}).wait()
        with pytest.raises(
            ckpt.StateMismatchError, match=r"key 'epoch' is a tensor .* the checkpoint holds an int value$"
        ):
            m.restore({"epoch": torch.zeros(1)})


def test_a_strided_inference_tensor_restores_in_place(tmp_path):
    """A strided target made under torch.inference_mode: its copy raised torch's 'Inplace update to inference tensor'
    after the other tensors had been overwritten (a failed restore that changed the state). It is restored in place."""
    saved = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(12.0).reshape(4, 3).t() + 100}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, saved).wait()
    with torch.inference_mode():
        b = torch.full((4, 3), -2.0).t()
    target = {"a": torch.full((3, 4), -1.0), "b": b}
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1
    assert target["b"] is b and b.is_inference()
    assert all(torch.equal(target[k], v) for k, v in saved.items())


def _deep(depth: int, key_chars: int, leaf):
    """`leaf` under `depth` nested dicts, each keyed by a string of `key_chars` characters."""
    for level in range(depth):
        leaf = {f"{level:03d}".ljust(key_chars, "k"): leaf}
    return leaf


def _key_state():
    """Tensors under keys a file system or an object store may mishandle: paths of 5,000+ characters, segments past
    NAME_MAX (in UTF-8 too), characters with a meaning in paths or URLs, the layout's own names, and sibling keys
    that escape to one directory name: an int and its str, '' and NUL, and names differing only in case (one
    directory on a case-insensitive file system)."""
    t = lambda *shape, v=1.0: torch.full(shape, v)  # noqa: E731
    return {
        "deep": _deep(25, 200, {"w": torch.arange(6.0).reshape(2, 3), "empty": torch.empty(0, 4)}),
        "long": {"x" * 300: t(2, v=2), "é" * 200: t(3, v=3), "日本" * 100: t(1, v=4)},
        "chars": {
            c: t(2, v=i) for i, c in enumerate(["\x00", "\n", "%", "%25", "\\", ":", "a.", "a ", ".", "..", "~"])
        },
        "layout": {
            n: t(1, v=i) for i, n in enumerate(["manifest.json", "_LEASE", "zarr.json", "c", "packs", "arrays"])
        },
        "int_str": {0: t(3, v=5), "0": {"c": {"0": t(5, v=6), "zarr.json": t(1)}}, "0~1": t(2, v=7)},
        "str_int": {"1": {"c": {"0": t(2, 2, v=8)}}, 1: t(2, 2, v=9)},
        "nul": {"": t(3, 1, v=10), "\x00": {"c": {"0": {"0": t(4, v=11)}}}},
        "case": {"W": t(2, v=12), "w": t(3, v=13), "Layer": {"x": t(1, v=14)}, "layer": {"x": t(1, v=15)}},
        # file names os.fsdecode gives for bytes that are not UTF-8: the save failed with a UnicodeEncodeError
        "undecodable": {os.fsdecode(b"\xff"): t(2, v=16), os.fsdecode(b"a\xed\xa0\x80"): t(1, v=17), "\ud800": t(1)},
    }


def _zeros_like_tree(x):
    return {k: _zeros_like_tree(v) for k, v in x.items()} if isinstance(x, dict) else torch.full_like(x, -1)


def _equal_trees(a, b) -> bool:
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal_trees(a[k], b[k]) for k in a)
    return _bits_equal(a, b)


@pytest.mark.parametrize("pack_bytes", [None, 0])
def test_every_key_saves_and_restores_under_a_bounded_array_path(root, pack_bytes):
    """A tensor stored as an array of its own (an empty one, or any with pack_bytes=0) under any valid key saves
    and restores bitwise: a key path of 5,000 characters failed the background write with ENAMETOOLONG, and an int
    key beside its str (or '' beside NUL) put one array's directory inside another's (EISDIR), losing the step."""
    from ckpt import layout
    from ckpt.format import MAX_NAME
    from ckpt.storage import open_storage

    state = _key_state()
    with ckpt.CheckpointManager(root, **({} if pack_bytes is None else {"pack_bytes": pack_bytes})) as m:
        m.save(1, state).wait()
    target = _zeros_like_tree(state)
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(target) == 1
    assert _equal_trees(target, state)
    names = [n.lower() for n in layout.read_manifest(open_storage(root), 1).arrays]
    assert max(map(len, names)) <= MAX_NAME
    dirs = set(names)  # no array's directory lies inside another's, nor is another's, even case-insensitively
    assert len(dirs) == len(names) and not [n for n in names if any(n[:i] in dirs for i, c in enumerate(n) if c == "/")]
