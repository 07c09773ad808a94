"""`ckpt.import_checkpoint`: a checkpoint written elsewhere becomes a committed step of a root.

Sources: a `torch.save` file (read with ``weights_only=True``), a `torch.distributed.checkpoint` (DCP) folder, a
safetensors file, or a Hugging Face folder of safetensors (one file or shards with their index). The state is
written through `CheckpointManager.save`, so the step has the format, digests and commit of any other.

Where the state goes (top-level keys): a source holding only tensors (safetensors, HF folders, a state_dict
saved with torch.save or DCP) is put under ``model``; a dict of entries (``{"model": ..., "optim": ...,
"step": 7}``) keeps its keys. `key=` puts the whole source under that key instead.

No code from a source runs: torch.save files load with ``weights_only=True``; safetensors headers are JSON; DCP's
``.metadata`` is a pickle, read with an unpickler that builds only DCP's own metadata classes (and torch sizes,
dtypes, layouts), and its non-tensor values load with ``weights_only=True``. Nothing outside a DCP folder is read:
``.metadata`` naming a data file outside it is refused (a ValueError naming the file, the key and the path).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import warnings
from typing import Any, Mapping

import torch

from . import layout
from . import run as run_mod
from .errors import CorruptCheckpointError
from .exporter import HF_CONFIG, INDEX, TIES_MARK
from .format import overlapping
from .manager import CheckpointManager
from .safetensors_file import number, open_regular, open_tensors
from .state import check_top_level_key, flatten
from .storage import Storage, open_storage

DEFAULT_KEY = "model"
IMPORTED = "imported_from"  # step metadata: {"path": ..., "kind": ...}
_STAGING = 256 << 20  # the import copies through a staging buffer of at most this size
_SHARD = re.compile(r"^(.+)-(\d+)-of-(\d+)\.safetensors\Z")  # Transformers' shard names: model-00001-of-00003


def import_checkpoint(
    src: str | os.PathLike,
    root: str | os.PathLike,
    *,
    step: int,
    key: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write the checkpoint at `src` as step `step` of `root` (committed when this returns); returns the kind of
    source found ("torch", "dcp", "safetensors" or "hf").

    torch.save files and safetensors are memory-mapped, so memory stays bounded by the staging buffer; a DCP
    checkpoint is read into memory whole (as ``dcp_to_torch_save`` does). An HF folder's ``config.json`` is stored
    in the step's metadata (``export --format hf`` uses it), and weights tied in the model it describes (the
    output embedding HF does not save) are restored as tied names, so the step restores into that model.
    """
    layout.step_dir(step)  # a bad step or key fails before the root is touched (no lease left in a new root)
    if key is not None:
        check_top_level_key(key)
    src = os.fspath(src)
    kind, state, metadata = read_source(src)
    if isinstance(state, (Mapping, list, tuple)) and not state:  # committed, it would be the step a resume takes
        raise ValueError(f"{src} holds nothing to import (an empty {kind} checkpoint)")
    if key is not None:
        state = {key: state}
    elif not _is_entries(state):
        state = {DEFAULT_KEY: state}
    metadata[IMPORTED] = {"path": os.path.abspath(src), "kind": kind}
    try:  # what the save refuses (a sparse tensor, a None key), refused naming the source, before the root is touched
        flatten(state)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src} cannot be imported: {e}") from None
    storage = open_storage(root, storage_options)
    with CheckpointManager(storage, max_staging_bytes=_STAGING, run_id=_recorded_run_id(storage)) as manager:
        manager.save(step, state, metadata=metadata).wait()
    return kind


def _recorded_run_id(storage: Storage) -> str | None:
    """The id of the run the root records (None: none, or a malformed record): the import adds a step to that run.
    A new id recorded there made the restart of the root's own run (its SLURM_JOB_ID) a RunMismatchError."""
    try:
        recorded = run_mod.recorded_run(storage)
    except CorruptCheckpointError:
        return None
    return recorded.id if recorded is not None else None


def read_source(src: str) -> tuple[str, Any, dict[str, Any]]:
    """(kind, state, step metadata) of a source; ValueError when it is none of the kinds this reads."""
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, ".metadata")):
            return "dcp", read_dcp(src), {}
        state, metadata = read_hf_folder(src)
        return "hf", state, metadata
    if not os.path.exists(src):
        raise FileNotFoundError(f"{src} does not exist")
    with open_regular(src) as f:
        head = f.read(8)
    if src.endswith(".safetensors"):
        found, metadata = open_tensors(src)
        return "safetensors", _tied(found, _aliases(metadata)), {}
    if head[:4] != b"PK\x03\x04" and head[:2] != b"\x80\x02":  # zip (torch >= 1.6) or legacy pickle protocol 2
        raise ValueError(
            f"{src} is neither a torch.save file, nor a .safetensors file, nor a folder of a DCP or "
            f"Hugging Face checkpoint"
        )
    try:
        return "torch", torch.load(src, map_location="cpu", weights_only=True, mmap=head[:4] == b"PK\x03\x04"), {}
    except pickle.UnpicklingError as e:
        detail = _refusal(e)
        if "GLOBAL" in detail:  # a class, a function: what weights_only refuses to build
            raise ValueError(
                f"{src} holds objects other than tensors and plain values, which are not loaded (no code "
                f"from a checkpoint runs): {detail}"
            ) from None
        raise _unreadable(src, detail) from None
    except (RuntimeError, EOFError, OSError) as e:  # the zip reader's, the unpickler's, mmap's: cut short or damaged
        if isinstance(e, OSError) and e.filename:  # a file it could not open or read: it names it
            raise
        raise _unreadable(src, str(e).split(". ")[0] or "it ends too early") from None


def _refusal(e: pickle.UnpicklingError) -> str:
    """What torch.load(weights_only=True) refused, without the advice around it (to load with weights_only=False)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\n|$)", text, re.S)
    advice = ("Weights only load failed", "Check the documentation")
    parts = [found.group(1)] if found else [p for p in text.split("\n\n") if p.strip() and not p.startswith(advice)]
    return (parts or text.splitlines() or [""])[0].strip().split(". ")[0].rstrip(".")


def _unreadable(src: str, detail: str) -> ValueError:
    return ValueError(f"{src} is not a torch.save file this can read (cut short or damaged?): {detail}")


def _is_entries(state: Any) -> bool:
    """A dict of named entries (kept as top-level keys), not a bare state_dict of tensors."""
    return (
        isinstance(state, Mapping)
        and bool(state)
        and all(isinstance(k, str) and not k.startswith("$") for k in state)
        and not all(isinstance(v, torch.Tensor) for v in state.values())
    )


# -- Hugging Face folders and safetensors ----------------------------------------------------------------------


def read_hf_folder(folder: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights of a folder written by ``save_pretrained`` (memory-mapped) and its config as step metadata. Each
    tensor is in one file, the one its index's weight_map names: a ValueError names the key and the files when not.
    """
    index = os.path.join(folder, INDEX)
    weight_map = None
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
        except (ValueError, RecursionError, AttributeError) as e:  # not JSON, or not an object
            raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {str(e)[:100]})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: weight_map must map each tensor to a file name")
        for key, name in weight_map.items():
            if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or os.path.basename(name) != name:
                raise ValueError(f"{index}: weight_map maps {key[:100]!r} to {str(name)[:100]!r}, not a file name")
        files = list(dict.fromkeys(weight_map.values()))
        for name in files:
            if not os.path.lexists(os.path.join(folder, name)):  # a download cut short
                keys = [k for k, v in weight_map.items() if v == name]
                shown = ", ".join(repr(k[:100]) for k in keys[:3]) + ", ..." * (len(keys) > 3)
                raise ValueError(
                    f"{index}: its weight_map puts {len(keys)} tensors ({shown}) in {name}, which is not in {folder}"
                )
    else:
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        _check_shards_complete(folder, files)
    if not files:
        raise ValueError(
            f"{folder} holds neither a DCP checkpoint (.metadata) nor safetensors weights ({INDEX} or *.safetensors)"
        )
    tensors: dict[str, torch.Tensor] = {}
    held_in: dict[str, str] = {}  # tensor name -> the file holding it
    aliases: dict[str, str] = {}
    for name in files:
        found, metadata = open_tensors(os.path.join(folder, name))
        for key in found:
            if key in held_in:
                raise ValueError(f"{folder}: tensor {key!r} is in two files, {held_in[key]} and {name}")
            if weight_map is not None and weight_map.get(key) != name:
                listed = f"in {weight_map[key]}" if key in weight_map else "nowhere"
                raise ValueError(f"{index}: its weight_map puts tensor {key!r} {listed}, but {name} holds it")
            held_in[key] = name
        tensors.update(found)
        aliases.update(_aliases(metadata))
    for key, name in (weight_map or {}).items():
        if key not in tensors:
            raise ValueError(f"{index}: its weight_map puts tensor {key!r} in {name}, which does not hold it")
    config_path = os.path.join(folder, "config.json")
    config = None
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except (ValueError, RecursionError) as e:  # not JSON, or not UTF-8
                raise ValueError(f"{config_path} is not JSON ({type(e).__name__}: {str(e)[:100]})") from None
    tensors = _tied(tensors, aliases)
    if isinstance(config, dict):
        tensors = _tie_like_model(tensors, config, config_path)
    return tensors, ({HF_CONFIG: config} if isinstance(config, dict) else {})


def _check_shards_complete(folder: str, files: list[str]) -> None:
    """ValueError naming a missing shard of a folder without an index: ``NAME-0000K-of-0000N.safetensors`` says N
    files make the model, and an export or download cut short has fewer (the index comes last)."""
    groups: dict[tuple[str, str], dict[int, int]] = {}  # (name, N) -> {K: the width K is written in}
    for name in files:
        m = _SHARD.match(name)
        if m and 1 <= int(m.group(2)) <= int(m.group(3)):
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = len(m.group(2))
    for (prefix, total), present in groups.items():
        missing = next(i for i in range(1, int(total) + 2) if i not in present)  # at most len(present) + 1 steps
        if missing <= int(total):
            raise ValueError(
                f"{folder} holds {len(present)} of the {int(total)} shards {prefix}-*-of-{total}.safetensors but not "
                f"{prefix}-{missing:0{max(present.values())}d}-of-{total}.safetensors, and no {INDEX}: an export or "
                f"download cut short?"
            )


def _aliases(metadata: Mapping[str, str]) -> dict[str, str]:
    """The tie records of one safetensors file's metadata, ``dropped: kept``: every entry of a file `ckpt export`
    wrote (it marks its files, `TIES_MARK`), else only entries between two parameter paths of one attribute
    (``lm_head.weight: transformer.wte.weight``, as ``safetensors.torch.save_model`` writes them), so that other
    metadata (``format``, notes, a value that happens to be a tensor's name) adds no tensor."""
    ours = metadata.get(TIES_MARK) == "1"
    return {
        alias: kept
        for alias, kept in metadata.items()
        if alias not in ("format", TIES_MARK) and (ours or ("." in alias and _leaf(alias) == _leaf(kept)))
    }


def _tied(tensors: dict[str, torch.Tensor], aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The names a safetensors file dropped (`_aliases`) back, sharing the tensor each was tied to."""
    out = dict(tensors)
    for alias, kept in aliases.items():
        if alias not in out and kept in tensors:
            out[alias] = tensors[kept]
    return out


def _leaf(name: str) -> str:
    """The attribute a parameter path ends with (``weight`` of ``lm_head.weight``)."""
    return name.rsplit(".", 1)[-1]


def _tie_like_model(tensors: dict[str, torch.Tensor], config: dict[str, Any], path: str) -> dict[str, torch.Tensor]:
    """Add the names the model class of `config` (at `path`) ties to a saved tensor (e.g. ``lm_head.weight``, which
    save_pretrained leaves out): its ``_tied_weights_keys`` when the config ties word embeddings. Needs
    Transformers; the model is not built, so the config's sizes cost nothing, and only a PreTrainedModel is read."""
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"{path}: 'architectures' must be a list of class names, got {str(architectures)[:100]}")
    try:
        import transformers
    except ImportError:
        return tensors
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return tensors
    try:  # the config object, not the model: a default set in __init__ (T5's tie_word_embeddings) counts too
        tie = cls.config_class.from_dict(config).tie_word_embeddings
    except Exception as e:  # noqa: BLE001 - a config this Transformers cannot read: the weights are still imported
        warnings.warn(
            f"{path}: {architectures[0]}'s config could not be read ({type(e).__name__}: {str(e)[:200]}); names "
            f"save_pretrained left out as tied are not restored",
            RuntimeWarning,
            stacklevel=4,
        )
        return tensors
    tied = cls._tied_weights_keys if tie is True else None
    out = dict(tensors)
    for target, source in tied.items() if isinstance(tied, dict) else ():
        if target not in out and source in tensors:
            out[target] = tensors[source]
    return out


# -- torch.distributed.checkpoint ----------------------------------------------------------------------------

_DCP_METADATA = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and torch sizes/dtypes/layouts, nothing else (no code from the checkpoint)."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _DCP_METADATA or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"DCP metadata refers to {module}.{name}, which is not loaded (no code from a checkpoint runs)"
        )


def read_dcp(folder: str) -> dict[str, Any]:
    """A DCP checkpoint as the nested state it was saved from; tensors in memory, non-tensor values with
    ``weights_only=True``. Optimizer states get their int parameter ids back (DCP stores dict keys as str).

    Each stored item is read as DCP's FileSystemReader reads it (a ``torch.save`` blob at a byte range of a data
    file); the metadata is checked first, so every element of a tensor comes from exactly one stored chunk."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    file = os.path.join(folder, ".metadata")
    if not _inside(folder, ".metadata"):
        raise ValueError(
            f"{file} is a symlink to {os.path.realpath(file)}, outside the checkpoint folder {folder}; refused "
            f"(nothing outside a DCP checkpoint's folder is read)"
        )
    with open(file, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
            raise ValueError(f"{file} is not DCP metadata this can read: {e}") from None
    _check_dcp_metadata(folder, metadata)
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            flat[fqn] = _dcp_item(folder, fqn, metadata.storage_data[MetadataIndex(fqn)])
            continue
        flat[fqn] = tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)  # the chunks tile it
        for c in md.chunks:
            piece = _dcp_item(folder, fqn, metadata.storage_data[MetadataIndex(fqn, c.offsets)])
            if not (isinstance(piece, torch.Tensor) and piece.shape == c.sizes and piece.dtype == tensor.dtype):
                what = (
                    f"a {piece.dtype} tensor of shape {list(piece.shape)}"
                    if isinstance(piece, torch.Tensor)
                    else f"a {type(piece).__name__}"
                )
                raise ValueError(
                    f"{file}: entry {fqn!r}: its chunk at offsets {list(c.offsets)} holds {what}, not the "
                    f"{tensor.dtype} tensor of shape {list(c.sizes)} the metadata announces"
                )
            tensor[tuple(slice(a, a + n) for a, n in zip(c.offsets, c.sizes))] = piece
    state: dict[str, Any] = {}
    paths = metadata.planner_data or {}
    for fqn, value in flat.items():
        path = tuple(paths.get(fqn, (fqn,)))
        try:
            _set(state, path, value)
        except (TypeError, KeyError, IndexError, AttributeError):
            raise ValueError(
                f"{file} is not DCP metadata this can read: entry {fqn!r} is placed at "
                f"{list(path)!r} in the state, which another entry's place contradicts"
            ) from None
    return _int_param_ids(state)


def _inside(folder: str, rel: str) -> bool:
    """Whether `rel` in `folder` is inside it once symlinks are followed."""
    return os.path.realpath(os.path.join(folder, rel)).startswith(os.path.join(os.path.realpath(folder), ""))


def _dcp_item(folder: str, fqn: str, info: Any) -> Any:
    """One stored item of a DCP checkpoint (a ``torch.save`` blob at a checked byte range), weights_only."""
    path = os.path.join(folder, os.fspath(info.relative_path))
    with open_regular(path) as f:  # a FIFO would block the open
        f.seek(info.offset)
        blob = f.read(info.length)
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a damaged or hostile blob
        raise ValueError(
            f"{path}: entry {fqn!r}: bytes {info.offset}..{info.offset + info.length} are not a torch.save blob "
            f"this can read ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
        ) from None


def _check_dcp_metadata(folder: str, metadata: Any) -> None:
    """Refuses a ``.metadata`` that DCP would follow out of `folder` (a data file at ``../x`` or an absolute path),
    that would leave part of a tensor unread (chunks that do not tile its shape exactly, no gap and no overlap) or
    announce more than its data files hold (a byte range past a file's end, two items sharing bytes, a chunk in
    fewer bytes than its elements take), or that fails deep inside with a bare KeyError or IndexError: a ValueError
    names the file, the entry (its FQN) and what is wrong, before any data is read or memory allocated for it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    file = os.path.join(folder, ".metadata")

    def bad(what: str, fqn: Any = None) -> ValueError:
        entry = "" if fqn is None else f"entry {fqn!r}: "
        return ValueError(f"{file} is not DCP metadata this can read: {entry}{what}")

    if not isinstance(metadata, Metadata):
        raise bad(f"it holds a {type(metadata).__name__}, not a DCP Metadata")
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    paths = getattr(metadata, "planner_data", None)
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise bad("its state_dict_metadata is not a dict of entries by FQN")
    if not isinstance(storage, dict):
        raise bad("its storage_data is not a dict (not written by DCP's FileSystemWriter?)")
    if paths is not None and not isinstance(paths, dict):
        raise bad("its planner_data is not a dict")
    stored: dict[tuple[str, tuple[int, ...] | None], int] = {}  # (fqn, chunk offsets) -> stored byte length
    file_sizes: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {}  # data file -> (begin, end, fqn) of its items
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str) or not isinstance(info, _StorageInfo):
            raise bad(f"a storage_data item is {type(index).__name__} -> {type(info).__name__}")
        rel = getattr(info, "relative_path", None)
        rel = os.fspath(rel) if isinstance(rel, (str, os.PathLike)) else rel
        if not isinstance(rel, str) or not rel or "\0" in rel:
            raise bad(f"its data file is {str(rel)[:100]!r}, not a path", fqn)
        if os.path.isabs(rel) or ".." in rel.split(os.sep) or not _inside(folder, rel):  # a symlink out of it
            raise ValueError(
                f"{file}: entry {fqn!r} is stored in {rel!r}, outside the checkpoint folder {folder}; refused (the "
                f"data files of a DCP checkpoint are inside its folder, and nothing outside it is read)"
            )
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise bad(f"bad byte range (offset {str(offset)[:30]}, length {str(length)[:30]}) in {rel!r}", fqn)
        if getattr(info, "transform_descriptors", None):
            raise bad(f"its data is stored transformed ({str(info.transform_descriptors)[:100]}), not read here", fqn)
        if rel not in file_sizes:
            try:
                file_sizes[rel] = os.path.getsize(os.path.join(folder, rel))
            except OSError as e:
                raise bad(f"its data file {rel!r} cannot be read ({e.strerror})", fqn) from None
        if offset + length > file_sizes[rel]:
            raise bad(
                f"bytes {number(offset)}..{number(offset + length)} of its data file {rel!r} are past its end "
                f"({file_sizes[rel]} bytes)",
                fqn,
            )
        at = getattr(index, "offset", None)
        if at is not None and not _dims(at):
            raise bad(f"a storage_data item has offset {str(at)[:100]}, not a list of ints", fqn)
        stored[(fqn, None if at is None else tuple(at))] = length
        spans.setdefault(rel, []).append((offset, offset + length, fqn))
    for rel, items in spans.items():
        items.sort()
        for (_, end, first), (begin, _, second) in zip(items, items[1:]):
            if begin < end:
                raise bad(f"its bytes in {rel!r} overlap those of entry {first!r} (each item has its own)", second)
    for fqn, md in entries.items():
        if isinstance(md, TensorStorageMetadata):
            size, dtype = getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None)
            chunks = getattr(md, "chunks", None)
            if not _dims(size) or not isinstance(dtype, torch.dtype) or not isinstance(chunks, list):
                raise bad(f"bad size {str(size)[:100]}, dtype {dtype!r} or chunks of a tensor", fqn)
            for c in chunks:
                at, n = getattr(c, "offsets", None), getattr(c, "sizes", None)
                if not (
                    isinstance(c, ChunkStorageMetadata)
                    and _dims(at)
                    and _dims(n)
                    and len(at) == len(n) == len(size)
                    and all(a + b <= m for a, b, m in zip(at, n, size))
                ):
                    where = f"at offsets {str(at)[:100]} of sizes {str(n)[:100]}"
                    raise bad(f"a chunk {where} is not inside its shape {str(size)[:100]}", fqn)
                length = stored.get((fqn, tuple(at)))
                if length is None:
                    raise bad(f"its chunk at offsets {list(at)} has no storage_data item (no data file)", fqn)
                need = math.prod(n) * dtype.itemsize
                if length < need:
                    raise bad(
                        f"its chunk at offsets {list(at)} of sizes {list(n)} takes {number(need)} bytes of "
                        f"{dtype}, and is stored in {length}",
                        fqn,
                    )
            held = sum(math.prod(c.sizes) for c in chunks)
            if held != math.prod(size):
                raise bad(
                    f"its chunks hold {number(held)} elements of its {number(math.prod(size))} (shape "
                    f"{str(list(size))[:100]}): they must tile the shape exactly",
                    fqn,
                )
            filled = [c for c in chunks if math.prod(c.sizes)]  # an empty chunk holds no element
            both = overlapping([[(a, a + n) for a, n in zip(c.offsets, c.sizes)] for c in filled])
            if both:
                first, second = sorted(list(filled[i].offsets) for i in both)
                raise bad(f"its chunks at offsets {first} and {second} overlap", fqn)
        elif not isinstance(md, BytesStorageMetadata):
            raise bad(f"it is a {type(md).__name__}, which this import does not read", fqn)
        elif (fqn, None) not in stored:
            raise bad("it has no storage_data item (no data file)", fqn)
        path = (paths or {}).get(fqn, (fqn,))
        if not (
            isinstance(path, (tuple, list))
            and path
            and all(isinstance(k, str) or (type(k) is int and 0 <= k < _MAX_LIST) for k in path)
        ):
            raise bad(
                f"its planner_data path {str(path)[:100]} is not a non-empty list of str keys and list positions", fqn
            )


_MAX_LIST = 1 << 20  # a list position in a DCP state's planner_data (the list is grown up to it)


def _dims(v: Any) -> bool:
    """A torch.Size or tuple of ints >= 0 (not bools)."""
    return isinstance(v, (tuple, list)) and all(type(x) is int and x >= 0 for x in v)


def _set(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Put `value` at `path` (str keys: dicts, int keys: list positions), creating the containers on the way;
    TypeError when the path goes through another entry's value, into a list by a str, or over a container."""
    node = root
    for k, nxt in zip(path, path[1:]):
        held = _holds(node, k)
        child = node[k] if held else None
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                node.extend([None] * (k + 1 - len(node)))
            node[k] = child
        elif not isinstance(child, (dict, list)):
            raise TypeError(f"{k!r} holds a value, not a container")
        node = child
    last = path[-1]
    if _holds(node, last) and isinstance(node[last], (dict, list)):
        raise TypeError(f"{last!r} holds a container")
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def _holds(node: dict | list, k: Any) -> bool:
    if isinstance(node, list) and not isinstance(k, int):
        raise TypeError(f"a list has no key {k!r}")
    return k < len(node) if isinstance(node, list) else k in node


def _int_param_ids(value: Any) -> Any:
    """An optimizer state_dict's ``state`` keyed by int parameter ids again when its param_groups list int ids."""
    if isinstance(value, list):
        return [_int_param_ids(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _int_param_ids(v) for k, v in value.items()}
    groups, st = out.get("param_groups"), out.get("state")
    if isinstance(groups, list) and isinstance(st, dict) and all(isinstance(g, dict) for g in groups):
        ids = {p for g in groups for p in g.get("params", []) if isinstance(p, int)}
        if st and all(isinstance(k, str) and k.isdigit() and int(k) in ids for k in st):
            out["state"] = {int(k): v for k, v in st.items()}
    return out
