"""`ckpt.export`: a step's weights as safetensors shards, one `torch.save` file, or a folder `from_pretrained` loads.

safetensors and hf stream: each tensor is read (verified, as restore reads it) in bands of at most ~64 MiB of whole
chunks and written straight into its file, so memory stays bounded whatever the checkpoint's size. The torch
format cannot stream (torch.save pickles the whole object at once): it holds the selected keys in memory. Output
appears only when complete: it is written next to OUT under a temporary name and renamed at the end.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm import tqdm

from . import layout, restore, store
from . import state as state_mod
from .errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from .format import ArrayInfo, torch_dtype
from .reader import Route, StepReader, key_list
from .safetensors_file import Entry, Writer, dtype_name
from .storage import Storage, open_storage

FORMATS = ("safetensors", "torch", "hf")
SHARD_FORMATS = ("safetensors", "hf")  # what max_shard_size applies to (torch writes one file)
DEFAULT_SHARD_SIZE = "5GB"
DEFAULT_KEY = "model"
HF_CONFIG = "hf_config"  # step metadata: the model's Transformers config (a dict), written by integrations.hf
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"  # Transformers' file names
TIES_MARK = "ckpt.ties"  # safetensors metadata of an exported file: "1", its other entries (but format) are ties
_BAND_BYTES = 64 << 20  # what one read of a tensor holds at most (unless one chunk row-band is larger)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def model_config_metadata(model: Any) -> dict[str, Any]:
    """Step metadata that lets ``export --format hf`` rebuild `model`: its Transformers config as JSON, with its
    class as ``architectures`` (as ``save_pretrained`` records it); empty for a model without a config."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return {}
    data = json.loads(config.to_json_string(use_diff=False))
    data["architectures"] = data.get("architectures") or [type(model).__name__]
    return {HF_CONFIG: data}


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"`` (10^9, as Transformers counts), ``"500MiB"`` (2^20) or a plain number of bytes."""
    if type(text) is int:
        size = text
    elif not isinstance(text, str):  # True is no 1-byte limit, 1.5 no size in bytes
        raise TypeError(f"max_shard_size must be a str such as '5GB' or an int of bytes, got {text!r}")
    else:
        m = _SIZE.match(text)
        if not m:
            raise ValueError(f"not a size: {text!r} (write e.g. 5GB, 500MB, 2GiB or a number of bytes)")
        unit = _UNITS[(m.group(2) or "B").lower()]
        try:
            number = Fraction(m.group(1))  # exact: 0.29KB is 290 bytes, and no size is too large (a float overflows)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ValueError(f"not a size: a number of {len(m.group(1))} digits (write e.g. 5GB or 500MB)") from None
        if unit == 1 and number.denominator != 1:  # "1.5" is no 1-byte shard
            raise ValueError(f"not a whole number of bytes: {text!r} (write e.g. 1.5GB, 500MB or 1500 bytes)")
        size = round(number * unit)
    if size < 1:
        raise ValueError(f"a shard size must be at least 1 byte, got {text!r}")
    return size


@dataclass
class ExportTensor:
    """One array of the step as it is exported: the name it gets, and the other names it had (tied weights)."""

    name: str
    info: ArrayInfo
    aliases: list[str] = field(default_factory=list)


def export(
    root: str | os.PathLike,
    out: str | os.PathLike,
    *,
    format: str,
    step: int | None = None,
    keys: Sequence[str] | None = None,
    max_shard_size: str | int | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    progress: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """Export the tensors under `keys` (default ``["model"]``; ``[]`` selects nothing, an error) of `step` (default:
    the newest committed) to `out`; returns the step exported.

    Names are the dotted paths below the one selected key (``model.embed.weight`` -> ``embed.weight``, what
    ``load_state_dict`` and ``from_pretrained`` expect), or full paths when several keys are selected.
    ``safetensors``: a folder with ``model.safetensors``, or shards of at most `max_shard_size` (default 5GB) and
    ``model.safetensors.index.json``. Tied weights are written once under their first name; the other names
    are dropped and recorded in the file's metadata (as ``safetensors.torch.save_model`` does), and
    ``from_pretrained`` ties them again. ``torch``: one file for ``torch.load(weights_only=True)`` (numpy
    values become tensors and numbers). ``hf``: the safetensors folder plus ``config.json``, from `config` (a
    dict or a JSON file) or the config the HF integration stored with the step. `out` must not exist, or be an
    empty folder, and its parent folder must exist; nothing appears there unless the export completes. A
    `max_shard_size` or `config` the format does not use is a ValueError (it was ignored in silence).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r} (choose from {', '.join(FORMATS)})")
    if max_shard_size is not None and format not in SHARD_FORMATS:
        raise ValueError(
            f"max_shard_size applies to formats {' and '.join(SHARD_FORMATS)}, not {format!r} (one file), "
            f"got {max_shard_size!r}"
        )
    if config is not None and format != "hf":
        raise ValueError(f"config applies to format hf (its config.json), not {format!r}, got {config!r}")
    shard_bytes = parse_size(DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size)
    out = os.path.abspath(os.fspath(out))
    _check_out(out, format)
    storage = open_storage(root, storage_options)
    _check_outside(out, storage)
    keys = key_list(keys) if keys is not None else [DEFAULT_KEY]
    with ThreadPoolExecutor(8, thread_name_prefix="ckpt-export") as pool:
        relists = 0
        while True:
            s = step if step is not None else layout.newest_committed(storage)
            try:
                _export_step(StepReader(storage, s, pool), keys, out, format, shard_bytes, config, progress)
                return s
            except StepNotFoundError:  # the newest step deleted while exported (a run's retention): list again
                relists += 1
                if step is not None or relists > restore.MAX_RELISTS:
                    raise
            except CorruptCheckpointError as e:
                raise CheckpointError(
                    f"step {s} is damaged: {e}; nothing was written to {out} (export another step "
                    f"with --step; `python -m ckpt ls` lists them)"
                ) from None


def _export_step(
    reader: StepReader,
    keys: Sequence[str],
    out: str,
    format: str,
    shard_bytes: int,
    config: str | os.PathLike | Mapping[str, Any] | None,
    progress: bool | None,
) -> None:
    """Write `keys` of the step `reader` reads to `out`, which appears only when complete."""
    step = reader.step
    if not keys:  # as for load: [] selects nothing, not the default
        raise ValueError(
            f"keys=[] selects nothing to export from step {step}: name the keys, or leave keys out to export "
            f"{DEFAULT_KEY!r}"
        )
    routes = reader.routes(keys)  # a KeyError naming a missing key (and a str for a list: TypeError)
    hf_config = _hf_config(config, reader, step) if format == "hf" else None
    with _staged(out, directory=format != "torch") as tmp:
        if format == "torch":
            _write_torch(reader, keys, routes, tmp, progress)
        else:
            _write_safetensors(reader, keys, routes, tmp, shard_bytes, progress, format)
            if hf_config is not None:
                with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                    json.dump(hf_config, f, indent=2, sort_keys=True)


def _check_outside(out: str, storage: Storage) -> None:
    """ValueError when `out` is inside the checkpoint root: a root is the writer's (an export named like a step,
    ``ROOT/step_00000009``, was deleted by the next gc as an abandoned save)."""
    base = storage.direct_path("")  # a root of this machine's files
    if base is None:
        return
    base = os.path.realpath(base)
    if os.path.commonpath([base, os.path.realpath(out)]) == base:
        raise ValueError(f"the output {out} is inside the checkpoint root {base}: export it outside the root")


def _check_out(out: str, format: str) -> None:
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):  # a typo in a path makes no tree of folders (a mkdir -p did)
        error, what = (
            (NotADirectoryError, "not a folder") if os.path.exists(parent) else (FileNotFoundError, "no such folder")
        )
        raise error(f"{parent}: {what} (the parent of the output {out}); export creates no folders: make it first")
    if not os.path.lexists(out):
        return
    folder = os.path.isdir(out) and not os.path.islink(out)
    if folder and not os.listdir(out):
        if format != "torch":
            return
        raise IsADirectoryError(
            f"{out} is a folder: --format torch writes one file; name it (e.g. {os.path.join(out, 'model.pt')})"
        )
    raise FileExistsError(
        f"{out} already exists{' and is not empty' if os.path.isdir(out) else ''}: export never "
        f"overwrites; remove it or choose another output"
    )


class _staged:
    """A temporary file or folder next to `out` (a name of its own: a pid repeats, in containers and after a
    killed export, whose temporary name stays), renamed to `out` when the block completes, removed otherwise."""

    def __init__(self, out: str, *, directory: bool):
        self.out, self.directory = out, directory
        name = f".{os.path.basename(out)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp = os.path.join(os.path.dirname(out), name)

    def __enter__(self) -> str:
        try:
            if self.directory:
                os.mkdir(self.tmp)
            else:
                os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError as e:
            raise self._named(e) from e
        return self.tmp

    def _named(self, e: OSError) -> OSError:
        """An error of the temporary file, told as one of the output the user named."""
        return type(e)(e.errno, f"{e.strerror} (writing {self.out})", self.out)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._finish(exc_type)
        if isinstance(exc, OSError) and self.tmp in str(exc.filename or ""):
            raise self._named(exc) from exc

    def _finish(self, exc_type: Any) -> None:
        try:
            if exc_type is None:
                try:
                    if self.directory:
                        os.rename(self.tmp, self.out)  # replaces an empty folder; fails on a non-empty one
                    else:
                        os.link(self.tmp, self.out)  # fails if `out` appeared meanwhile: never overwrite
                        os.unlink(self.tmp)
                except OSError as e:
                    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                        raise
                    raise FileExistsError(
                        f"{self.out} appeared while the export was written: export never overwrites; remove it or "
                        f"choose another output"
                    ) from None
                fd = os.open(os.path.dirname(self.out), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        finally:
            if os.path.lexists(self.tmp):
                shutil.rmtree(self.tmp) if self.directory else os.unlink(self.tmp)


def _hf_config(config: str | os.PathLike | Mapping[str, Any] | None, reader: StepReader, step: int) -> dict[str, Any]:
    if config is None:
        stored = reader.manifest.metadata.get(HF_CONFIG)
        if not isinstance(stored, dict):
            raise ValueError(
                f"step {step} holds no model config (the HF integration stores one; this step was saved "
                f"otherwise): give one with --config config.json"
            )
        return stored
    if isinstance(config, Mapping):
        return dict(config)
    try:
        f = open(config, encoding="utf-8")
    except OSError as e:  # said as the option it was given to
        raise ValueError(f"--config {config}: {e.strerror} (the model's config.json, for --format hf)") from None
    with f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"--config {config} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {config} is not a JSON object")
    return data


def _name(route: Route, routes: list[Route]) -> str:
    """A leaf's exported name: its path below the one selected key (the key's own last part when it is the
    tensor itself), or its full path when several keys are selected."""
    if len(routes) == 1:
        rel = route[len(routes[0]) :]
        return ".".join(map(str, rel)) if rel else str(route[-1])
    return ".".join(map(str, route))


def plan_tensors(reader: StepReader, keys: Sequence[str], routes: list[Route]) -> tuple[list[ExportTensor], list[str]]:
    """The arrays under `keys` in state order, each once (tied names become aliases), and the names of the JSON
    values there (which safetensors cannot hold)."""
    tensors: dict[str, ExportTensor] = {}
    skipped, seen = [], set()
    for leaf in reader.leaves(keys):
        name = _name(leaf.route, routes)
        if name in seen:
            raise ValueError(f"two values of step {reader.step} would both be exported as {name!r}: select fewer keys")
        seen.add(name)
        if leaf.array is None:
            skipped.append(name)
        elif leaf.array.name in tensors:
            tensors[leaf.array.name].aliases.append(name)
        else:
            tensors[leaf.array.name] = ExportTensor(name, leaf.array)
    return list(tensors.values()), skipped


def _shards(tensors: list[ExportTensor], limit: int) -> list[list[ExportTensor]]:
    """Consecutive groups of at most `limit` bytes (a larger tensor has a shard of its own), as Transformers cuts."""
    shards: list[list[ExportTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.info.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.info.nbytes
    return shards


def bands(info: ArrayInfo) -> Iterator[tuple[tuple[int, int], ...]]:
    """Boxes of whole rows, in order, that cover the array: about `_BAND_BYTES` each, on chunk boundaries (on
    the rows of a segment, where the array's boxes are placed in packs)."""
    whole = tuple((0, n) for n in info.shape)
    if not info.shape or info.nbytes <= _BAND_BYTES or info.shape[0] <= 1:
        yield whole
        return
    n = info.shape[0]
    row = info.nbytes // n
    unit = max(1, info.segment // row) if info.places is not None else info.chunk[0]
    rows = max(unit, _BAND_BYTES // row // unit * unit)
    for a in range(0, n, rows):
        yield ((a, min(a + rows, n)),) + whole[1:]


def _check_names(t: ExportTensor, step: int) -> None:
    """ValueError for a name a safetensors file cannot give `t`: its header's own ``__metadata__``, a name with a lone
    surrogate (the header is UTF-8 JSON), or, for a tie (recorded in that metadata), the entries ``format`` and
    `TIES_MARK`, which hold the file's own values."""
    for name in (t.name, *t.aliases):
        try:
            name.encode()
        except UnicodeEncodeError:
            raise ValueError(
                f"tensor {name!r} of step {step}: its name holds a lone surrogate (os.fsdecode's of bytes that are "
                f"not UTF-8), which a safetensors header (UTF-8 JSON) cannot hold; export it with --format torch"
            ) from None
    if t.name == "__metadata__":
        raise ValueError(
            f"tensor '__metadata__' of step {step}: safetensors names its header's metadata so, and no tensor can "
            f"have that name; export it with --format torch"
        )
    for alias in t.aliases:
        if alias in ("format", TIES_MARK):
            raise ValueError(
                f"tensor {alias!r} of step {step} is tied to {t.name!r}: a safetensors file records ties in its "
                f"metadata, whose {alias!r} entry is the file's own; export it with --format torch, which keeps ties"
            )


def _bar(total: int, step: int, progress: bool | None) -> tqdm:
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"export step {step}",
        file=sys.stderr,
        disable=None if progress is None else not progress,
    )


def _warn_skipped(skipped: list[str], format: str) -> None:
    if skipped:
        warnings.warn(
            f"{len(skipped)} values that are not tensors are not exported ({format} holds tensors only): "
            f"{', '.join(skipped[:10])}{' ...' if len(skipped) > 10 else ''}",
            RuntimeWarning,
            stacklevel=4,
        )


def _write_safetensors(
    reader: StepReader,
    keys: Sequence[str],
    routes: list[Route],
    folder: str,
    limit: int,
    progress: bool | None,
    format: str,
) -> None:
    tensors, skipped = plan_tensors(reader, keys, routes)
    if not tensors:
        raise ValueError(
            f"no tensor is under {list(keys)} in step {reader.step}: nothing to export ({format} holds tensors only)"
        )
    for t in tensors:  # refuse before writing anything
        dtype_name(torch_dtype(t.info.dtype), t.name)
        _check_names(t, reader.step)
    _warn_skipped(skipped, format)
    shards = _shards(tensors, limit)
    files = (
        [WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with _bar(sum(t.info.nbytes for t in tensors), reader.step, progress) as bar:
        for file, shard in zip(files, shards):
            metadata = {"format": "pt", TIES_MARK: "1", **{alias: t.name for t in shard for alias in t.aliases}}
            writer = Writer(
                os.path.join(folder, file),
                [Entry(t.name, torch_dtype(t.info.dtype), t.info.shape) for t in shard],
                metadata,
            )
            try:
                for t in shard:
                    for box in bands(t.info):
                        piece = reader.read_array(t.info, box)
                        writer.write(store.as_bytes(piece))
                        bar.update(piece.numel() * piece.element_size())
            except BaseException:
                writer.abandon()
                raise
            writer.close()
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.info.nbytes for t in tensors)},
            "weight_map": {t.name: file for file, shard in zip(files, shards) for t in shard},
        }
        with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)


def _write_torch(
    reader: StepReader, keys: Sequence[str], routes: list[Route], path: str, progress: bool | None
) -> None:
    """The selected keys as one object (the value of the one key, or a dict of them), read array by array (tied
    tensors stay one tensor), then torch.save'd: this holds all of it in memory."""
    tree = reader.select(keys)
    leaves = [leaf for leaf in reader.leaves(keys) if leaf.array is not None]
    arrays = {leaf.array.name: leaf.array for leaf in leaves}
    read: dict[str, torch.Tensor] = {}
    with _bar(sum(a.nbytes for a in arrays.values()), reader.step, progress) as bar:

        def load(name: str, template: Any, as_numpy: bool, key: str) -> torch.Tensor:
            if name not in read:
                read[name] = reader.read_array(arrays[name])
                bar.update(arrays[name].nbytes)
            return read[name]  # numpy arrays too: torch.load(weights_only=True) refuses numpy

        values = {k: state_mod.decode(node, load) for k, node in tree.items()}
    value = _at(values, routes[0]) if len(routes) == 1 else {".".join(map(str, r)): _at(values, r) for r in routes}
    with open(path, "wb") as f:  # the staged file, made empty for this export
        torch.save(_weights_only(value), f)
        f.flush()
        os.fsync(f.fileno())


def _at(values: Any, route: Route) -> Any:
    for k in route:
        values = values[k]
    return values


def _weights_only(value: Any) -> Any:
    """`value` with numpy scalars as Python numbers, which `torch.load(weights_only=True)` accepts."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return type(value)((k, _weights_only(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_weights_only(v) for v in value)
    return value
