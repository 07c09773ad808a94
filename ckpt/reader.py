"""`ckpt.load`: a checkpoint's state as plain values (nested dicts of CPU tensors and JSON values), no training objects.

Built on the restore mechanism: `read_manifest`, `plan_restore` and the verified reads of `restore.py`, so every
chunk is checked (size, crc32c, the manifest's digest) exactly as a restore checks it. Only the arrays under the
selected keys are read; a region of one tensor reads only the chunks that hold it. `StepReader` is the same thing
one step at a time, for callers that read many tensors in turn (export streams them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from . import layout, restore
from . import state as state_mod
from .distributed import Ranks
from .errors import CorruptCheckpointError, StateKeyError, StepNotFoundError
from .format import ArrayInfo, torch_dtype
from .staging import StagingArena
from .storage import Storage, open_storage

Box = tuple[tuple[int, int], ...]
Route = tuple[Any, ...]  # the keys (str or int) from the top of the tree down to a node
_CONTAINERS = ("$dict", "$odict", "$tuple", "$state")  # tagged nodes that hold other nodes


@dataclass(frozen=True)
class Leaf:
    """One leaf of a step's state tree: where it is, and the array it refers to (None for a JSON value)."""

    route: Route
    node: Any
    array: ArrayInfo | None


class StepReader:
    """One committed step opened for reading: its manifest is read and validated once, then any part of its state
    can be read, verified, as plain values. Per-rank entries (RNG states) are rank 0's."""

    def __init__(self, storage: Storage, step: int, pool: ThreadPoolExecutor):
        self.storage, self.step, self._pool = storage, step, pool
        self.manifest = layout.read_manifest(storage, step)
        with _unless_deleted(storage, step):
            self.files = restore.step_files(storage, step)
        m = self.manifest
        self.tree = {
            k: state_mod.select_rank(v, 0, m.world_size, 1, "modulo") if isinstance(v, dict) and "$per_rank" in v else v
            for k, v in m.tree.items()
        }

    def routes(self, keys: Sequence[str] | None) -> list[Route]:
        """The route of each dotted key (``"model.embed.weight"``: the top-level key, then the keys below it, whose
        own names may hold dots), each once; KeyError naming the key and what the checkpoint has where it stops
        matching."""
        keys = key_list(keys)
        if keys is None:
            return [(k,) for k in self.tree]
        if "" in keys:  # `--keys model,`: it selected the whole state, optimizer and all
            raise ValueError(
                f"keys {list(keys)} hold an empty key: name each one, or leave keys out (load reads the whole state, "
                "export 'model')"
            )
        routes = [_route(self.tree, key, key, (), self.step) for key in keys]
        return list(dict.fromkeys(routes))  # a key given twice counts once: export names its output as for one key

    def select(self, keys: Sequence[str] | None) -> dict[str, Any]:
        """The state tree cut down to the selected keys (the nesting above them kept)."""
        return _prune(self.tree, self.routes(keys))

    def leaves(self, keys: Sequence[str] | None) -> list[Leaf]:
        """Every leaf under the selected keys, in the order of the state."""
        out: list[Leaf] = []
        _walk(self.select(keys), (), out, self.manifest.arrays)
        return out

    def read(
        self,
        keys: Sequence[str] | None = None,
        *,
        region: Sequence[slice] | None = None,
        device: str | torch.device = "cpu",
    ) -> dict[str, Any]:
        """The selected part of the state as plain values: nested dicts (module and optimizer states as their
        state_dict), tensors (tied ones still tied) and JSON values. With `region`, only that part of the one
        tensor `keys` selects is read."""
        tree = self.select(keys)
        if region is not None:
            arrays = {leaf.array.name: leaf for leaf in self.leaves(keys) if leaf.array is not None}
            if len(arrays) != 1:
                chosen = "the whole state (keys=None) holds" if keys is None else f"keys {list(keys)} select"
                raise ValueError(
                    f"region= reads part of one tensor: {chosen} {len(arrays)} "
                    f"arrays of step {self.step}; name one tensor, e.g. keys=['model.embed.weight']"
                )
            leaf = next(iter(arrays.values()))
            info = leaf.array
            part = self.read_array(info, region_box(info, region, ".".join(map(str, leaf.route))))
            values = {
                k: state_mod.decode(node, lambda name, _, as_np, key: part.numpy() if as_np else part)
                for k, node in tree.items()
            }
        else:
            manifest = dataclasses.replace(self.manifest, tree=tree)
            plan = restore.plan_restore(manifest, dict.fromkeys(tree), None, Ranks.local(), files=self.files)
            self._execute(plan)
            values = plan.values
        device = torch.device(device)
        return values if device.type == "cpu" else _to_device(values, device, {})

    def read_array(self, info: ArrayInfo, box: Box | None = None) -> torch.Tensor:
        """One array, or the `box` of it, read and verified into a new CPU tensor; only the chunks it needs."""
        box = box if box is not None else tuple((0, n) for n in info.shape)
        out = torch.empty(tuple(b - a for a, b in box), dtype=torch_dtype(info.dtype))
        plan = restore.ReadPlan(self.manifest, {(info.name, box): restore.ArrayRead(info, box, fresh=out)}, {})
        self._execute(plan)
        return out

    def _execute(self, plan: restore.ReadPlan) -> None:
        """Run `plan`'s verified reads into tensors of its own."""
        with _unless_deleted(self.storage, self.step):
            restore.execute(self.storage, plan, self._pool, StagingArena())  # no scratch: own tensors


@contextlib.contextmanager
def _unless_deleted(storage: Storage, step: int) -> Iterator[None]:
    """Files missing because the step was deleted while being read (another process's retention) are no damage, as
    for restore: a StepNotFoundError (a FileNotFoundError), not the CorruptCheckpointError the read raised."""
    try:
        yield
    except CorruptCheckpointError as e:
        if layout.is_committed(storage, step):
            raise
        raise StepNotFoundError(
            f"step {step} of {storage.url} was deleted while being read (another process's retention?): {e}"
        ) from None


def load(
    root: str | os.PathLike,
    *,
    step: int | None = None,
    keys: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    region: Sequence[slice] | None = None,
    io_threads: int = 8,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A checkpoint's state as a plain nested dict, without the training objects; only what `keys` selects is read.

    `keys` are dotted paths into the state (``["model"]``, ``["model.embed.weight"]``); the result keeps the
    nesting above them (``load(root, keys=["model.embed.weight"])["model"]["embed.weight"]``). `region` (slices,
    e.g. ``(slice(0, 128),)``) reads that part of the one tensor `keys` names, touching only its chunks. Without
    `step`, the newest committed step; a damaged one is reported (RuntimeWarning) and the previous one read, as
    restore does (but nothing is moved aside: loading never changes the root). `storage_options`: as for
    `CheckpointManager` (object stores).
    """
    if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
        raise ValueError(f"io_threads must be an int >= 1, got {io_threads!r}")
    device, keys = _usable_device(device), key_list(keys)
    storage = open_storage(root, storage_options)
    with ThreadPoolExecutor(io_threads, thread_name_prefix="ckpt-load") as pool:
        if step is not None:
            return StepReader(storage, step, pool).read(keys, region=region, device=device)
        damaged: dict[int, CorruptCheckpointError] = {}
        todo, relists = sorted(layout.committed_steps(storage), reverse=True), 0
        while todo:
            s = todo.pop(0)
            try:
                return StepReader(storage, s, pool).read(keys, region=region, device=device)
            except CorruptCheckpointError as e:
                damaged[s] = e
                warnings.warn(
                    f"checkpoint step {s} is damaged: {e}; loading the previous committed step",
                    RuntimeWarning,
                    stacklevel=2,
                )
            except FileNotFoundError:  # deleted while being read (another process's retention): not damage; the
                # steps are listed again, as restore does: the one that replaced it is newer
                relists = restore.relisted(storage.url, relists)
                todo = [x for x in sorted(layout.committed_steps(storage), reverse=True) if x not in damaged]
    if damaged:
        raise CorruptCheckpointError(
            f"no intact checkpoint in {storage.url}: {len(damaged)} damaged (newest error: {damaged[max(damaged)]})"
        )
    raise StepNotFoundError(layout.nothing_committed(storage))


def key_list(keys: Iterable[str] | None) -> list[str] | None:
    """`keys` as given to load or export, checked and read once: a generator is consumed here, not by the first of
    the passes over the selection (which left the others, and the output, empty). None stays None."""
    if keys is None:
        return None
    if isinstance(keys, str):
        raise TypeError(f"keys must be a list of dotted paths, e.g. [{keys!r}], not a str")
    keys = list(keys)
    wrong = [k for k in keys if not isinstance(k, str)]
    if wrong:
        raise TypeError(f"keys must be dotted paths (str), got {wrong[0]!r} ({type(wrong[0]).__name__}) in {keys}")
    return keys


def _usable_device(device: str | torch.device) -> torch.device:
    """`device` parsed and reached (an empty tensor moved there) before anything is read: a typo or a GPU this
    machine lacks fails at once, naming the argument, not after the whole read."""
    try:
        parsed = torch.device(device)
        torch.empty(0).to(parsed)
    except (RuntimeError, TypeError, AssertionError) as e:  # torch's: bad string, no such backend or ordinal
        raise ValueError(f"device={device!r} cannot take the loaded tensors: {e}") from None
    return parsed


def region_box(info: ArrayInfo, region: Sequence[slice], key: str) -> Box:
    """The box of an array that `region` (slices with step 1, trailing dimensions whole) selects; errors name `key`,
    the dotted key the caller selected it by."""
    region = tuple(region) if isinstance(region, (tuple, list)) else (region,)
    if len(region) > len(info.shape) or not all(isinstance(s, slice) and s.step in (None, 1) for s in region):
        raise ValueError(
            f"region must be at most {len(info.shape)} slices with step 1 for key {key!r} "
            f"(shape {list(info.shape)}), got {region!r}"
        )
    box = []
    for d, n in enumerate(info.shape):
        a, b, _ = region[d].indices(n) if d < len(region) else (0, n, 1)
        box.append((a, max(a, b)))
    return tuple(box)


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """The (key, child) pairs of a container node of the tree; None for a leaf (a tensor, a JSON value)."""
    if isinstance(node, list):
        return list(enumerate(node))
    if not isinstance(node, dict):
        return None
    tag = next((k for k in node if k.startswith("$")), None)
    if tag is None:
        return list(node.items())
    if tag in ("$dict", "$odict"):
        return [(k, v) for k, v in node[tag]]
    if tag == "$tuple":
        return list(enumerate(node[tag]))
    if tag == "$state":
        return _children(node["v"])
    return None


def _route(node: Any, path: str, key: str, above: Route, step: int) -> Route:
    """The keys that spell `path` below `node`; a child's name may itself contain dots (``embed.weight``), the
    longest name that fits is tried first; a name may be empty (``"model."`` is the child '' of ``model``). A
    KeyError names where the deepest attempt stopped matching, or the two names (0 and "0") that spell `path`."""
    children = _children(node)
    fits = sorted(
        ((k, c) for k, c in (children or []) if str(k) == path or path.startswith(f"{k}.")),
        key=lambda kc: -len(str(kc[0])),
    )
    where = ".".join(map(str, above)) or "the top level"
    exact = [k for k, _ in fits if str(k) == path]
    if len(exact) > 1:  # an int key and its str (0 and "0") are spelled alike
        raise StateKeyError(
            f"key {key!r} is ambiguous in checkpoint step {step}: {where} holds both {exact[0]!r} and {exact[1]!r}; "
            f"select {where!r} whole"
        )
    deepest: _NoMatch | None = None
    for k, child in fits:
        if str(k) == path:
            return (k,)
        try:
            return (k,) + _route(child, path[len(str(k)) + 1 :], key, above + (k,), step)
        except _NoMatch as e:
            deepest = e if deepest is None or e.depth > deepest.depth else deepest
    if deepest is not None:
        raise deepest
    has = [str(k) for k, _ in children or []]
    listing = f"it has {has[:20]}{' ...' if len(has) > 20 else ''}" if children is not None else "it is not a container"
    raise _NoMatch(len(above), f"key {key!r} is not in checkpoint step {step}: no {path!r} under {where} ({listing})")


class _NoMatch(StateKeyError):
    def __init__(self, depth: int, message: str):
        super().__init__(message)
        self.depth = depth

    def __str__(self) -> str:
        return self.args[0]


def _prune(node: Any, routes: list[Route]) -> Any:
    """`node` keeping only the children on `routes` (a route that ends here keeps the whole node)."""
    if any(not r for r in routes):
        return node
    wanted: dict[Any, list[Route]] = {}
    for r in routes:
        wanted.setdefault(r[0], []).append(r[1:])
    if isinstance(node, dict) and "$state" in node:
        return {"$state": node["$state"], "v": _prune(node["v"], routes)}
    pairs = [(k, _prune(c, wanted[k])) for k, c in _children(node) if k in wanted]
    if isinstance(node, dict) and "$odict" in node:
        return {"$odict": [[k, v] for k, v in pairs]}
    if isinstance(node, dict) and not any(k.startswith("$") for k in node):
        return dict(pairs)
    return {"$dict": [[k, v] for k, v in pairs]}  # a dict with int keys, or some elements of a list/tuple


def _walk(node: Any, route: Route, out: list[Leaf], arrays: Mapping[str, ArrayInfo]) -> None:
    children = _children(node)
    if children is None:
        ref = node.get("$tensor", node.get("$ndarray")) if isinstance(node, dict) else None
        out.append(Leaf(route, node, arrays[ref] if ref is not None else None))
        return
    for k, child in children:
        _walk(child, route + (k,), out, arrays)


def _to_device(value: Any, device: torch.device, moved: dict[int, torch.Tensor]) -> Any:
    """`value` with every tensor on `device`; tensors tied on the host stay tied there."""
    if isinstance(value, torch.Tensor):
        if id(value) not in moved:
            moved[id(value)] = value.to(device)
        return moved[id(value)]
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device, moved)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_to_device(v, device, moved) for v in value)
    return value
