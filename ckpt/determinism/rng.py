"""Capture and restore of every RNG a training process draws from, as tensors, numpy arrays and JSON (no pickle)."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Union

import numpy as np
import torch

from ..distributed import topology

Generator = Union[random.Random, np.random.Generator, torch.Generator]


def _python_capture(rng: Any) -> dict[str, Any]:
    """A `random.Random` (or the `random` module) state as JSON: version, 625 ints, cached gauss."""
    version, internal, gauss_next = rng.getstate()
    return {"version": version, "state": list(internal), "gauss_next": gauss_next}


def _python_restore(rng: Any, state: Mapping[str, Any]) -> None:
    """Inverse of `_python_capture`; a word that is no int (a float was truncated) or a cached gauss that is no float
    (it failed at the next `gauss()`) is a TypeError, which `_entry` names."""
    words, gauss = state["state"], state["gauss_next"]
    bad = next((x for x in words if isinstance(x, bool) or not isinstance(x, (int, np.integer))), None)
    if bad is not None:
        raise TypeError(f"'state' must be ints, got {type(bad).__name__} {bad!r}")
    if gauss is not None and (isinstance(gauss, bool) or not isinstance(gauss, (float, int))):
        raise TypeError(f"'gauss_next' must be a float or None, got {type(gauss).__name__} {gauss!r}")
    rng.setstate((state["version"], tuple(int(x) for x in words), gauss))


def _numpy_capture(state: Mapping[str, Any]) -> dict[str, Any]:
    """A numpy bit-generator state dict with its arrays copied (ints, strings and uint arrays only)."""
    return {
        k: _numpy_capture(v) if isinstance(v, Mapping) else (v.copy() if isinstance(v, np.ndarray) else v)
        for k, v in state.items()
    }


# bit generator -> (where its position into its buffer is, its largest value): numpy takes any position, and the
# next draw reads outside the buffer (a segfault: MT19937 at pos 10**6, Philox at buffer_pos -10**6)
_POSITIONS = {"MT19937": (("state", "pos"), 624), "Philox": (("buffer_pos",), 4)}


def _numpy_state(state: Any) -> Any:
    """A numpy bit-generator state, its buffer position checked (`_POSITIONS`); a ValueError (`_entry` names the
    key)."""
    found = _POSITIONS.get(state.get("bit_generator")) if isinstance(state, Mapping) else None
    if found is None:
        return state
    (*parents, field), end = found
    inner = state
    for key in parents:
        inner = inner.get(key) if isinstance(inner, Mapping) else None
    if isinstance(inner, Mapping) and field in inner:  # without one numpy refuses it itself
        pos = inner[field]
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not 0 <= pos <= end:
            where = ".".join([*parents, field])
            raise ValueError(f"a {state['bit_generator']} state's {where!r} must be an int in [0, {end}], got {pos!r}")
    return state


def _byte_tensor(value: Any) -> torch.Tensor:
    """A torch RNG state as the CPU uint8 tensor torch expects, or a TypeError (`_entry` names the key)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 tensor, got {type(value).__name__} {getattr(value, 'dtype', '')}")
    return value.to("cpu").contiguous()


def _kind(generator: Any) -> str:
    """'python', 'numpy' or 'torch' for a registrable generator; TypeError otherwise."""
    for kind, cls in (("python", random.Random), ("numpy", np.random.Generator), ("torch", torch.Generator)):
        if isinstance(generator, cls):
            return kind
    raise TypeError(
        f"cannot capture a {type(generator).__name__}: expected random.Random, numpy.random.Generator or torch.Generator"
    )


def _capture(generator: Generator) -> dict[str, Any]:
    """State of one registered generator, tagged with its kind."""
    kind = _kind(generator)
    if isinstance(generator, random.Random):
        return {"kind": kind, "state": _python_capture(generator)}
    if isinstance(generator, np.random.Generator):
        return {"kind": kind, "state": _numpy_capture(generator.bit_generator.state)}
    return {"kind": kind, "state": generator.get_state()}


def _restore(generator: Generator, saved: Mapping[str, Any]) -> None:
    """Put a registered generator back to its saved state; the saved kind must match (`_entry` names the key)."""
    kind = _kind(generator)
    if saved["kind"] != kind:
        raise TypeError(f"checkpoint has a {saved['kind']} generator, this run registered a {kind} one")
    if isinstance(generator, random.Random):
        _python_restore(generator, saved["state"])
    elif isinstance(generator, np.random.Generator):
        ours = generator.bit_generator.state["bit_generator"]
        theirs = saved["state"].get("bit_generator") if isinstance(saved["state"], Mapping) else None
        if theirs != ours:
            raise TypeError(f"checkpoint has a {theirs} bit generator, this run registered a {ours} one")
        generator.bit_generator.state = _numpy_state(saved["state"])
    else:
        generator.set_state(_byte_tensor(saved["state"]))


class RNGState:
    """Stateful entry for `CheckpointManager` state: python, numpy legacy, torch CPU, all CUDA devices, registered generators.

    Per rank: the manager stores every rank's copy and hands each rank its own back (on another world
    size, rank i gets rank ``i % saved_world_size``'s, or none with ``restore(..., rank_map="skip")``).
    """

    per_rank = True

    def __init__(
        self,
        generators: Mapping[str, Generator] | None = None,
        *,
        python: bool = True,
        numpy: bool = True,
        torch: bool = True,
        cuda: bool = True,
    ) -> None:
        self.sources = {"python": python, "numpy": numpy, "torch": torch, "cuda": cuda}
        self.generators: dict[str, Generator] = {}
        for name, generator in (generators or {}).items():
            self.register(name, generator)

    def register(self, name: str, generator: Generator) -> None:
        """Include a generator (sampler, dropout or augmentation generator) under a stable name."""
        _kind(generator)
        if isinstance(generator, random.SystemRandom):  # a random.Random whose getstate() raises
            raise TypeError(f"cannot capture a SystemRandom {name!r}: it has no state (it reads the OS's entropy)")
        self.generators[name] = generator

    def state_dict(self) -> dict[str, Any]:
        """Snapshot of every enabled source, this rank's only (RNG streams differ per rank)."""
        rank, world_size = topology()
        state: dict[str, Any] = {"rank": rank, "world_size": world_size}
        if self.sources["python"]:
            state["python"] = _python_capture(random)
        if self.sources["numpy"]:
            state["numpy"] = _numpy_capture(np.random.get_state(legacy=False))
        if self.sources["torch"]:
            state["torch"] = torch.get_rng_state()
        if self.sources["cuda"]:
            cuda = torch.cuda
            state["cuda"] = list(cuda.get_rng_state_all()) if cuda.is_available() else []
        state["generators"] = {name: _capture(g) for name, g in self.generators.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore every enabled source exactly, or raise and change nothing (a missing entry, another device count,
        a generator of another kind).

        Which rank's state arrives here is the manager's choice (see the class docstring).
        """
        wanted = [s for s, on in self.sources.items() if on] + ["generators"]
        missing = [key for key in wanted if key not in state]
        if missing:
            raise KeyError(f"RNG state lacks {missing}: it was saved with those sources disabled")
        unknown = sorted(set(self.generators) - set(state["generators"]))
        if unknown:
            raise KeyError(f"RNG state has no generator {unknown}; saved generators: {sorted(state['generators'])}")
        if self.sources["cuda"]:
            devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if len(state["cuda"]) != devices:
                raise ValueError(
                    f"RNG state 'cuda': checkpoint has {len(state['cuda'])} CUDA devices, this process sees {devices}"
                )
        before = self.state_dict()
        try:
            self._set(state)
        except BaseException:  # a state refused halfway (a generator of another kind, a malformed entry)
            self._set(before)
            raise
        dropped = sorted(set(state["generators"]) - set(self.generators))
        if dropped:  # a generator the run forgot to register would restart from its seed, not where it was
            warnings.warn(
                f"RNG state holds generators {dropped} this run did not register: they are not restored "
                f"(register them with RNGState({{name: generator}}) to continue their streams)",
                RuntimeWarning,
                stacklevel=2,
            )

    def _set(self, state: Mapping[str, Any]) -> None:
        """Set every enabled source and registered generator from a checked state, in order."""
        if self.sources["cuda"] and state["cuda"]:
            devices = []
            for i, saved in enumerate(state["cuda"]):
                with _entry(f"cuda.{i}"):
                    devices.append(_byte_tensor(saved))
            with _entry("cuda"):
                torch.cuda.set_rng_state_all(devices)
        if self.sources["python"]:
            with _entry("python"):
                _python_restore(random, state["python"])
        if self.sources["numpy"]:
            with _entry("numpy"):
                np.random.set_state(_numpy_state(state["numpy"]))
        if self.sources["torch"]:
            with _entry("torch"):
                torch.set_rng_state(_byte_tensor(state["torch"]))
        for name, generator in self.generators.items():
            with _entry(f"generators.{name}"):
                _restore(generator, state["generators"][name])


@contextlib.contextmanager
def _entry(key: str) -> Iterator[None]:
    """A refusal of a saved entry (numpy's "state dictionary is not valid.", torch's "Expected a
    CPUGeneratorImplState of size 5056", a field of another type or past uint64) as an error naming the entry: a
    TypeError (another kind of generator or state) as a TypeError, any other as a ValueError."""
    try:
        yield
    except (KeyError, ValueError, RuntimeError, IndexError, OverflowError, TypeError) as e:
        cls = TypeError if isinstance(e, TypeError) else ValueError
        raise cls(f"RNG state {key!r} does not restore: {type(e).__name__}: {e}") from e
