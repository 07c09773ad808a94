"""Training state <-> (JSON tree with type tags, named tensors), without pickle.

A state is a nested dict whose leaves are tensors, numpy arrays, JSON-able values, or `Stateful` objects
(anything with `state_dict()`/`load_state_dict()`: modules, optimizers, schedulers, scalers, samplers).
Tensors become references ``{"$tensor": name}`` into the arrays of a checkpoint; every other leaf is
JSON with explicit tags so tuples, int keys, non-finite floats and bytes survive a round trip exactly.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import sys

import numpy as np
import torch

from .errors import CorruptCheckpointError
from .format import escape_segment, validate_array_name

_TAGS = ("$tensor", "$ndarray", "$float", "$tuple", "$dict", "$bytes", "$np", "$dtype", "$state", "$per_rank")


@runtime_checkable
class Stateful(Protocol):
    """An object whose state is a tree of tensors and JSON values (modules, optimizers, samplers...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_dtensor(t: Any) -> bool:
    """True for a DTensor; never imports torch.distributed.tensor (~1 s) when nothing made one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_per_rank(x: Any) -> bool:
    """Stateful objects whose state differs per rank (RNG streams) declare `per_rank = True`."""
    return is_stateful(x) and bool(getattr(x, "per_rank", False))


def is_stateful(x: Any) -> bool:
    """True for objects to be saved through their state_dict (not for plain dicts)."""
    return not isinstance(x, (dict, torch.Tensor)) and isinstance(x, Stateful)


@dataclass
class Flat:
    """A state split into its JSON tree and its tensors by array name (aliases share one name)."""

    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    numpy_names: set[str] = field(default_factory=set)


def flatten(state: Mapping[str, Any], *, rank: int = 0) -> Flat:
    """Encode a state; calls `state_dict()` on Stateful leaves; tied tensors are stored once.

    A top-level per-rank entry becomes ``{"$per_rank": [[rank, tree]]}`` with its arrays under
    ``<key>/rank_<rank>/``, so every rank's copy can live side by side in one checkpoint.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of named entries, got {type(state).__name__}")
    flat = Flat(tree=None)
    seen: dict[tuple, str] = {}

    def tensor_ref(t: torch.Tensor, path: list[str], tag: str) -> dict[str, str]:
        local = t.to_local() if is_dtensor(t) else t
        ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape), local.stride(), t.dtype, t.device)
        if t.numel() and ident in seen:
            return {tag: seen[ident]}
        name = "/".join(path) or "%00"
        base, n = name, 1
        while name in flat.tensors:
            name, n = f"{base}~{n}", n + 1
        flat.tensors[name] = t
        if t.numel():
            seen[ident] = name
        return {tag: name}

    def enc(x: Any, path: list[str], key: str) -> Any:
        if isinstance(x, torch.Tensor):
            return tensor_ref(x.detach(), path, "$tensor")
        if isinstance(x, np.ndarray):
            if x.dtype == object:
                raise TypeError(f"numpy array at key {key!r} has dtype object, which cannot be saved without pickle")
            ref = tensor_ref(torch.from_numpy(np.ascontiguousarray(x)), path, "$ndarray")
            flat.numpy_names.add(ref["$ndarray"])
            return ref
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x) if math.isfinite(x) else {"$float": repr(float(x))}
        if isinstance(x, np.generic):
            if isinstance(x, (np.object_, np.void)):
                raise TypeError(f"value at key {key!r} is a numpy {x.dtype} scalar, which has no JSON form")
            return {"$np": x.dtype.str, "v": enc(x.item(), path, key)}
        if isinstance(x, bytes):
            return {"$bytes": base64.b64encode(x).decode()}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        if isinstance(x, tuple):
            return {"$tuple": [enc(v, path + [str(i)], f"{key}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, path + [str(i)], f"{key}.{i}") for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"dict at key {key!r} has a key {k!r} of type {type(k).__name__}; only str and int keys are supported")
                items.append((k, enc(v, path + [escape_segment(k)], f"{key}.{k}" if key else str(k))))
            if all(isinstance(k, str) and not k.startswith("$") for k, _ in items):
                return dict(items)
            return {"$dict": [[k, v] for k, v in items]}
        if is_stateful(x):
            return {"$state": type(x).__qualname__, "v": enc(x.state_dict(), path, key)}
        raise TypeError(f"value at key {key!r} has type {type(x).__module__}.{type(x).__qualname__}, which cannot be "
                        f"saved: use tensors, JSON values (None/bool/int/float/str/list/tuple/dict), numpy arrays, "
                        f"or an object with state_dict()/load_state_dict()")

    tree = {}
    for k, v in state.items():
        if not isinstance(k, str) or k.startswith("$"):
            raise TypeError(f"top-level state keys must be str not starting with '$', got {k!r}")
        if is_per_rank(v):
            tree[k] = {"$per_rank": [[rank, enc(v, [escape_segment(k), f"rank_{rank:05d}"], k)]]}
        else:
            tree[k] = enc(v, [escape_segment(k)], k)
    flat.tree = tree
    return flat


def select_rank(node: Any, rank: int, saved_world: int, world: int, rank_map: str) -> Any | None:
    """The entry of a per-rank node this rank restores: its own on the same world size; on another,
    rank ``rank % saved_world`` ("modulo") or nothing ("skip", the caller keeps its current state)."""
    entries = {int(r): tree for r, tree in node["$per_rank"]}
    if world == saved_world:
        return entries.get(rank)
    if rank_map == "skip":
        return None
    return entries.get(rank % saved_world)


def tensor_refs(tree: Any) -> list[str]:
    """The array names a JSON tree refers to, in order, with repetitions for aliases."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$tensor", node.get("$ndarray"))
            if isinstance(ref, str):
                out.append(ref)
                return
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(tree)
    return out


def decode(node: Any, load: Callable[[str, Any], torch.Tensor], template: Any = None, key: str = "") -> Any:
    """Rebuild a value from its JSON tree; `load(name, template_tensor)` returns the tensor for a reference.

    `template` is the value currently at this position in the caller's state (or its state_dict for
    Stateful objects), so tensors can be read in place into the caller's memory.
    """
    if is_stateful(template):
        template = template.state_dict()
    if isinstance(node, list):
        tl = template if isinstance(template, (list, tuple)) and len(template) == len(node) else [None] * len(node)
        return [decode(v, load, t, f"{key}.{i}") for i, (v, t) in enumerate(zip(node, tl))]
    if not isinstance(node, dict):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise CorruptCheckpointError(f"unexpected JSON value of type {type(node).__name__}", key=key)
    tags = [k for k in node if k in _TAGS]
    if not tags:
        return {k: decode(v, load, _child(template, k), f"{key}.{k}" if key else k) for k, v in node.items()}
    tag = tags[0]
    v = node[tag]
    if tag in ("$tensor", "$ndarray"):
        t = load(validate_array_name(v), template)
        return t.numpy() if tag == "$ndarray" else t
    if tag == "$float":
        if v not in ("nan", "inf", "-inf"):
            raise CorruptCheckpointError(f"bad $float value {v!r}", key=key)
        return float(v)
    if tag == "$tuple":
        tl = template if isinstance(template, (list, tuple)) and len(template) == len(v) else [None] * len(v)
        return tuple(decode(x, load, t, f"{key}.{i}") for i, (x, t) in enumerate(zip(v, tl)))
    if tag == "$dict":
        out = {}
        for pair in v:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))):
                raise CorruptCheckpointError("malformed $dict entry", key=key)
            k = pair[0]
            out[k] = decode(pair[1], load, _child(template, k), f"{key}.{k}" if key else str(k))
        return out
    if tag == "$bytes":
        return base64.b64decode(v, validate=True)
    if tag == "$np":
        return np.dtype(v).type(decode(node["v"], load, None, key))
    if tag == "$dtype":
        dt = getattr(torch, str(v), None)
        if not isinstance(dt, torch.dtype):
            raise CorruptCheckpointError(f"unknown dtype {v!r}", key=key)
        return dt
    if tag == "$per_rank":
        raise CorruptCheckpointError("per-rank entry below the top level of the state", key=key)
    return decode(node["v"], load, template, key)  # "$state": a Stateful object's state_dict


def _child(template: Any, k: Any) -> Any:
    return template.get(k) if isinstance(template, Mapping) else None


def apply(target: dict[str, Any], key: str, value: Any) -> None:
    """Put a restored value into the caller's state: Stateful objects load it, tensors are copied in place."""
    current = target.get(key)
    if is_stateful(current):
        current.load_state_dict(value)
    elif isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current.shape == value.shape:
        if current.data_ptr() != value.data_ptr():
            current.copy_(value)
    elif isinstance(current, dict) and isinstance(value, dict):
        for k, v in value.items():
            apply(current, k, v)
    else:
        target[key] = value
