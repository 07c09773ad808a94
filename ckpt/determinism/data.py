"""Checkpointable data order: one global sample counter is the whole pipeline position, a batch a pure function of it.

Steps count from 1, as in `TrainLoop`, Lightning's and HF's checkpoint names and the goodput ledger: step s trains
on the s-th global batch, and a checkpoint of step s holds a sampler whose `step` is s (s batches consumed).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import random
import signal
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ..distributed import topology
from ..errors import DataMismatchError  # noqa: F401 (defined with the other errors; importable here too)
from ..observer import NO_TRACKER, CheckpointObserver
from .permutation import MAX_SIZE, epochs_permuted
from .seeding import sample_rng, seed_global_rngs, torch_generator
from .windows import FINGERPRINT_BLOCK, TokenStream, WindowReader, data_fingerprint, resolve_token_files  # noqa: F401

T = TypeVar("T")


def hash_batch(counters: Iterable[int], values: Iterable[int]) -> str:
    """Hash of a global batch as (sample counter, yielded value) pairs; training logs it, `explain` recomputes it."""
    pairs = np.stack([_int64(counters), _int64(values)])
    return hashlib.sha256(pairs.tobytes()).hexdigest()[:16]


def _int64(xs: Iterable[int]) -> np.ndarray:
    """Little-endian int64s of an array (as is: no Python ints made) or any iterable of ints."""
    return np.asarray(xs if isinstance(xs, np.ndarray) else list(xs), dtype="<i8")


HASHES_KEPT = 256  # batch hashes a sampler remembers from the loader's draws (prefetch runs a few batches ahead)


@dataclass(frozen=True)
class Explanation:
    """What one step's global batch was (step s >= 1: the s-th batch): sample counters, epochs, items, offsets, hash."""

    step: int
    counters: list[int]
    epochs: list[int]
    indices: list[int]
    starts: list[int] | None
    window: int | None
    batch_hash: str


def _ints(**arguments: Any) -> list[int]:
    """The arguments as Python ints (a numpy integer is one: a saved state must hold the ints its load checks for),
    or a TypeError naming the first that is not an int (a bool is not)."""
    for name, value in arguments.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return [int(value) for value in arguments.values()]


_POSITION_LIMIT = 1 << 62  # counters stay int64 with a batch added
_INT64_END = 1 << 63  # a sample counter is an int64 (a batch of keys is an int64 array)


class _Keys(list[Any]):
    """A local batch's keys, as the DataLoader hands them to a worker, and `counter`, the global sample counter of
    the first: `make_loader`'s workers seed their global RNGs from it (`_SeededFetch`)."""

    def __init__(self, keys: Iterable[Any], counter: int) -> None:
        super().__init__(keys)
        self.counter = counter


class _CounterSampler(Sampler[list[Any]]):
    """Batch sampler over a keyed per-epoch permutation of `num_items`; position = (global counter t, steps done)."""

    kind: ClassVar[str]
    # one position for all ranks: a save refuses ranks whose states differ (rank 0's alone would be committed)
    same_on_every_rank: ClassVar[bool] = True

    def __init__(
        self,
        num_items: int,
        global_batch_size: int,
        seed: int,
        *,
        rank: int | None,
        world_size: int | None,
        fingerprint: str | None,
        allow_data_change: bool,
    ) -> None:
        found_rank, found_world = topology()
        self._found_topology = rank is None or world_size is None  # checked again when iterated (`_check_topology`)
        rank = found_rank if rank is None else rank
        world_size = found_world if world_size is None else world_size
        num_items, global_batch_size, seed, rank, world_size = _ints(
            num_items=num_items, global_batch_size=global_batch_size, seed=seed, rank=rank, world_size=world_size
        )
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if global_batch_size < 1 or global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of world_size {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if fingerprint is not None and not isinstance(fingerprint, str):  # saved as JSON, compared at the resume
            raise TypeError(f"fingerprint must be a str (dataset.fingerprint()) or None, got {fingerprint!r}")
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.fingerprint = fingerprint
        self.allow_data_change = allow_data_change
        self._t = 0
        self._step = 0
        self._skip = np.empty(0, dtype=np.int64)  # sorted item indices never yielded
        self._generation = 0
        self._hashes: dict[int, str] = {}  # step -> batch hash of the global batch the loader drew for it

    # ----- position -------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Global batches consumed: the last step trained (0 before the first); the next batch is step + 1."""
        return self._step

    def counter(self, step: int) -> int:
        """Global sample counter of the first sample of step `step`'s global batch (steps count from 1)."""
        (step,) = _ints(step=step)
        if step < 1:
            raise ValueError(f"steps count from 1 (step s trains on the s-th global batch), got step {step}")
        t = self._t + (step - 1 - self._step) * self.global_batch_size
        if t < 0:
            raise ValueError(f"step {step} precedes the sampler's origin (t={self._t} after step {self._step})")
        if t >= _POSITION_LIMIT:
            raise ValueError(f"step {step}: its sample counter {t} is past 2**62, the last a sampler counts to")
        return t

    def advance(self, batches: int = 1) -> None:
        """Mark `batches` global batches as consumed by training (call after each step, or use `track`). Never back:
        a rewind (a negative count) is a ValueError; `load_state_dict` goes back to a saved position."""
        (batches,) = _ints(batches=batches)
        if batches < 0:
            raise ValueError(f"advance({batches}): a count of batches consumed is >= 0 (to go back, load a state)")
        self._t = self.counter(self._step + batches + 1)
        self._step += batches

    def track(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches, counting each as consumed when training receives it (prefetch-proof)."""
        generation = self._generation
        for batch in batches:
            self._check_generation(generation)
            self.advance()
            yield batch

    def skip(self, indices: Iterable[int]) -> None:
        """Never yield these items again (each becomes the next unskipped item of its epoch order); call before iter()."""
        new = sorted(set(self._skip.tolist()) | set(_ints(**{f"indices[{k}]": i for k, i in enumerate(indices)})))
        if new and (new[0] < 0 or new[-1] >= self.num_items):
            raise ValueError(f"skip indices must be in [0, {self.num_items}), got {new[0]}..{new[-1]}")
        if len(new) >= self.num_items:
            raise ValueError(f"cannot skip all {self.num_items} items")
        self._skip = np.asarray(new, dtype=np.int64)
        self._new_generation()

    # ----- the pure function counter -> item ------------------------------------------------------------
    def indices(self, counters: np.ndarray) -> np.ndarray:
        """Item index for each global sample counter: perm_epoch(t mod N), each skipped item replaced by the next
        unskipped one of its epoch's order (all samples at once, one round per position moved: a skip list of a
        million items costs a batch milliseconds, not a Python loop scanning the list per hit)."""
        counters = np.asarray(counters, dtype=np.int64)
        epochs, positions = np.divmod(counters, self.num_items)
        out = epochs_permuted(self.num_items, self.seed, epochs, positions)
        hits = np.flatnonzero(self._skipped(out))
        while hits.size:
            positions[hits] = (positions[hits] + 1) % self.num_items
            out[hits] = epochs_permuted(self.num_items, self.seed, epochs[hits], positions[hits])
            hits = hits[self._skipped(out[hits])]
        return out

    def _skipped(self, items: np.ndarray) -> np.ndarray:
        """Which of `items` are in the skip list (a binary search in the sorted list)."""
        if not self._skip.size:
            return np.zeros(items.shape, dtype=bool)
        at = np.minimum(np.searchsorted(self._skip, items), self._skip.size - 1)
        return self._skip[at] == items

    def global_batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(counters, item indices) of `step`'s global batch, identical on every rank and world size."""
        counters = self.counter(step) + np.arange(self.global_batch_size, dtype=np.int64)
        return counters, self.indices(counters)

    def local_batch(self, step: int) -> list[Any]:
        """This rank's contiguous slice of `step`'s global batch, as the values the DataLoader receives; the global
        batch's hash is remembered for `batch_hash`."""
        local = self.global_batch_size // self.world_size
        counters, indices = self.global_batch(step)
        self._hashes[step] = hash_batch(counters, self._values(indices))
        if len(self._hashes) > HASHES_KEPT:
            del self._hashes[next(iter(self._hashes))]
        sl = slice(self.rank * local, (self.rank + 1) * local)
        return _Keys(self._yielded(counters[sl], indices[sl]), int(counters[sl][0]))

    def batch_hash(self, step: int) -> str:
        """The hash of step `step`'s global batch, as ``explain(step).batch_hash``: remembered from when the loader
        drew it (a dict lookup; the goodput ledger records it per step), computed when it did not."""
        found = self._hashes.get(step)
        if found is None:
            counters, indices = self.global_batch(step)
            found = hash_batch(counters, self._values(indices))
        return found

    def __iter__(self) -> Iterator[list[Any]]:
        """Endless local batches from the next step on; fails loudly if state is loaded while iterating."""
        generation, step = self._generation, self._step + 1
        self._check_topology()
        while True:
            self._check_generation(generation)
            yield self.local_batch(step)
            step += 1

    def _new_generation(self) -> None:
        """After a load or a skip: iterators created before end, and the next one draws again (the batches drawn
        before, and their hashes, may be other ones now)."""
        self._generation += 1
        self._hashes.clear()

    def _check_topology(self) -> None:
        """Refuse to iterate as another place than this process's, when the place was taken from `topology()`: a
        sampler built before `init_process_group` was rank 0 of 1 on every rank, which all trained the same batches."""
        if self._found_topology and topology() != (self.rank, self.world_size):
            rank, world_size = topology()
            raise RuntimeError(
                f"sampler built as rank {self.rank} of {self.world_size} (torch.distributed's place when it was built),"
                f" iterated in rank {rank} of {world_size}: build it after init_process_group, or pass rank= and"
                " world_size="
            )

    def _check_generation(self, generation: int) -> None:
        """Refuse to continue an iterator created before `load_state_dict` (it would silently ignore the state)."""
        if generation != self._generation:
            raise RuntimeError(
                "sampler state was loaded (or skips added) after iter(); create a new DataLoader iterator"
            )

    # ----- state ----------------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        """Settings that must match for a resume to continue the same stream."""
        return {"seed": self.seed, "batch": self.global_batch_size, "fingerprint": self.fingerprint}

    def state_dict(self) -> dict[str, Any]:
        """About a hundred bytes of JSON: kind, config, fingerprint, counter t, steps done and skip list."""
        return {"kind": self.kind, **self._config(), "t": self._t, "step": self._step, "skip": self._skip.tolist()}

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise what `load_state_dict(state)` would raise, changing nothing: a restore checks samplers first and
        loads them last, so a restore that fails elsewhere leaves a live iterator running."""
        self._checked(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position; a different kind, config or data fingerprint raises unless allowed, and a
        position this sampler cannot take (a tampered or foreign state) raises naming its key."""
        self._t, self._step, skip = self._checked(state)
        self._skip = np.asarray(skip, dtype=np.int64)
        self._new_generation()

    def _checked(self, state: Mapping[str, Any]) -> tuple[int, int, list[int]]:
        """The position (t, step, kept skips) `state` would set, or the error that refuses it."""
        if not isinstance(state, Mapping):
            raise TypeError(f"sampler state must be a dict (a state_dict()), got {type(state).__name__}")
        if state.get("kind") != self.kind:
            raise DataMismatchError(f"sampler state key 'kind': expected {self.kind!r}, got {state.get('kind')!r}")
        mismatches = [
            f"{key}: checkpoint has {state.get(key)!r}, this run has {value!r}"
            for key, value in self._config().items()
            if state.get(key) != value
        ]
        if mismatches and not self.allow_data_change:
            raise DataMismatchError(
                "resuming on different data or sampler settings ("
                + "; ".join(mismatches)
                + "); pass allow_data_change=True to force it"
            )
        for key in ("t", "step"):
            value = state.get(key)
            if type(value) is not int or not 0 <= value < _POSITION_LIMIT:
                raise DataMismatchError(f"sampler state key {key!r} must be an int in [0, 2**62), got {value!r}")
        skip = state.get("skip")
        if not isinstance(skip, list) or any(type(i) is not int or i < 0 for i in skip):
            raise DataMismatchError(f"sampler state key 'skip' must be a list of item indices, got {str(skip)[:80]}")
        if not mismatches and skip and max(skip) >= self.num_items:  # on its own data: no sampler skipped it
            raise DataMismatchError(
                f"sampler state key 'skip' must hold item indices in [0, {self.num_items}), got {max(skip)}"
            )
        kept = self._carried(state, skip)
        if len(kept) >= self.num_items:
            raise DataMismatchError(
                f"sampler state key 'skip' skips all {self.num_items} items of this run's data: nothing to yield"
            )
        return state["t"], state["step"], kept

    def _carried(self, state: Mapping[str, Any], skip: list[int]) -> list[int]:
        """The saved skips as this sampler's items: those it has (items past a smaller dataset no longer exist)."""
        return sorted({i for i in skip if i < self.num_items})

    def explain(self, step: int) -> Explanation:
        """The global batch of step `step` (from 1) without touching data: counters, epochs, items, offsets, hash."""
        counters, indices = self.global_batch(step)
        values = self._values(indices)
        return Explanation(
            step=step,
            counters=counters.tolist(),
            epochs=(counters // self.num_items).tolist(),
            indices=indices.tolist(),
            starts=self._starts(indices),
            window=self._window(),
            batch_hash=hash_batch(counters, values),
        )

    # ----- per-kind hooks -------------------------------------------------------------------------------
    def _values(self, indices: np.ndarray) -> np.ndarray:
        """The value the DataLoader receives per sample (and the batch hash covers)."""
        return indices

    def _yielded(self, counters: np.ndarray, indices: np.ndarray) -> list[Any]:
        """Per-sample values handed to the dataset."""
        return self._values(indices).tolist()

    def _starts(self, indices: np.ndarray) -> list[int] | None:
        """Token offsets of the samples, when the items are windows."""
        return None

    def _window(self) -> int | None:
        """Window length in tokens, when the items are windows."""
        return None

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _CounterSampler:
        """A rank-0, world-size-1 sampler positioned at a saved state (for `explain`)."""
        raise NotImplementedError


class RandomWindowSampler(_CounterSampler):
    """Windows of L tokens at stride c over n tokens, in a keyed pseudo-random order per epoch; yields (t, start)."""

    kind = "ckpt.RandomWindowSampler/1"

    def __init__(
        self,
        n_tokens: int,
        window: int,
        stride: int,
        global_batch_size: int,
        seed: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        fingerprint: str | None = None,
        allow_data_change: bool = False,
    ) -> None:
        n_tokens, window, stride = _ints(n_tokens=n_tokens, window=window, stride=stride)
        if window < 1 or stride < 1 or n_tokens < window:
            raise ValueError(
                f"need window >= 1, stride >= 1, n_tokens >= window; got n={n_tokens} L={window} c={stride}"
            )
        windows = (n_tokens - window) // stride + 1
        if windows > MAX_SIZE:  # the permutation's domain: refused here, not at the first draw
            raise ValueError(
                f"n_tokens={n_tokens} window={window} stride={stride} give {windows} windows; a sampler permutes at"
                " most 2**62 (use a larger stride)"
            )
        self.n_tokens, self.window, self.stride = n_tokens, window, stride
        super().__init__(
            windows,
            global_batch_size,
            seed,
            rank=rank,
            world_size=world_size,
            fingerprint=fingerprint,
            allow_data_change=allow_data_change,
        )

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "n": self.n_tokens, "L": self.window, "c": self.stride}

    def _carried(self, state: Mapping[str, Any], skip: list[int]) -> list[int]:
        """Under another window or stride (allow_data_change) a saved skip is the tokens of its window: every
        window of this sampler that overlaps them is skipped (an index kept as it was named another window, and
        the skipped tokens came back)."""
        window, stride = state.get("L"), state.get("c")
        if (window, stride) == (self.window, self.stride):
            return super()._carried(state, skip)
        for key, value in (("L", window), ("c", stride)):
            if type(value) is not int or value < 1:
                raise DataMismatchError(f"sampler state key {key!r} must be a positive int, got {value!r}")
        overlapping = set()
        for i in skip:
            lo, hi = i * stride, i * stride + window  # the skipped tokens [lo, hi)
            first = max(0, (lo - self.window) // self.stride + 1)
            overlapping.update(range(first, min(self.num_items, -(-hi // self.stride))))
        return sorted(overlapping)

    def _values(self, indices: np.ndarray) -> np.ndarray:
        return indices * self.stride

    def _yielded(self, counters: np.ndarray, indices: np.ndarray) -> list[Any]:
        return list(zip(counters.tolist(), self._values(indices).tolist()))

    def _starts(self, indices: np.ndarray) -> list[int] | None:
        return self._values(indices).tolist()

    def _window(self) -> int | None:
        return self.window

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RandomWindowSampler:
        sampler = cls(
            state["n"], state["L"], state["c"], state["batch"], state["seed"],
            rank=0, world_size=1, fingerprint=state["fingerprint"],
        )  # fmt: skip
        sampler.load_state_dict(state)
        return sampler


class ShuffledSampler(_CounterSampler):
    """Stateful shuffled batches of indices for an ordinary map-style dataset, from the same keyed permutation."""

    kind = "ckpt.ShuffledSampler/1"

    def __init__(
        self,
        num_items: int,
        global_batch_size: int,
        seed: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        fingerprint: str | None = None,
        allow_data_change: bool = False,
    ) -> None:
        _ints(num_items=num_items)  # before the comparison: `None < 1` is a TypeError naming no argument
        if not 1 <= num_items <= MAX_SIZE:  # the permutation's domain: refused here, not at the first draw
            raise ValueError(f"num_items must be >= 1 and <= 2**62, got {num_items}")
        super().__init__(
            num_items,
            global_batch_size,
            seed,
            rank=rank,
            world_size=world_size,
            fingerprint=fingerprint,
            allow_data_change=allow_data_change,
        )

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "n": self.num_items}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ShuffledSampler:
        sampler = cls(state["n"], state["batch"], state["seed"], rank=0, world_size=1, fingerprint=state["fingerprint"])
        sampler.load_state_dict(state)
        return sampler


SAMPLER_KINDS: dict[str, type[_CounterSampler]] = {cls.kind: cls for cls in (RandomWindowSampler, ShuffledSampler)}


_SAMPLER_NAMES = {kind.partition("/")[0] for kind in SAMPLER_KINDS}


def is_sampler_state(tree: Any) -> bool:
    """True for a dict saved by one of these samplers (its 'kind' tag), so a CLI can find it in a checkpoint tree."""
    return isinstance(tree, Mapping) and tree.get("kind") in SAMPLER_KINDS


def names_a_sampler(tree: Any) -> bool:
    """True for a dict whose 'kind' names one of these samplers in any version ('ckpt.ShuffledSampler/2' of a newer
    ckpt too): a CLI finds a state it cannot read, and `explain` says why, instead of finding none."""
    kind = tree.get("kind") if isinstance(tree, Mapping) else None
    return isinstance(kind, str) and kind.partition("/")[0] in _SAMPLER_NAMES


def explain(state: Mapping[str, Any], step: int) -> Explanation:
    """The global batch of step `step` (from 1, as in logs and checkpoint names) from a saved sampler state."""
    if names_a_sampler(state) and not is_sampler_state(state):
        raise ValueError(
            f"sampler state of kind {state['kind']!r}, which this version of ckpt does not read (it reads "
            f"{', '.join(sorted(SAMPLER_KINDS))}): was it saved by a newer version?"
        )
    if not is_sampler_state(state):
        found = f"key 'kind' is {state.get('kind')!r}" if isinstance(state, Mapping) else f"got {type(state).__name__}"
        raise ValueError(f"not a sampler state: {found}, expected a dict whose 'kind' is one of {list(SAMPLER_KINDS)}")
    try:
        sampler = SAMPLER_KINDS[state["kind"]].from_state(state)
    except KeyError as e:  # a state cut short, or edited
        raise ValueError(f"sampler state of kind {state['kind']!r} has no key {e.args[0]!r}") from None
    return sampler.explain(step)


def format_explanation(explanation: Explanation) -> str:
    """Human-readable table of one step's global batch, headed by its hash."""
    e = explanation
    lines = [
        f"step {e.step}: global samples t={e.counters[0]}..{e.counters[-1]}, "
        f"epoch {e.epochs[0]}{'' if e.epochs[0] == e.epochs[-1] else f'..{e.epochs[-1]}'}, batch hash {e.batch_hash}"
    ]
    for i, (t, epoch, index) in enumerate(zip(e.counters, e.epochs, e.indices)):
        tokens = f" tokens [{e.starts[i]}, {e.starts[i] + e.window})" if e.starts is not None and e.window else ""
        lines.append(f"  t={t} epoch={epoch} index={index}{tokens}")
    return "\n".join(lines)


class TokenWindowDataset(Dataset[dict[str, Any]]):
    """Windows of a token stream keyed by (t, start); augmentation draws from the per-sample RNG.

    `path` is one token file, a directory (its regular non-hidden files, sorted by name) or a list of files (in
    the order given): the files are concatenated into one global stream of `n_tokens` tokens, and a window may
    cross a shard boundary (its tokens are the tail of one file followed by the head of the next).
    `dataset[key]` reads one window and `__getitems__` (what a DataLoader calls) a whole batch, both with
    `WindowReader` (O_DIRECT, all reads in flight at once); `make_loader` also reads ahead.
    """

    def __init__(
        self,
        path: str | bytes | os.PathLike[Any] | Sequence[str | bytes | os.PathLike[Any]],
        dtype: np.dtype | str,
        window: int,
        seed: int,
        transform: Callable[[np.ndarray, np.random.Generator], Any] | None = None,
    ) -> None:
        self.files = resolve_token_files(path)
        self.path = self.files[0] if len(self.files) == 1 else None  # the token file, when there is one
        self.stream = TokenStream(self.files, dtype)
        self.dtype, self.n_tokens = self.stream.dtype, self.stream.n_tokens
        _ints(window=window, seed=seed)
        if not 1 <= window <= self.n_tokens or seed < 0:
            raise ValueError(
                f"need 1 <= window <= the {self.n_tokens} tokens of {self.stream.describe()} and seed >= 0; "
                f"got window={window} seed={seed}"
            )
        self.window, self.seed, self.transform = window, seed, transform
        self._reader_options: dict[str, Any] = {}  # WindowReader's keywords (bench/data_read.py picks a backend)
        self._readers = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        """Paths and settings: readers are per process and per thread (a worker opens its own)."""
        return {key: value for key, value in self.__dict__.items() if key != "_readers"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._readers = threading.local()

    def fingerprint(self) -> str:
        """The data fingerprint a sampler over this stream should record (one file: `data_fingerprint(path)`)."""
        return self.stream.fingerprint()

    def reader(self) -> WindowReader:
        """The calling thread's batch reader (it opens its files, and its AIO context, on first use; it is closed
        when the thread ends or the dataset is dropped). A reader is not safe to share between threads: its
        tickets, its AIO ring and its bounce buffers are one caller's, so threads indexing one dataset at once
        (a thread-pool prefetcher) each read through their own."""
        reader = getattr(self._readers, "reader", None)
        if reader is None:
            reader = self._readers.reader = WindowReader(self.stream, self.window, **self._reader_options)
        return reader

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        """One sample (what a plain per-item DataLoader reads), read as a batch of one: a file that shrank under
        the job is then an OSError naming it, as on the batch path, where a memory map died of SIGBUS."""
        try:
            t, start = key
        except (TypeError, ValueError):
            raise TypeError(f"a key is a (t, start) pair of ints, got {key!r}") from None
        t, start = _ints(t=t, start=start)  # a float start read the window at its floor, named as given
        if not 0 <= t < _INT64_END:
            raise ValueError(f"key {key!r}: t, the sample counter, must be in [0, 2**63), got {t}")
        return self._sample(t, start, self.reader().read([start])[0])

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        """A batch of samples read with one `WindowReader.read` (a DataLoader calls this instead of indexing)."""
        try:
            pairs = np.asarray(keys)
        except ValueError:  # ragged
            pairs = np.asarray([None])
        if pairs.size and (pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu"):
            # a float start was read at its floor (as the sample's start, unlike dataset[key]); an int past int64 is
            # an object array
            raise TypeError(f"keys are (t, start) pairs of ints below 2**63, got {list(keys)[:3]!r}")
        pairs = pairs.astype(np.int64).reshape(-1, 2)
        if (pairs[:, 0] < 0).any():
            bad = pairs[pairs[:, 0] < 0][0].tolist()
            raise ValueError(f"key {tuple(bad)!r}: t, the sample counter, must be in [0, 2**63), got {bad[0]}")
        return self.samples(pairs[:, 0], pairs[:, 1], self.reader().read(pairs[:, 1]))

    def _sample(self, t: int, start: int, tokens: np.ndarray) -> dict[str, Any]:
        out = (
            self.transform(tokens, sample_rng(self.seed, t))
            if self.transform
            else torch.from_numpy(tokens.astype(np.int64))
        )
        return {"t": t, "start": start, "tokens": out}

    def samples(self, counters: np.ndarray, starts: np.ndarray, tokens: np.ndarray) -> list[dict[str, Any]]:
        """Per-sample dicts, as `dataset[(t, start)]` gives them, from a batch of windows already read."""
        return [self._sample(t, s, row) for t, s, row in zip(counters.tolist(), starts.tolist(), tokens)]

    def batch(self, counters: np.ndarray, starts: np.ndarray, tokens: np.ndarray) -> dict[str, Any]:
        """The collated batch, equal to `default_collate(samples(...))`, built without a per-sample step when
        there is no transform."""
        if self.transform is not None:
            return default_collate(self.samples(counters, starts, tokens))
        return {
            "t": torch.from_numpy(np.ascontiguousarray(counters)),
            "start": torch.from_numpy(np.ascontiguousarray(starts)),
            "tokens": torch.from_numpy(tokens.astype(np.int64, copy=False)),
        }


PREFETCH_BATCHES = 4
MAX_PREFETCH_BYTES = 256 << 20


class _SeededFetch(Dataset[Any]):
    """`make_loader`'s dataset. In a DataLoader worker it seeds the global python, numpy and torch CPU RNGs from the
    batch's first sample counter before fetching the batch, so what the dataset, a transform or the collate_fn
    draws from them there (`random`, `np.random`, `torch.rand`, torchvision's random transforms) is a function of
    the batch: the same after a resume and for any number of workers (DataLoader seeds a worker once per iterator,
    so a resumed run's workers started their streams over). The main process's RNGs are training's, captured by
    `RNGState`, and left alone."""

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __getattr__(self, name: str) -> Any:
        """The wrapped dataset's attributes, so that ``loader.dataset.vocab`` still works (not `dataset` itself:
        unpickling in a worker looks attributes up before `__init__`'s are set)."""
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: Any) -> Any:
        return self.dataset[key]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitems__(self, keys: _Keys) -> Any:
        if get_worker_info() is not None:
            seed_global_rngs(self.seed, "worker", keys.counter)
        return self.fetch(keys)

    def fetch(self, keys: Sequence[Any]) -> Any:
        """The batch's samples, as the DataLoader would fetch them from the dataset."""
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(keys) if getitems else [self.dataset[key] for key in keys]


class WindowBatches(_SeededFetch):
    """`make_loader`'s view of a `TokenWindowDataset` under a `RandomWindowSampler`: one call per batch, and the
    reads of this process's next batches in flight before they are asked for.

    The order is a pure function of the counter, so the next batches are computed, not guessed: a process that
    receives the batch at counters c gets c + k * workers * global_batch next (DataLoader hands batches to its
    workers in turn). A prediction is only used when the sampler asks for exactly those keys, so a resume, a
    skip or a changed worker count costs a synchronous read, never a wrong batch. At most `prefetch_batches`
    batches and `max_prefetch_bytes` of windows are read ahead per process.
    """

    def __init__(
        self,
        dataset: TokenWindowDataset,
        sampler: RandomWindowSampler,
        *,
        prefetch_batches: int = PREFETCH_BATCHES,
        max_prefetch_bytes: int = MAX_PREFETCH_BYTES,
        collate: bool = True,
    ) -> None:
        if prefetch_batches < 0 or max_prefetch_bytes < 0:
            raise ValueError(
                f"prefetch_batches and max_prefetch_bytes must be >= 0, got {prefetch_batches}, {max_prefetch_bytes}"
            )
        super().__init__(dataset, sampler.seed)
        self.sampler, self.collate = sampler, collate
        self.prefetch_batches, self.max_prefetch_bytes = prefetch_batches, max_prefetch_bytes
        self._pending: dict[int, tuple[np.ndarray, int]] = {}  # first counter -> (its starts, reader ticket)
        self._pid = -1
        self.hits = self.misses = 0  # this process's batches served from the read-ahead / read on request

    def __getstate__(self) -> dict[str, Any]:
        """Workers start with nothing in flight (a reader's tickets are per process)."""
        return {**self.__dict__, "_pending": {}, "_pid": -1, "hits": 0, "misses": 0}

    def fetch(self, keys: Sequence[tuple[int, int]]) -> Any:
        """The batch for these keys (collated unless the loader has its own collate_fn), then the next reads."""
        pairs = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
        counters, starts = pairs[:, 0], pairs[:, 1]
        reader = self.dataset.reader()
        # a collated batch without a transform is int64: the reader widens as it copies out, once
        dtype = np.int64 if self.collate and self.dataset.transform is None else None
        if self._pid != os.getpid():
            self._pid, self._pending = os.getpid(), {}
        hit = self._pending.pop(int(counters[0]), None) if len(counters) else None
        if hit is not None and np.array_equal(hit[0], starts):
            tokens = reader.collect(hit[1], dtype)
            self.hits += 1
        else:  # not foreseen (first batch, resume, skip): drop what was read ahead, read this one now
            reader.drain()
            self._pending.clear()
            tokens = reader.read(starts, dtype)
            self.misses += 1
        self._read_ahead(counters)
        if self.collate:
            return self.dataset.batch(counters, starts, tokens)
        return self.dataset.samples(counters, starts, tokens)

    def _read_ahead(self, counters: np.ndarray) -> None:
        """Submit this process's next batches (those not yet in flight), within the count and byte bounds."""
        info = get_worker_info()
        step = (info.num_workers if info else 1) * self.sampler.global_batch_size
        batch_bytes = max(1, len(counters) * self.dataset.window * self.dataset.dtype.itemsize)
        depth = min(self.prefetch_batches, self.max_prefetch_bytes // batch_bytes)
        reader = self.dataset.reader()
        for k in range(1, depth + 1):
            ahead = counters + k * step
            if int(ahead[0]) not in self._pending:
                starts = self.sampler._values(self.sampler.indices(ahead))
                self._pending[int(ahead[0])] = (starts, reader.submit(starts))


def _collated(batch: Any) -> Any:
    """collate_fn for `WindowBatches`: its batches come collated already."""
    return batch


class _Loader(DataLoader[Any]):
    """`make_loader`'s DataLoader. Its workers leave preemption signals to the main process (`_worker_init`), which
    ends them itself at exit (`_end_workers`): multiprocessing would SIGTERM them, and then wait for good. With a
    `tracker`, each wait for a batch is timed as a ``data_wait`` span."""

    tracker: CheckpointObserver = NO_TRACKER

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        return batches if self.tracker is NO_TRACKER else _timed(batches, self.tracker)

    def _get_iterator(self) -> Any:
        batches = super()._get_iterator()
        if self.num_workers > 0:
            with _LIVE_LOCK:
                atexit.unregister(_end_workers)  # once, and after multiprocessing's own exit function: runs before it
                atexit.register(_end_workers)
                _LIVE_WORKERS.add(batches)
        return batches


_LIVE_WORKERS: weakref.WeakSet[Any] = weakref.WeakSet()  # iterators of `_Loader`s with workers
_LIVE_LOCK = threading.Lock()


def _end_workers() -> None:
    """At exit: end the workers of every live iterator as the DataLoader does when done with them (a sentinel, a
    join), before multiprocessing's exit would SIGTERM them, which they ignore (a preemption's signal)."""
    for batches in list(_LIVE_WORKERS):
        with contextlib.suppress(Exception):
            batches._shutdown_workers()


_END = object()


def _timed(batches: Iterator[Any], tracker: CheckpointObserver) -> Iterator[Any]:
    """Yield `batches`, each `next()` inside a ``data_wait`` span (the wait for the end too: it is the loader's)."""
    while True:
        with tracker.span("data_wait"):
            batch = next(batches, _END)
        if batch is _END:
            return
        yield batch


# Signals a preemption may send to the whole process group (`kill -TERM -PGID`, SLURM's scancel, a cgroup stop): the
# ones `ckpt.Preemption` handles by default, and SIGUSR2. torch's workers die of them (SIGTERM from another process
# than their parent is re-raised with its default action), and the main process then raises "DataLoader worker ...
# is killed by signal" from the next batch or wait(), instead of saving and exiting.
_WORKERS_IGNORE = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _worker_init(user_init: Callable[[int], Any] | None, worker_id: int) -> None:
    """A `make_loader` worker: leaves preemption signals to the main process (which ends the workers itself, as
    `_Loader` does), then runs the caller's own `worker_init_fn`."""
    for signum in _WORKERS_IGNORE:
        signal.signal(signum, signal.SIG_IGN)
    if user_init is not None:
        user_init(worker_id)


_GENERATORS = (random.Random, np.random.Generator, np.random.RandomState, torch.Generator)


def _warn_of_held_generators(dataset: Any, workers: int) -> None:
    """Warn of each generator `dataset` holds as an attribute when workers will copy it: a copy starts over at
    every iter() (so at a resume) and draws for the batches its worker gets, so its draws are not resumed."""
    if not workers:
        return
    for name, value in getattr(dataset, "__dict__", {}).items():
        if isinstance(value, _GENERATORS):
            warnings.warn(
                f"dataset attribute {name!r} is a {type(value).__name__}: each DataLoader worker ({workers}) holds a "
                "copy that starts over at every iter(), so what the dataset draws from it differs after a resume (or "
                "with another worker count); draw from random, np.random or torch instead (make_loader seeds them per "
                "batch)",
                RuntimeWarning,
                stacklevel=3,
            )


def make_loader(
    dataset: Dataset[Any],
    sampler: _CounterSampler,
    *,
    tracker: CheckpointObserver | None = None,
    prefetch_batches: int = PREFETCH_BATCHES,
    max_prefetch_bytes: int = MAX_PREFETCH_BYTES,
    **kwargs: Any,
) -> DataLoader[Any]:
    """A DataLoader over the sampler's batches whose iter() does not draw from the global torch RNG, nor from any
    generator training uses: `generator=` is refused (iter() draws from it, once more at each resume).

    A `TokenWindowDataset` under a `RandomWindowSampler` is served through `WindowBatches` (batch reads at the
    disk's random-read rate, the next batches read ahead within `prefetch_batches` / `max_prefetch_bytes` per
    process), with `pin_memory` on by default when CUDA is present; the batches are the same as per-item reads.
    With a `tracker` (an `ettr.GoodputTracker`, or any `CheckpointObserver`), the time training waits for each
    batch is recorded as ``data_wait``, so the goodput report shows the data's share with no code in the loop.
    A worker seeds its global python, numpy and torch RNGs from each batch's first sample counter before fetching
    it (`_SeededFetch`): what the dataset draws from them there is the same after a resume.
    """
    if "generator" in kwargs:  # training's own generator, or None (the global torch RNG): a resume shifts its stream
        raise ValueError(
            f"generator={kwargs['generator']!r}: the DataLoader draws from it at every iter(), which a resume repeats, "
            "so the numbers training draws from it after the resume differ; make_loader uses a generator of its own "
            "(from the sampler's seed; the order is the sampler's and workers' RNGs are seeded per batch): drop it"
        )
    kwargs["generator"] = torch_generator(sampler.seed, "loader")
    kwargs["worker_init_fn"] = functools.partial(_worker_init, kwargs.get("worker_init_fn"))
    if isinstance(dataset, TokenWindowDataset) and isinstance(sampler, RandomWindowSampler):
        if sampler.window != dataset.window or sampler.n_tokens > dataset.n_tokens:
            raise ValueError(  # other windows than explain() and the batch hashes name, or windows past the end
                f"the sampler (window {sampler.window}, {sampler.n_tokens} tokens) does not fit the dataset (window "
                f"{dataset.window}, {dataset.n_tokens} tokens): build both from one stream"
            )
        if sampler.fingerprint is not None and sampler.fingerprint != dataset.fingerprint():
            raise DataMismatchError(  # its load_state_dict checked the resume against other data than is read
                f"the sampler's fingerprint {sampler.fingerprint!r} is not the dataset's {dataset.fingerprint()!r} "
                f"({dataset.stream.describe()}): build the sampler with fingerprint=dataset.fingerprint()"
            )
        collate = "collate_fn" not in kwargs
        dataset = WindowBatches(
            dataset, sampler, prefetch_batches=prefetch_batches, max_prefetch_bytes=max_prefetch_bytes, collate=collate
        )
        if collate:
            kwargs["collate_fn"] = _collated
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
    elif not isinstance(dataset, IterableDataset):  # DataLoader refuses those under a batch sampler
        if isinstance(sampler, ShuffledSampler) and isinstance(dataset, Sized) and sampler.num_items > len(dataset):
            raise ValueError(  # an IndexError at whichever batch first held an item past the end
                f"the sampler ({sampler.num_items} items) does not fit the dataset ({len(dataset)} items)"
            )
        _warn_of_held_generators(dataset, kwargs.get("num_workers", 0))
        dataset = _SeededFetch(dataset, sampler.seed)
    loader = _Loader(dataset, batch_sampler=sampler, **kwargs)
    if tracker is not None:
        loader.tracker = tracker
    return loader
