"""The overlapped snapshot (``CheckpointManager(snapshot="overlap")``, opt-in; the default ``"sync"`` copies every
tensor inside `save`): tensors that only an optimizer's step changes are copied after `save` returns.

Between one optimizer step and the next, a model's parameters and its optimizer's state do not change: forward
and backward read them and write activations and gradients. So their copy into the host arena can run beside
the next step's forward and backward instead of inside `save`, and the next ``optimizer.step()`` of any torch
optimizer waits for that copy first (`Fence`, a global step pre-hook): no step changes a tensor while it is
copied. Everything else (buffers such as BatchNorm's running statistics, which forward changes; plain tensors;
RNG and JSON leaves) is still copied inside `save`.

The contract of the mode: between `save` and the next optimizer step nothing else writes those tensors (or
`SaveHandle.wait_snapshot()` is called first). A tensor changed in place by anything else before its copy is
taken (``p.mul_()`` outside a step, ``load_state_dict``, ``nn.Embedding(max_norm=...)``'s renorm in forward) has
its version counter bumped; the copy compares the counters afterwards and fails the save, naming the keys,
instead of committing a mixed state (whether the write or the copy comes first is a race). The counters compared
are the saved tensor's and the optimizer's own tensor's of the same memory (a ``p.data`` in the state has a counter
of its own, which a ``p.mul_()`` does not bump). Writes through ``p.data``, numpy views, EMA swaps through ``.data``
bypass version counters: they are committed silently.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from .errors import StateChangedError
from .staging import Copy, copy
from .state import is_dtensor, short_storage

MODES = ("overlap", "sync")


def optimizer_owned(state: Mapping[str, Any]) -> dict[int, torch.Tensor]:
    """Storage address -> the first of the parameters and state tensors of every torch optimizer in `state` found in
    that storage (at any depth of its dicts, lists and tuples; wrappers such as accelerate's delegate `param_groups`
    and `state`)."""
    owned: dict[int, torch.Tensor] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            local = (t.to_local() if is_dtensor(t) else t).detach()  # its version counter, whatever swaps `t`'s later
            owned.setdefault(local.untyped_storage().data_ptr(), local)

    def visit(x: Any, depth: int) -> None:
        if depth > 16:
            return
        if isinstance(x, torch.optim.Optimizer):
            for group in x.param_groups:
                for p in group["params"]:
                    add(p)
            for per_param in x.state.values():
                for t in per_param.values() if isinstance(per_param, Mapping) else ():
                    add(t)
        elif isinstance(x, Mapping):
            for v in x.values():
                visit(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v, depth + 1)

    visit(state, 0)
    return owned


Watched = tuple[int, torch.Tensor, int]  # a deferred tensor's version, its storage's optimizer tensor and that one's


def versions(tensors: Mapping[str, torch.Tensor], owned: Mapping[int, torch.Tensor]) -> dict[str, Watched]:
    """The tensors whose copy may wait for the next optimizer step: name -> (its version counter now, the optimizer's
    tensor of its storage, that one's counter now: a ``p.data`` in the state counts apart from ``p``). Only tensors in
    `owned` storages, and only those with a version counter (inference tensors have none: copied at once)."""
    if not owned:
        return {}
    out = {}
    for name, t in tensors.items():
        owner = owned.get(t.untyped_storage().data_ptr())
        if owner is not None and not t.is_inference():
            out[name] = (t._version, owner, owner._version)
    return out


class Pending:
    """The deferred copies of one save: `run` makes them on the snapshot thread and checks that none of their
    sources changed meanwhile; `wait` blocks until then (the fence, the write before it reads the arena)."""

    def __init__(
        self, step: int, copies: list[Copy], tensors: Mapping[str, torch.Tensor], watched: Mapping[str, Watched]
    ):
        self.step, self._copies, self._tensors = step, copies, tensors
        self._versions = {name: v for name, (v, _, _) in watched.items()}
        self._owners = {name: (owner, v) for name, (_, owner, v) in watched.items()}
        # made in `save`, on the training thread: the work it queued so far on each CUDA source's device (its current
        # stream: a loop under ``torch.cuda.stream(s)``, a CUDA graph's replay), which the copies on the snapshot
        # thread's stream must follow; that stream does not wait for another one by itself
        self._queued = [
            (device, torch.cuda.current_stream(device).record_event())
            for device in {src.device for _, src in copies if src.is_cuda}
        ]
        self._done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for device, queued in self._queued:
                torch.cuda.current_stream(device).wait_event(queued)
            freed = [
                f"{name!r} (needs {short[1]} bytes of its storage, which now has {short[0]})"
                for name in self._versions
                if (short := short_storage(self._tensors[name])) is not None
            ]
            if freed:  # its memory given back (``untyped_storage().resize_(0)``, FSDP's free): a copy would crash
                raise StateChangedError(
                    f"the storage of tensors was freed or shrunk after save(step={self.step}) returned, before their "
                    f"snapshot was copied: {', '.join(freed[:5])}. Call SaveHandle.wait_snapshot() before freeing them"
                )
            copy(self._copies)
            changed = [
                f"{name!r} (version {v} -> {t._version})"
                for name in self._versions
                for t, v in ((self._tensors[name], self._versions[name]), self._owners[name])
                if t._version != v
            ]
            if changed:
                raise StateChangedError(
                    f"tensors were changed in place after save(step={self.step}) returned, before their snapshot "
                    f"was copied: {', '.join(changed[:5])}{f' and {len(changed) - 5} more' if len(changed) > 5 else ''}."
                    " Only an optimizer's step() waits for the snapshot: call SaveHandle.wait_snapshot() before "
                    "changing them otherwise, or use the default CheckpointManager(snapshot='sync')"
                )
        except BaseException as e:
            self.error = e
        finally:
            self._copies, self._tensors, self._owners, self._queued = [], {}, {}, []  # sources unreferenced once copied
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def result(self) -> None:
        """Wait, then raise the copy's error (the write path: nothing of a torn snapshot is committed)."""
        self.wait()
        if self.error is not None:
            raise self.error


class Fence:
    """A global optimizer step pre-hook: every ``optimizer.step()`` first waits for the snapshot in flight.

    Registered once per manager and removed when the manager closes. The hook holds the waiting function weakly
    (the optimizer never keeps a manager alive), so a manager collected without a close leaves a no-op hook, which
    the next fence made or closed removes (`weakref.finalize` on the waiting function's owner marks it): not the
    collection itself, which may run inside a step (a garbage collection on any thread, the training one
    included, while torch iterates the hooks), where a removal breaks that step ("OrderedDict mutated during
    iteration"). A forked child (which has no snapshot thread) never waits.
    """

    def __init__(self, wait: Callable[[], None]):
        _remove_orphans()
        ref, pid = weakref.WeakMethod(wait), os.getpid()

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            waiting = ref()
            if waiting is not None and os.getpid() == pid:
                waiting()

        self._handle = register_optimizer_step_pre_hook(hook)
        self._orphaned = weakref.finalize(getattr(wait, "__self__", wait), _orphan, self._handle)

    def close(self) -> None:
        if self._orphaned.detach() is not None:  # not yet collected, so not yet in _ORPHANS
            self._handle.remove()
        _remove_orphans()


_ORPHANS: list[RemovableHandle] = []  # hooks of managers collected without a close, removed at a safe point


def _orphan(handle: RemovableHandle) -> None:
    """Mark a collected manager's hook for removal at the next safe point (`_remove_orphans`), not here. No lock: a
    finalizer may run inside `_remove_orphans` itself (a collection at any allocation), where one would deadlock;
    list.append and list.pop are atomic."""
    _ORPHANS.append(handle)


def _remove_orphans() -> None:
    """Remove the hooks of collected managers: called as a fence is made or closed, not from inside a step."""
    while _ORPHANS:
        try:
            handle = _ORPHANS.pop()
        except IndexError:  # another thread took the last one
            return
        handle.remove()
