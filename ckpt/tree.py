"""The JSON tree of a manifest as readers see it, without torch or numpy: the kinds of node (`node_of`, `walk`),
per-rank entries, tensor references, and `check_tree`, the grammar every manifest is validated against when read.

`ckpt.state` builds and decodes these trees (it needs torch); the CLI's ``ls``, ``inspect``, ``gc`` and ``verify``
read them through this module only. Validating a ``$np`` or ``$dtype`` node imports numpy or torch, once one occurs
(such a value is checked exactly as the library that decodes it reads it).
"""

from __future__ import annotations

import base64
import functools
import math
import re
from typing import TYPE_CHECKING, Any, Iterator, Mapping, NamedTuple

from .errors import CorruptCheckpointError
from .format import MAX_DEPTH, ArrayInfo

if TYPE_CHECKING:
    import numpy as np

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
_NP_SCALAR = re.compile(r"^[<>|=]?([biufcUS])(\d{1,6})\Z")  # numpy scalar dtypes with an exact JSON form
_NP_KINDS = {"i": "int", "u": "uint", "f": "float", "c": "complex"}  # numpy's names of the sized scalar kinds


@functools.cache
def torch_dtypes() -> dict[str, Any]:
    """Every torch dtype by name (``$dtype`` values); imports torch, on first use only."""
    import torch

    return {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


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


def shown(tree: Any) -> str:
    """A checked subtree on one line as Python writes its value (``nan``, ``(1, 2)``, ``torch.Size([3])``), without
    importing torch or numpy: what `inspect` prints of a value (its JSON tags read as noise)."""
    n = node_of(tree)
    if n.kind == SEQUENCE:
        items = [shown(v) for _, v in n.children]
        if isinstance(tree, list):
            return f"[{', '.join(items)}]"
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    if n.kind == MAPPING:
        return "{" + ", ".join(f"{k!r}: {shown(v)}" for k, v in n.children) + "}"
    if n.kind == TENSOR:
        return f"<array {n.name}>"
    if n.kind in (STATE, PER_RANK):
        return f"<{n.name or 'per-rank'} state>"
    tag = _tag(tree) if isinstance(tree, dict) else None
    if tag is None:
        return repr(tree)
    v = tree[tag]
    if tag == "$float":
        return str(v)
    if tag == "$size":
        return f"torch.Size({v!r})"
    if tag == "$dtype":
        return f"torch.{v}"
    if tag == "$bytes":
        raw = _b64(v) or b""
        return repr(raw) if len(raw) <= 32 else f"<{len(raw)} bytes>"
    kind, size = _NP_SCALAR.fullmatch(v).groups()  # "$np" (checked)
    name = {"b": "bool_", "U": "str_", "S": "bytes_"}.get(kind) or f"{_NP_KINDS[kind]}{int(size) * 8}"
    return f"numpy.{name}({shown(tree['v'])})"


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


def skeleton(tree: Mapping[str, Any]) -> list[str]:
    """The structure every rank of a save must share, one line per node: its key path, kind and (a tensor, a state)
    name; not its values, which may differ per rank (an RNG state inside a callback's), nor the top-level per-rank
    entries (each rank's own). The leader commits its own tree: ranks whose skeletons differ would lose the other
    ranks' keys and leave their arrays unreferenced."""
    return [
        f"{'.'.join(map(str, path))} ({n.kind}{' ' + n.name if n.name else ''})"
        for key, sub in tree.items()
        if node_of(sub).kind != PER_RANK
        for path, n in walk(sub, (key,))
    ]


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


def check_tree(tree: dict[str, Any], arrays: Mapping[str, ArrayInfo], *, file: str, world_size: int) -> None:
    """Validate a manifest's tree before anything is read: known tags, well-formed values, bounded depth,
    per-rank entries only at the top and of ranks below the saved `world_size`, every tensor reference listed in
    `arrays`. Raises CorruptCheckpointError."""

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
            "$size": lambda: isinstance(v, list) and all(type(n) is int and 0 <= n < 1 << 63 for n in v),  # int64
            "$dict": lambda: _pairs(v),
            "$odict": lambda: _pairs(v),
            "$bytes": lambda: isinstance(v, str) and _b64(v) is not None,
            "$np": lambda: _np_value(node) is not None,
            "$dtype": lambda: isinstance(v, str) and v in torch_dtypes(),
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
                or not all(
                    isinstance(e, list) and len(e) == 2 and type(e[0]) is int and 0 <= e[0] < world_size
                    for e in entries
                )
            ):
                raise bad(f"$per_rank must be a list of [rank, tree], each rank below the world size {world_size}", k)
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
    if m is None:
        return None
    import numpy as np

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
