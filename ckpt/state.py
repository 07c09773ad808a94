"""Training state <-> (JSON tree with type tags, named tensors), without pickle.

A state is a nested dict whose leaves are tensors, numpy arrays, JSON-able values, or `Stateful` objects
(anything with `state_dict()`/`load_state_dict()`: modules, optimizers, schedulers, scalers, samplers).
Tensors become references ``{"$tensor": name}`` into the arrays of a checkpoint; every other leaf is
JSON with explicit tags so tuples, int keys, non-finite floats and bytes survive a round trip exactly.
"""

from __future__ import annotations

import base64
import math
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from .errors import CorruptCheckpointError, StateKeyError
from .format import MAX_DEPTH, ArrayInfo, escape_segment

_TAGS = (
    "$tensor",
    "$ndarray",
    "$float",
    "$tuple",
    "$size",
    "$dict",
    "$odict",
    "$bytes",
    "$np",
    "$dtype",
    "$state",
    "$per_rank",
)
# Tags whose node holds a value under "v" besides the tag; every other tag is the node's only key.
_WITH_V = ("$np", "$state")
_TORCH_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
_NP_SCALAR = re.compile(r"^[<>|=]?([biufcUS])(\d{1,6})$")  # numpy scalar dtypes with an exact JSON form


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
        ident = (
            local.untyped_storage().data_ptr(),
            local.storage_offset(),
            tuple(t.shape),
            local.stride(),
            t.dtype,
            t.device,
        )
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

    def enc(x: Any, path: list[str], key: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"value at key {key!r} is nested deeper than {MAX_DEPTH} levels (does it contain itself?)")
        if isinstance(x, torch.Tensor):
            _check_dense(x, key)
            return tensor_ref(x.detach(), path, "$tensor")
        if isinstance(x, np.ndarray):
            if x.dtype == object:
                raise TypeError(f"numpy array at key {key!r} has dtype object, which cannot be saved without pickle")
            ref = tensor_ref(torch.from_numpy(np.ascontiguousarray(x)), path, "$ndarray")
            flat.numpy_names.add(ref["$ndarray"])
            return ref
        if isinstance(x, np.generic):  # first: np.float64, np.str_ and np.bytes_ are also float, str and bytes
            return _np_scalar(x, key)
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return _float(x)
        if isinstance(x, bytes):
            return {"$bytes": base64.b64encode(x).decode()}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.Size):
            return {"$size": list(x)}
        if isinstance(x, tuple):
            return {"$tuple": [enc(v, path + [str(i)], f"{key}.{i}", depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, path + [str(i)], f"{key}.{i}", depth + 1) for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(
                        f"dict at key {key!r} has a key {k!r} of type {type(k).__name__}; only str and int keys are supported"
                    )
                items.append((k, enc(v, path + [escape_segment(k)], f"{key}.{k}" if key else str(k), depth + 1)))
            if isinstance(x, OrderedDict):
                return {"$odict": [[k, v] for k, v in items]}
            if all(isinstance(k, str) and not k.startswith("$") for k, _ in items):
                return dict(items)
            return {"$dict": [[k, v] for k, v in items]}
        if is_stateful(x):
            return {"$state": type(x).__qualname__, "v": enc(x.state_dict(), path, key, depth + 1)}
        raise TypeError(
            f"value at key {key!r} has type {type(x).__module__}.{type(x).__qualname__}, which cannot be "
            f"saved: use tensors, JSON values (None/bool/int/float/str/list/tuple/dict), numpy arrays, "
            f"or an object with state_dict()/load_state_dict()"
        )

    tree = {}
    for k, v in state.items():
        if not isinstance(k, str) or k.startswith("$"):
            raise TypeError(f"top-level state keys must be str not starting with '$', got {k!r}")
        if is_per_rank(v):
            tree[k] = per_rank_node([[rank, enc(v, [escape_segment(k), f"rank_{rank:05d}"], k)]])
        else:
            tree[k] = enc(v, [escape_segment(k)], k)
    flat.tree = tree
    return flat


def _check_dense(t: torch.Tensor, key: str) -> None:
    """Only dense tensors with data have an on-disk form; say which key holds one that has not."""
    what = (
        "a nested tensor"
        if t.is_nested
        else f"a {t.layout} (sparse) tensor"
        if t.layout != torch.strided
        else "a meta tensor (it has no data)"
        if t.is_meta
        else None
    )
    if what:
        raise TypeError(
            f"tensor at key {key!r} is {what}: only dense tensors with data can be saved "
            f"(convert it first, e.g. with .to_dense() or .unbind())"
        )


def _float(x: float) -> Any:
    return float(x) if math.isfinite(x) else {"$float": repr(float(x))}


def _np_exact(dtype: np.dtype) -> bool:
    """A numpy scalar dtype with an exact portable JSON form (not longdouble, datetime, object...)."""
    m = _NP_SCALAR.match(dtype.str)
    return (
        bool(m) and not (m.group(1) == "f" and dtype.itemsize > 8) and not (m.group(1) == "c" and dtype.itemsize > 16)
    )


def encodable(x: Any) -> bool:
    """True for a leaf value the tree has an exact form for: None, bool, int, float, str, bytes, a torch dtype or
    Size, a tensor, a numpy array (not of objects), a numpy scalar of a portable dtype.

    Containers (list, tuple, dict) and Stateful objects are encoded through what they hold; `flatten` still checks a
    tensor's content (dense, with data, a dtype with an on-disk form) and raises naming the key.
    """
    if isinstance(x, np.generic):
        return _np_exact(x.dtype)
    if isinstance(x, np.ndarray):
        return x.dtype != object
    return x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.Size, torch.Tensor))


def _np_scalar(x: np.generic, key: str) -> dict[str, Any]:
    """A numpy scalar with its exact dtype; kinds without a portable exact form (longdouble...) are refused."""
    if not _np_exact(x.dtype):
        raise TypeError(
            f"value at key {key!r} is a numpy {type(x).__name__} scalar ({x.dtype}), which has no exact "
            f"portable form: convert it (e.g. to np.float64, or to a str)"
        )
    v = x.item()
    value = (
        [_float(v.real), _float(v.imag)]
        if isinstance(v, complex)
        else _float(v)
        if isinstance(v, float)
        else {"$bytes": base64.b64encode(v).decode()}
        if isinstance(v, bytes)
        else v
    )
    return {"$np": x.dtype.str, "v": value}


# The kinds of node of a checked tree: what every reader of a tree (restore, the CLI) sees of its tags.
TENSOR = "tensor"  # a reference to an array: {"$tensor": name} or {"$ndarray": name}
MAPPING = "mapping"  # a dict: plain (str keys), {"$dict": [[k, v]...]} or {"$odict": [[k, v]...]}
SEQUENCE = "sequence"  # a list, or {"$tuple": [...]}
STATE = "state"  # a Stateful object's state_dict: {"$state": type name, "v": tree}
PER_RANK = "per_rank"  # one tree per rank, top level only: {"$per_rank": [[rank, tree]...]}
VALUE = "value"  # a JSON scalar or a tagged one ($float, $size, $bytes, $np, $dtype)


class Node(NamedTuple):
    """One node of a checked tree as the grammar reads it."""

    kind: str  # TENSOR, MAPPING, SEQUENCE, STATE, PER_RANK or VALUE
    children: list[tuple[Any, Any]]  # (key, subtree): dict keys, list indexes, ranks; a state's one tree: key None
    name: str | None = None  # TENSOR: the array's name; STATE: the object's type name


def node_of(tree: Any) -> Node:
    """How the grammar reads one node of a checked tree (see `check_tree`)."""
    if isinstance(tree, list):
        return Node(SEQUENCE, list(enumerate(tree)))
    tag = _tag(tree) if isinstance(tree, dict) else VALUE
    if tag is None:
        return Node(MAPPING, list(tree.items()))
    if tag in ("$dict", "$odict"):
        return Node(MAPPING, [(k, v) for k, v in tree[tag]])
    if tag == "$tuple":
        return Node(SEQUENCE, list(enumerate(tree[tag])))
    if tag in ("$tensor", "$ndarray"):
        return Node(TENSOR, [], tree[tag])
    if tag == "$state":
        return Node(STATE, [(None, tree["v"])], tree[tag])
    if tag == "$per_rank":
        return Node(PER_RANK, [(rank, sub) for rank, sub in tree[tag]])
    return Node(VALUE, [])


def walk(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Node]]:
    """Every node of a checked tree, depth first, with its key path (a state's tree has its object's path)."""
    n = node_of(tree)
    yield path, n
    for k, sub in n.children:
        yield from walk(sub, path if k is None and n.kind == STATE else (*path, k))


def per_rank_entries(tree: Mapping[str, Any]) -> dict[str, list[list[Any]]]:
    """The top-level per-rank nodes of a tree: key -> [[rank, tree]...] (what this rank contributes)."""
    nodes = {k: node_of(v) for k, v in tree.items()}
    return {k: [[rank, sub] for rank, sub in n.children] for k, n in nodes.items() if n.kind == PER_RANK}


def per_rank_node(entries: list[list[Any]]) -> dict[str, Any]:
    """A per-rank node of `entries` ([[rank, tree]...], e.g. every rank's once gathered)."""
    return {"$per_rank": entries}


def select_rank(tree: Any, rank: int, saved_world: int, world: int, rank_map: str) -> Any | None:
    """The entry of a per-rank node this rank restores: its own on the same world size; on another,
    rank ``rank % saved_world`` ("modulo") or nothing ("skip", the caller keeps its current state)."""
    entries = {int(r): sub for r, sub in node_of(tree).children}
    if world == saved_world:
        return entries.get(rank)
    if rank_map == "skip":
        return None
    return entries.get(rank % saved_world)


def tensor_refs(tree: Any) -> list[str]:
    """The array names a checked tree refers to, in order, with repetitions for aliases."""
    return [n.name for _, n in walk(tree) if n.kind == TENSOR]


def check_tree(tree: dict[str, Any], arrays: Mapping[str, ArrayInfo], *, file: str) -> None:
    """Validate a manifest's tree before anything is read: known tags, well-formed values, bounded depth,
    per-rank entries only at the top, every tensor reference listed in `arrays`. Raises CorruptCheckpointError."""

    def bad(what: str, key: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"malformed state tree in manifest: {what}", key=key or None, file=file)

    def check(node: Any, key: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH} levels", key)
        if node is None or isinstance(node, (bool, int, str)) or (isinstance(node, float) and math.isfinite(node)):
            return
        if isinstance(node, list):
            for i, v in enumerate(node):
                check(v, f"{key}.{i}", depth + 1)
            return
        if not isinstance(node, dict):
            raise bad(f"unexpected value {node!r}", key)
        tag = _tag(node)
        if tag is None:
            if any(k.startswith("$") for k in node):
                raise bad(f"unknown tag in {sorted(node)}", key)
            for k, v in node.items():
                check(v, _join(key, k), depth + 1)
            return
        if set(node) != ({tag, "v"} if tag in _WITH_V else {tag}):
            raise bad(f"{tag} node has keys {sorted(node)}", key)
        v = node[tag]
        ok = {
            "$tensor": lambda: isinstance(v, str) and v in arrays,
            "$ndarray": lambda: isinstance(v, str) and v in arrays,
            "$float": lambda: v in ("nan", "inf", "-inf"),
            "$tuple": lambda: isinstance(v, list),
            "$size": lambda: isinstance(v, list) and all(type(n) is int and n >= 0 for n in v),
            "$dict": lambda: _pairs(v),
            "$odict": lambda: _pairs(v),
            "$bytes": lambda: isinstance(v, str) and _b64(v) is not None,
            "$np": lambda: _np_value(node) is not None,
            "$dtype": lambda: isinstance(v, str) and v in _TORCH_DTYPES,
            "$state": lambda: isinstance(v, str),
            "$per_rank": lambda: False,
        }[tag]
        if not ok():
            raise bad(
                f"bad {tag} value {str(v)[:100]!r}"
                + (" (not a listed array)" if tag in ("$tensor", "$ndarray") else "")
                + (" (per-rank entries are top-level only)" if tag == "$per_rank" else ""),
                key,
            )
        children = (
            [x for _, x in v]
            if tag in ("$dict", "$odict")
            else v
            if tag == "$tuple"
            else [node["v"]]
            if tag == "$state"
            else []
        )
        for i, x in enumerate(children):
            check(x, f"{key}.{i}", depth + 1)

    for k, node in tree.items():
        if k.startswith("$"):
            raise bad("top-level key starts with '$'", k)
        if isinstance(node, dict) and _tag(node) == "$per_rank":
            entries = node["$per_rank"]
            if (
                set(node) != {"$per_rank"}
                or not isinstance(entries, list)
                or not all(isinstance(e, list) and len(e) == 2 and type(e[0]) is int and e[0] >= 0 for e in entries)
            ):
                raise bad("$per_rank must be a list of [rank, tree]", k)
            for rank, sub in entries:
                check(sub, f"{k}.rank{rank}", 1)
        else:
            check(node, k, 0)


def _tag(node: dict) -> str | None:
    return next((k for k in node if k in _TAGS), None)


def _join(key: str, k: Any) -> str:
    return f"{key}.{k}" if key else str(k)


def _pairs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and type(p[0]) in (str, int) for p in v)


def _b64(v: str) -> bytes | None:
    try:
        return base64.b64decode(v, validate=True)
    except ValueError:
        return None


def _np_value(node: dict) -> np.generic | None:
    """The numpy scalar of a ``$np`` node, or None when the node is malformed."""
    m = _NP_SCALAR.match(node["$np"]) if isinstance(node["$np"], str) else None
    try:
        dt = np.dtype(node["$np"]) if m else None
    except TypeError:  # e.g. "<f3"
        dt = None
    if dt is None or dt.kind != m.group(1):
        return None
    v, kind = node["v"], dt.kind
    if isinstance(v, dict) and set(v) == {"$float"} and v["$float"] in ("nan", "inf", "-inf"):
        v = float(v["$float"])
    elif isinstance(v, dict) and set(v) == {"$bytes"} and isinstance(v["$bytes"], str):
        v = _b64(v["$bytes"])
    elif kind == "c" and isinstance(v, list) and len(v) == 2:
        parts = [
            float(x["$float"]) if isinstance(x, dict) and x.get("$float") in ("nan", "inf", "-inf") else x for x in v
        ]
        v = complex(*parts) if all(type(x) in (int, float) for x in parts) else None
    expected = {"b": (bool,), "i": (int,), "u": (int,), "f": (int, float), "c": (complex,), "U": (str,), "S": (bytes,)}[
        kind
    ]
    if type(v) not in expected or dt.itemsize > (16 if kind == "c" else 8 if kind in "biuf" else 1 << 26):
        return None
    try:
        return dt.type(v)
    except (OverflowError, ValueError, TypeError):
        return None


def decode(
    node: Any, load: Callable[[str, Any, bool], Any], template: Any = None, key: str = "", strict: bool = False
) -> Any:
    """Rebuild a value from a checked JSON tree; `load(name, template, as_numpy)` returns the array for a reference.

    `template` is the value currently at this position in the caller's state (or its state_dict for
    Stateful objects), so tensors can be read in place into the caller's memory. With `strict`, a dict of
    the caller's state must hold exactly the checkpoint's keys, else a StateKeyError names the key path. Below a
    Stateful object only an nn.Module's keys are compared (its load_state_dict would refuse a mismatch,
    but only after loading the rest); other objects' load_state_dict judge their own state.
    """
    if is_stateful(template):
        strict = isinstance(template, torch.nn.Module)
        template = template.state_dict()
    if isinstance(node, list):
        tl = template if isinstance(template, (list, tuple)) and len(template) == len(node) else [None] * len(node)
        return [decode(v, load, t, f"{key}.{i}", strict) for i, (v, t) in enumerate(zip(node, tl))]
    if not isinstance(node, dict):
        return node
    tag = _tag(node)
    if tag in (None, "$dict", "$odict"):
        pairs = list(node.items()) if tag is None else [(k, v) for k, v in node[tag]]
        if strict and isinstance(template, Mapping):
            _same_keys([k for k, _ in pairs], list(template), key)
        return (OrderedDict if tag == "$odict" else dict)(
            (k, decode(v, load, _child(template, k), _join(key, k), strict)) for k, v in pairs
        )
    v = node[tag]
    if tag in ("$tensor", "$ndarray"):
        return load(v, template, tag == "$ndarray")
    if tag == "$float":
        return float(v)
    if tag == "$tuple":
        tl = template if isinstance(template, (list, tuple)) and len(template) == len(v) else [None] * len(v)
        return tuple(decode(x, load, t, f"{key}.{i}", strict) for i, (x, t) in enumerate(zip(v, tl)))
    if tag == "$size":
        return torch.Size(v)
    if tag == "$bytes":
        return base64.b64decode(v, validate=True)
    if tag == "$np":
        return _np_value(node)
    if tag == "$dtype":
        return _TORCH_DTYPES[v]
    return decode(node["v"], load, template, key, strict)  # "$state": a Stateful object's state_dict


def _same_keys(saved: list[Any], current: list[Any], key: str) -> None:
    saved_set, current_set = set(saved), set(current)
    extra, missing = [k for k in saved if k not in current_set], [k for k in current if k not in saved_set]
    if extra or missing:
        raise StateKeyError(
            "restore: "
            + "; ".join(
                [f"key {_join(key, k)!r} is in the checkpoint but not in the state passed to restore" for k in extra]
                + [
                    f"key {_join(key, k)!r} is in the state passed to restore but not in the checkpoint"
                    for k in missing
                ]
            )
        )


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
