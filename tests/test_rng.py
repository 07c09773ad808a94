"""RNGState: every source restored exactly, leaves are tensors/arrays/JSON only, and each known trap is covered."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ckpt import RNGState


def _generators() -> dict[str, object]:
    return {
        "py": random.Random(1),
        "pcg": np.random.default_rng(2),
        "philox": np.random.Generator(np.random.Philox(3)),
        "sfc": np.random.Generator(np.random.SFC64(4)),
        "mt": np.random.Generator(np.random.MT19937(5)),
        "dropout": torch.Generator().manual_seed(6),
    }


def _draw(gens: dict[str, object]) -> list[float]:
    """A few numbers from every global source and every registered generator (gauss caches included)."""
    out = [
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(3).tolist(),
    ]
    for g in gens.values():
        if isinstance(g, random.Random):
            out += [g.random(), g.gauss(0, 1)]
        elif isinstance(g, np.random.Generator):
            out += [float(g.random()), int(g.integers(1 << 62)), int(g.integers(7, dtype=np.uint32))]
        else:
            out.append(torch.rand(3, generator=g).tolist())
    return out


def _leaves(tree, path=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(tree, (list, tuple)) and not all(isinstance(x, int) for x in tree):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}.{i}")
    else:
        yield path, tree


def test_all_sources_continue_exactly_after_restore():
    gens = _generators()
    rng = RNGState(gens)
    _draw(gens)  # move off the seeds, leave a cached gauss behind
    state = rng.state_dict()
    expected = _draw(gens)
    _draw(gens)
    rng.load_state_dict(state)
    assert _draw(gens) == expected


def test_state_leaves_are_tensors_arrays_or_json():
    state = RNGState(_generators()).state_dict()
    for path, leaf in _leaves(state):
        if isinstance(leaf, torch.Tensor):
            assert leaf.dtype == torch.uint8, path
        elif not isinstance(leaf, np.ndarray):
            json.dumps(leaf)


def test_python_state_survives_json():
    gens = {"py": random.Random(8)}
    rng = RNGState(gens, numpy=False, torch=False, cuda=False)
    random.gauss(0, 1)
    state = json.loads(json.dumps(rng.state_dict()))
    expected = [random.random(), gens["py"].random()]
    rng.load_state_dict(state)
    assert [random.random(), gens["py"].random()] == expected


def test_trap_numpy_generator_not_covered_by_legacy_state():
    g = np.random.default_rng(0)
    legacy = np.random.get_state()
    rng = RNGState({"g": g})
    state = rng.state_dict()
    expected = g.random(4)
    np.random.set_state(legacy)  # the legacy state alone does not rewind a Generator ...
    assert not np.array_equal(g.random(4), expected)
    rng.load_state_dict(state)  # ... a registered one is restored
    assert np.array_equal(g.random(4), expected)


def test_disabled_source_is_left_alone():
    rng = RNGState(numpy=False)
    state = rng.state_dict()
    assert "numpy" not in state
    np.random.rand()
    before = np.random.get_state()[1].copy()
    rng.load_state_dict(state)
    assert np.array_equal(np.random.get_state()[1], before)


def test_missing_source_or_generator_is_a_clear_error():
    state = RNGState(torch=False).state_dict()
    with pytest.raises(KeyError, match="torch"):
        RNGState().load_state_dict(state)
    with pytest.raises(KeyError, match="dropout"):
        RNGState({"dropout": torch.Generator()}).load_state_dict(RNGState().state_dict())


def test_a_saved_generator_this_run_did_not_register_is_named_in_a_warning():
    """A resume that forgot to register a generator would restart its stream from the seed in silence."""
    state = RNGState({"aug": np.random.default_rng(1), "noise": torch.Generator()}).state_dict()
    with pytest.warns(RuntimeWarning, match=r"generators \['aug'\] this run did not register"):
        RNGState({"noise": torch.Generator()}).load_state_dict(state)


def test_generator_kind_mismatch_and_unsupported_type():
    state = RNGState({"g": random.Random(0)}).state_dict()
    with pytest.raises(TypeError, match="'generators.g' does not restore: .*python.*torch"):
        RNGState({"g": torch.Generator()}).load_state_dict(state)
    with pytest.raises(TypeError, match="RandomState"):
        RNGState({"legacy": np.random.RandomState(0)})


def test_a_system_random_is_refused_where_it_is_registered():
    """random.SystemRandom is a random.Random without state: it was registered, and the first save failed with
    "System entropy source does not have state", far from the line that registered it."""
    with pytest.raises(TypeError, match="cannot capture a SystemRandom 'entropy': it has no state"):
        RNGState({"entropy": random.SystemRandom()})


def test_a_refused_state_changes_no_rng_and_names_the_bit_generators():
    """A numpy generator of another bit generator is named as such (numpy said "state must be for a Philox PRNG"),
    and the global RNGs it would have been set after are left as they were (they had taken the checkpoint's)."""
    saved = RNGState({"noise": np.random.default_rng(0), "g": torch.Generator().manual_seed(1)})
    state = saved.state_dict()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    ours = RNGState({"noise": np.random.Generator(np.random.Philox(3)), "g": torch.Generator().manual_seed(5)})
    before = ours.state_dict()
    with pytest.raises(
        TypeError, match="'generators.noise' does not .*: checkpoint has a PCG64 bit generator, this run"
    ):
        ours.load_state_dict(state)
    after = ours.state_dict()
    assert after["python"] == before["python"] and torch.equal(after["torch"], before["torch"])
    assert torch.equal(after["generators"]["g"]["state"], before["generators"]["g"]["state"])
    assert json.dumps(after["numpy"], default=lambda a: a.tolist()) == json.dumps(
        before["numpy"], default=lambda a: a.tolist()
    )


PCG = {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0}
MT = {"bit_generator": "MT19937", "has_gauss": 0, "gauss": 0.0}  # a position past the key: the next draw segfaulted
PHILOX = np.random.Philox(0).state  # so did one before its buffer


@pytest.mark.parametrize(
    "key, entry, said",
    [
        ("python", {"version": 3, "state": [1, 2], "gauss_next": None}, "state vector is the wrong size"),
        ("python", {"version": 3, "state": [1.5] * 625, "gauss_next": None}, "'state' must be ints, got float 1.5"),
        ("python", {"version": 3, "state": [1] * 625, "gauss_next": "x"}, "'gauss_next' must be a float or None"),
        ("numpy", {"bit_generator": "MT19937"}, "state dictionary is not valid"),
        ("torch", torch.zeros(3, dtype=torch.uint8), "size 5056"),
        ("generators.a", {"state": {}}, "KeyError: 'kind'"),
        ("generators.n", {"kind": "numpy", "state": {**PCG, "state": {"state": -1, "inc": 1}}}, "OverflowError"),
        ("generators.n", {"kind": "numpy", "state": {**PCG, "state": {"state": 2**200, "inc": 1}}}, "OverflowError"),
        ("generators.n", {"kind": "numpy", "state": {**PCG, "state": {"state": 1, "inc": "x"}}}, "TypeError"),
        ("generators.a", 5, "TypeError: 'int' object is not subscriptable"),
        ("numpy", {**MT, "state": {"key": np.zeros(624, np.uint32), "pos": 10**6}}, r"'state.pos' must .* 1000000"),
        ("generators.p", {"kind": "numpy", "state": {**PHILOX, "buffer_pos": -(10**6)}}, r"'buffer_pos' must"),
        (
            "generators.m",
            {"kind": "numpy", "state": {**MT, "state": {"key": np.zeros(624, np.uint32), "pos": -1}}},
            "'state.pos' must be an int in \\[0, 624\\], got -1",
        ),
        ("torch", np.zeros(5056, dtype=np.uint8), "TypeError: expected a uint8 tensor, got ndarray"),
    ],
)
def test_an_entry_an_rng_refuses_is_an_error_naming_its_key(key, entry, said):
    """A malformed or foreign entry was refused with the RNG's own words, naming no entry: numpy's "state dictionary
    is not valid.", torch's "Expected a CPUGeneratorImplState of size 5056", python's "state vector is the wrong
    size", a bare KeyError 'kind', numpy's OverflowError or TypeError of a field past uint64 or of another type.
    The error names the key (a TypeError stays one); nothing changes."""
    ours = RNGState(
        {
            "a": random.Random(1),
            "n": np.random.default_rng(1),
            "m": np.random.Generator(np.random.MT19937(2)),
            "p": np.random.Generator(np.random.Philox(3)),
        },
        cuda=False,
    )
    state = ours.state_dict()
    if key.startswith("generators."):
        state["generators"][key.split(".")[1]] = entry
    else:
        state[key] = entry
    before = torch.get_rng_state()
    with pytest.raises((TypeError, ValueError), match=rf"RNG state '{key}' does not restore: .*{said}"):
        ours.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), before)


def test_state_of_another_rank_loads_as_given():
    """Which rank's state a rank gets is the manager's mapping (modulo the saved world size), not refused here."""
    assert RNGState.per_rank is True
    state = RNGState().state_dict()
    expected = torch.rand(3)
    state["rank"], state["world_size"] = 3, 4
    RNGState().load_state_dict(state)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only device count")
def test_cuda_device_count_mismatch_is_refused():
    state = RNGState().state_dict()
    assert state["cuda"] == []
    state["cuda"] = [torch.get_rng_state()]
    with pytest.raises(ValueError, match="1 CUDA devices, this process sees 0"):
        RNGState().load_state_dict(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trap_every_cuda_device_is_captured():
    devices = range(torch.cuda.device_count())
    for d in devices:
        torch.cuda.manual_seed_all(0)
        torch.rand(d + 1, device=f"cuda:{d}")  # each device at its own position
    rng = RNGState()
    state = rng.state_dict()
    expected = [torch.rand(4, device=f"cuda:{d}").cpu() for d in devices]
    rng.load_state_dict(state)
    assert all(torch.equal(torch.rand(4, device=f"cuda:{d}").cpu(), e) for d, e in zip(devices, expected))
