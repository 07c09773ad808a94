"""Training state <-> (JSON tree with type tags, named tensors), without pickle.

A state is a nested dict whose leaves are tensors, numpy arrays, JSON-able values, or `Stateful` objects
(anything with `state_dict()`/`load_state_dict()`: modules, optimizers, schedulers, scalers, samplers).
Tensors become references ``{"$tensor": name}`` into the arrays of a checkpoint; every other leaf is
JSON with explicit tags so tuples, int keys, non-finite floats and bytes survive a round trip exactly.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterator, Mapping, Protocol, runtime_checkable

import numpy as np
import torch

from .errors import StateKeyError, StateMismatchError
from .format import MAX_DEPTH, MAX_RANK, array_name, sibling_segments
from .tree import (  # noqa: F401 (the tree's grammar, importable here as before)
    _NP_SCALAR,
    MAPPING,
    PER_RANK,
    SEQUENCE,
    STATE,
    TENSOR,
    VALUE,
    Node,
    _b64,
    _join,
    _np_value,
    _tag,
    check_tree,
    node_of,
    per_rank_entries,
    per_rank_node,
    select_rank,
    skeleton,
    tensor_refs,
    torch_dtypes,
    walk,
)

_TORCH_DTYPES = torch_dtypes()


@runtime_checkable
class Stateful(Protocol):
    """An object whose state is a tree of tensors and JSON values (modules, optimizers, samplers...)."""

    def state_dict(self) -> dict[str, Any]:
        """The object's state: what `save` writes (tensors as arrays, the rest as typed JSON)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        """Take a restored state; raising refuses it, and the restore gives every object its state back."""
        ...


def is_dtensor(t: Any) -> bool:
    """True for a DTensor; never imports torch.distributed.tensor (~1 s) when nothing made one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_partial(t: Any) -> bool:
    """A DTensor with a Partial placement: a reduction still pending, each rank's local part one term of it, so no
    rank holds the value a save would write or a restore could place."""
    return is_dtensor(t) and any(p.is_partial() for p in t.placements)


def is_per_rank(x: Any) -> bool:
    """Stateful objects whose state differs per rank (RNG streams) declare `per_rank = True`."""
    return is_stateful(x) and bool(getattr(x, "per_rank", False))


def is_stateful(x: Any) -> bool:
    """True for objects to be saved through their state_dict (not for plain dicts, nor for a class, whose
    state_dict is a function wanting an object)."""
    return not isinstance(x, (dict, torch.Tensor, type)) and isinstance(x, Stateful)


@dataclass
class Flat:
    """A state split into its JSON tree and its tensors by array name (aliases share one name)."""

    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    numpy_names: set[str] = field(default_factory=set)
    agreed: dict[str, Any] = field(default_factory=dict)  # key -> encoded state of an object `same_on_every_rank`


_INT_BITS = 13_000  # about 3,900 decimal digits


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
        storage = local.untyped_storage()
        ident = (
            # an empty storage has no address (0 for all): a DTensor's empty shard is told apart by its storage object,
            # held by the tensor kept below, so Adam's two empty moments of a rank that holds no row stay two arrays
            storage.data_ptr() if storage.nbytes() else ("empty", id(storage)),
            local.storage_offset(),
            tuple(t.shape),
            local.stride(),
            t.dtype,
            t.device,
            t.is_conj(),  # a conjugate or negative view of a tensor is not that tensor
            t.is_neg(),
        )
        if t.numel() and ident in seen:
            return {tag: seen[ident]}
        name = array_name(path)
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
            if is_partial(x):
                raise TypeError(
                    f"DTensor at key {key!r} has placements {tuple(x.placements)}: a Partial placement is a reduction "
                    f"still pending (each rank holds one term); reduce it first, e.g. .redistribute(placements="
                    f"[Replicate()]) or .full_tensor()"
                )
            _check_storage(x, key)
            _check_rank(x.dim(), key)
            return tensor_ref(x.detach(), path, "$tensor")
        if isinstance(x, np.ndarray):
            if x.dtype == object:
                raise TypeError(f"numpy array at key {key!r} has dtype object, which cannot be saved without pickle")
            if isinstance(x, np.ma.MaskedArray):  # else saved as its data: the masked-out values would read as real
                raise TypeError(
                    f"numpy array at key {key!r} is a masked array: its mask would be lost; save its .data and "
                    f"np.ma.getmaskarray() as two arrays"
                )
            try:  # np.require keeps a 0-d array 0-d (np.ascontiguousarray makes it 1-d)
                as_tensor = torch.from_numpy(np.require(x, requirements="C"))
            except (TypeError, ValueError) as e:  # big-endian, strings, datetimes: torch's message names no key
                raise TypeError(f"numpy array at key {key!r} (dtype {x.dtype.str}) cannot be saved: {e}") from None
            _check_rank(x.ndim, key)
            ref = tensor_ref(as_tensor, path, "$ndarray")
            flat.numpy_names.add(ref["$ndarray"])
            return ref
        if isinstance(x, np.generic):  # first: np.float64, np.str_ and np.bytes_ are also float, str and bytes
            return _np_scalar(x, key)
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            if x.bit_length() > _INT_BITS:  # JSON reading refuses ints past 4,300 digits
                raise TypeError(f"int at key {key!r} has {x.bit_length()} bits: at most {_INT_BITS} can be saved")
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
            for k in x:
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(
                        f"dict at key {key!r} has a key {k!r} of type {type(k).__name__}; only str and int keys are supported"
                    )
                if isinstance(k, int) and k.bit_length() > _INT_BITS:  # as an int value: JSON reads no longer ones
                    raise TypeError(
                        f"dict at key {key!r} has an int key of {k.bit_length()} bits: at most {_INT_BITS} can be saved"
                    )
            items = [
                (k, enc(v, path + [seg], f"{key}.{k}" if key else str(k), depth + 1))
                for (k, v), seg in zip(x.items(), sibling_segments(list(x)))
            ]
            if isinstance(x, OrderedDict):
                return {"$odict": [[k, v] for k, v in items]}
            if all(isinstance(k, str) and not k.startswith("$") for k, _ in items):
                return dict(items)
            return {"$dict": [[k, v] for k, v in items]}
        if is_stateful(x):
            try:
                own = x.state_dict()
            except Exception as e:  # the object's own error, kept; with a note of where it is in the state
                e.add_note(f"raised by state_dict() of the {type(x).__name__} at key {key!r} of the state")
                raise
            node = {"$state": type(x).__qualname__, "v": enc(own, path, key, depth + 1)}
            if getattr(x, "same_on_every_rank", False):
                flat.agreed[key] = node
            return node
        what = f"is the class {_name(x)}" if isinstance(x, type) else f"has type {_name(type(x))}"
        raise TypeError(
            f"value at key {key!r} {what}, which cannot be "
            f"saved: use tensors, JSON values (None/bool/int/float/str/list/tuple/dict), numpy arrays, "
            f"or an object with state_dict()/load_state_dict()"
        )

    tree = {}
    for k in state:
        check_top_level_key(k)
    for (k, v), seg in zip(state.items(), sibling_segments(list(state))):
        if is_per_rank(v):
            tree[k] = per_rank_node([[rank, enc(v, [seg, f"rank_{rank:05d}"], k)]])
        else:
            tree[k] = enc(v, [seg], k)
    flat.tree = tree
    return flat


def _name(cls: type) -> str:
    """A class's full name, as an error names it (``torch.nn.modules.linear.Linear``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def save_skeleton(flat: Flat) -> list[str]:
    """What every rank of a save must share: the tree's `skeleton`, and the whole state of each object that declares
    `same_on_every_rank = True` (a data sampler: rank 0's is committed, so a rank at another position or with another
    skip list would resume on rank 0's, not its own)."""
    values = [f"{key} = {json.dumps(node, sort_keys=True)}" for key, node in flat.agreed.items()]
    return skeleton(flat.tree) + values


def check_top_level_key(k: Any) -> None:
    """TypeError unless `k` can be a top-level key of a state (a str not starting with '$', the tree's tags);
    ValueError for '', which `load(keys=)` and `export --keys` refuse to select (`--keys model,`)."""
    if not isinstance(k, str) or k.startswith("$"):
        raise TypeError(f"top-level state keys must be str not starting with '$', got {k!r}")
    if not k:
        raise ValueError(
            "key '' is empty: name the top-level key (load(keys=) and export --keys cannot select an empty one)"
        )


def _check_dense(t: torch.Tensor, key: str) -> None:
    """Only dense tensors with data have an on-disk form; say which key holds one that has not. A subclass that wraps
    other tensors (``__tensor_flatten__``: torchao's NF4 or float8 weights) has none of its own; DTensor is saved."""
    what = (
        "a nested tensor"
        if t.is_nested
        else f"a {t.layout} (sparse) tensor"
        if t.layout != torch.strided
        else "a meta tensor (it has no data)"
        if t.is_meta
        else f"a {type(t).__qualname__}, a tensor subclass that wraps other tensors (no data of its own)"
        if hasattr(t, "__tensor_flatten__") and not is_dtensor(t)
        else None
    )
    if what:
        raise TypeError(
            f"tensor at key {key!r} is {what}: only dense tensors with data can be saved "
            f"(convert it first, e.g. with .to_dense(), .unbind() or .dequantize(), or save the tensors it wraps)"
        )


def short_storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes its storage holds, bytes of it tensor `t` spans) when the storage no longer spans it (freed with
    ``untyped_storage().resize_(0)``, as FSDP frees a parameter between uses: a copy of it would crash the process,
    a segfault), else None. Runs inside the stall: a contiguous tensor's span costs no per-dimension sum."""
    have = t.untyped_storage().nbytes()
    if t.is_contiguous() and have >= (t.storage_offset() + t.numel()) * t.element_size():
        return None
    spans = 0
    if t.numel():
        last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        spans = (last + 1) * t.element_size()
    return (have, spans) if have < spans else None


def _check_storage(t: torch.Tensor, key: str) -> None:
    """A tensor whose storage no longer spans it is refused naming the key (`short_storage`). Only plain tensors and
    parameters: a wrapper subclass (DTensor) has no storage of its own to check."""
    short = short_storage(t) if type(t) in (torch.Tensor, torch.nn.Parameter) else None
    if short is not None:
        raise ValueError(
            f"tensor at key {key!r} has no data: its storage holds {short[0]} bytes of the {short[1]} it spans "
            "(freed, e.g. by FSDP between uses: save the state_dict FSDP gives)"
        )


def _check_rank(dims: int, key: str) -> None:
    """An array of more dimensions than a checkpoint holds (tensorstore's limit) fails the save naming its key: it
    committed a step every reader refused as damaged."""
    if dims > MAX_RANK:
        raise TypeError(
            f"array at key {key!r} has {dims} dimensions: a checkpoint holds at most {MAX_RANK} (reshape it first)"
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
    Size, a tensor, a numpy array (not of objects, not masked), a numpy scalar of a portable dtype.

    Containers (list, tuple, dict) and Stateful objects are encoded through what they hold; `flatten` still checks a
    tensor's content (dense, with data, a dtype with an on-disk form) and raises naming the key.
    """
    if isinstance(x, np.generic):
        return _np_exact(x.dtype)
    if isinstance(x, np.ndarray):
        return x.dtype != object and not isinstance(x, np.ma.MaskedArray)
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


def decode(
    node: Any,
    load: Callable[[str, Any, bool, str], Any],
    template: Any = None,
    key: str = "",
    strict: bool = False,
    state_of: Callable[[Any], Any] = lambda obj: obj.state_dict(),
) -> Any:
    """Rebuild a value from a checked JSON tree; `load(name, template, as_numpy, key)` returns the array for a reference
    (`key`: its dotted key path, for errors).

    `template` is the value currently at this position in the caller's state (for Stateful objects, what `state_of`
    gives: by default their state_dict), so tensors can be read in place into the caller's memory. With `strict`, a
    dict of the caller's state must hold exactly the checkpoint's keys, else a StateKeyError names the key path. Below a
    Stateful object only an nn.Module's keys are compared (its load_state_dict would refuse a mismatch,
    but only after loading the rest); other objects' load_state_dict judge their own state.
    """
    if is_stateful(template):
        own = isinstance(node, dict) and _tag(node) == "$state"  # else a plain state_dict that was saved as such
        judged = isinstance(template, (torch.nn.Module, torch.optim.Optimizer))  # whose state restore checks itself
        if not own and node_of(node).kind != MAPPING and (judged or node_of(node).kind == TENSOR):
            # a module's or optimizer's state is a dict: a number, a list... is another kind of value (their
            # load_state_dict refuses it naming no key); other objects' own load judges what is not a tensor
            raise StateMismatchError(
                f"restore: key {key!r} is {_a(type(template).__qualname__)} in the state passed to restore, but the "
                f"checkpoint holds {_kind(node)} there"
            )
        obj, strict = template, isinstance(template, torch.nn.Module)
        template = state_of(template)
        value = decode(node["v"] if own else node, load, template, key, strict, state_of)
        if isinstance(obj, torch.optim.Optimizer):
            _check_groups(value, template, key)
            _check_param_shapes(value, obj, key)
        return value
    in_state = strict and isinstance(template, torch.Tensor)  # not inside an object's own state: its load judges
    if in_state and not (isinstance(node, dict) and _tag(node) in ("$tensor", "$ndarray")):
        raise StateMismatchError(
            f"restore: key {key!r} is a tensor in the state passed to restore, but the checkpoint holds {_kind(node)}"
        )
    if isinstance(node, list):
        _check_length(template, len(node), key, strict)
        tl = template if isinstance(template, (list, tuple)) and len(template) == len(node) else [None] * len(node)
        return [decode(v, load, t, f"{key}.{i}", strict, state_of) for i, (v, t) in enumerate(zip(node, tl))]
    if not isinstance(node, dict):
        return node
    tag = _tag(node)
    if tag in (None, "$dict", "$odict"):
        pairs = list(node.items()) if tag is None else [(k, v) for k, v in node[tag]]
        if strict and isinstance(template, Mapping):
            _same_keys([k for k, _ in pairs], list(template), key)
        return (OrderedDict if tag == "$odict" else dict)(
            (k, decode(v, load, _child(template, k), _join(key, k), strict, state_of)) for k, v in pairs
        )
    v = node[tag]
    if tag in ("$tensor", "$ndarray"):
        return load(v, template, tag == "$ndarray", key)
    if tag == "$float":
        return float(v)
    if tag == "$tuple":
        _check_length(template, len(v), key, strict)
        tl = template if isinstance(template, (list, tuple)) and len(template) == len(v) else [None] * len(v)
        return tuple(decode(x, load, t, f"{key}.{i}", strict, state_of) for i, (x, t) in enumerate(zip(v, tl)))
    if tag == "$size":
        return torch.Size(v)
    if tag == "$bytes":
        return base64.b64decode(v, validate=True)
    if tag == "$np":
        return _np_value(node)
    if tag == "$dtype":
        return _TORCH_DTYPES[v]
    return decode(node["v"], load, template, key, strict, state_of)  # "$state": a Stateful object's state_dict


def _check_length(template: Any, saved: int, key: str, strict: bool) -> None:
    """A list or tuple of the caller's holding tensors or objects has the checkpoint's length: of another length
    it would be replaced, and what it holds would keep its values (a JSON list takes the checkpoint's)."""
    if strict and isinstance(template, (list, tuple)) and len(template) != saved and _holds_own(template):
        raise StateMismatchError(
            f"restore: key {key!r} is a {type(template).__name__} of {len(template)} in the state passed to restore, "
            f"holding tensors or objects that load in place, but the checkpoint's holds {saved}"
        )


def _holds_own(x: Any, seen: set[int] | None = None) -> bool:
    """The caller's value holds, at any depth, a tensor or an object that a restore fills in place (each container
    looked into once, so a value that contains itself ends)."""
    if is_stateful(x) or isinstance(x, torch.Tensor):
        return True
    seen = set() if seen is None else seen
    if not isinstance(x, (Mapping, list, tuple)) or id(x) in seen:
        return False
    seen.add(id(x))
    return any(_holds_own(v, seen) for v in (x.values() if isinstance(x, Mapping) else x))


def _kind(node: Any) -> str:
    """What a checkpoint's tree holds at a node, in words (for a mismatch)."""
    if not isinstance(node, dict):
        return _a(f"{type(node).__name__} value")
    tag = _tag(node)
    if tag == "$state":
        return f"the state of {_a(node['$state'])}"
    names = {None: "a dict", "$tensor": "a tensor", "$ndarray": "a numpy array"}
    return names[tag] if tag in names else _a(f"{tag[1:]} value")


def _a(words: str) -> str:
    """`words` after their indefinite article ("an int value", "an OrderedDict", "a float value")."""
    return f"{'an' if words[:1].lower() in 'aeiou' else 'a'} {words}"


def _check_groups(value: Any, current: Mapping[str, Any], key: str) -> None:
    """An optimizer's saved parameter groups match its own in number and size (its load_state_dict would refuse
    them only after the rest of the state was loaded)."""
    saved = [len(g.get("params", ())) for g in value.get("param_groups", ())] if isinstance(value, dict) else None
    mine = [len(g["params"]) for g in current.get("param_groups", ())]
    if saved != mine:
        raise StateMismatchError(
            f"restore: key {key!r}: the checkpoint's optimizer has parameter groups of {saved} parameters, the "
            f"optimizer passed to restore {mine}"
        )


def _check_param_shapes(value: Any, optimizer: torch.optim.Optimizer, key: str) -> None:
    """A torch.optim optimizer's saved per-parameter state fits the parameter it goes to (its load_state_dict takes
    any shape; the next step failed with a broadcast error, or an optimizer built over other same-count parameters
    trained on with their moments). Its state tensors have the parameter's shape, or 1 along some dims (Adafactor);
    LBFGS keeps flat buffers and other optimizers their own layouts: not judged."""
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or isinstance(optimizer, torch.optim.LBFGS):
        return
    saved_ids = [i for g in value["param_groups"] for i in g["params"]]
    params = dict(zip(saved_ids, (p for g in optimizer.param_groups for p in g["params"])))
    state = value.get("state")
    for i, entries in state.items() if isinstance(state, dict) else ():
        p = params.get(i)
        if p is None or not isinstance(entries, dict):
            continue
        for name, t in entries.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            if t.dim() != p.dim() or any(a not in (b, 1) for a, b in zip(t.shape, p.shape)):
                raise StateMismatchError(
                    f"restore: key {_join(key, f'state.{i}.{name}')!r} has shape {list(t.shape)} in the checkpoint, "
                    f"but the optimizer's parameter {i} has shape {list(p.shape)}: was the optimizer built over "
                    "other parameters, or in another order?"
                )


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


def _in_place(x: Any) -> bool:
    """A value `apply` fills where it is (a tuple of them needs no new tuple)."""
    return is_stateful(x) or isinstance(x, (torch.Tensor, dict))


def _child(template: Any, k: Any) -> Any:
    return template.get(k) if isinstance(template, Mapping) else None


def apply(target: dict[str, Any] | list[Any], key: Any, value: Any, *, skip: Container[int] = ()) -> None:
    """Put a restored value into the caller's state: Stateful objects load it (but those whose id is in `skip`),
    tensors are copied in place, and dicts and lists (two optimizers of a GAN) are entered, so that the objects in
    them load too."""
    current = _at(target, key)
    entered = _entered(current, value)
    if entered is not None:
        for container, k, v in entered:
            apply(container, k, v, skip=skip)
    elif is_stateful(current):
        if id(current) not in skip:
            current.load_state_dict(value)
    elif isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) and current.shape == value.shape:
        if current.data_ptr() != value.data_ptr():
            current.copy_(value)
    else:
        target[key] = value


def stateful_in(
    target: dict[str, Any] | list[Any], key: Any, value: Any, path: str = ""
) -> Iterator[tuple[str, Any, Any]]:
    """(its key path, as 'samplers.val', object, its state) of every Stateful object `apply(target, key, value)` would
    load, at any depth."""
    path = _join(path, key)
    current = _at(target, key)
    entered = _entered(current, value)
    if entered is not None:
        for container, k, v in entered:
            yield from stateful_in(container, k, v, path)
    elif is_stateful(current):
        yield path, current, value


def _at(target: dict[str, Any] | list[Any], key: Any) -> Any:
    return target.get(key) if isinstance(target, dict) else target[key]


def _entered(current: Any, value: Any) -> list[tuple[Any, Any, Any]] | None:
    """The (container, key, value) places `apply` goes into for a list, tuple or dict of the caller's and the
    restored one; None where it loads, copies or sets `value` itself."""
    if isinstance(current, (list, tuple)) and isinstance(value, (list, tuple)) and len(current) == len(value):
        if isinstance(current, list) or all(_in_place(c) for c in current):
            return [(current, i, v) for i, v in enumerate(value)]
    if isinstance(current, dict) and not is_stateful(current) and isinstance(value, dict):
        return [(current, k, v) for k, v in value.items()]
    return None
