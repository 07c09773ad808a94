"""Ranks: this process's place among them, the collectives of checkpointing, and the box of the global array a
(D)Tensor holds. Who writes which box is `planner.py`'s.

Every collective runs on a dedicated gloo group (created with the manager, with a timeout), never on
the training group, so background saves do not interleave with training collectives (NCCL or gloo)
and a dead rank turns into an error after the timeout instead of a hang.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from .errors import CollectiveTimeout, StateMismatchError, from_leader, leader_failure
from .format import ArrayInfo, torch_dtype
from .state import is_dtensor, is_partial

Box = tuple[tuple[int, int], ...]


def topology() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's when initialized, else (0, 1). The one place ckpt
    asks; ettr reads the launcher's variables itself, so that it stands without ckpt."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def ranks_per_node() -> int:
    """Ranks on this process's node: torchrun's ``LOCAL_WORLD_SIZE``, else 1 (unset, empty, not a positive integer)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


class Ranks:
    """This process's place among the ranks and the collectives of checkpointing; alone (`local`) they are trivial."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    @classmethod
    def local(cls) -> "Ranks":
        """A process alone: world size 1, a gather returns its own value, a barrier returns at once."""
        return cls()

    @staticmethod
    def current(timeout: timedelta) -> "Ranks":
        """The ranks of torch.distributed when it is initialized (with a gloo group of their own), else `local()`."""
        return GlooRanks(timeout) if dist.is_available() and dist.is_initialized() else Ranks.local()

    @property
    def leader(self) -> bool:
        """Rank 0: it holds the root's lease, commits, retains and quarantines for all."""
        return self.rank == 0

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON value, in rank order."""
        return [obj]

    def gather_json(self, obj: Any) -> list[Any] | None:
        """Every rank's JSON value, in rank order, on the leader; None on the other ranks."""
        return [obj]

    def scatter_json(self, parts: list[Any] | None) -> Any:
        """The leader's `parts[r]` on each rank r (`parts` is read on the leader only)."""
        assert parts is not None
        return parts[0]

    def broadcast_json(self, obj: Any) -> Any:
        """The leader's JSON value on every rank (`obj` is read on the leader only)."""
        return obj

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """The leader's bytes on every rank (`data` is read on the leader only): a large value (a manifest) that every
        rank would otherwise read from the root itself."""
        assert data is not None
        return data

    def max_ints(self, values: list[int]) -> list[int]:
        """Each of `values`' largest value among the ranks (a reduction: O(log ranks) messages, for every step)."""
        return list(values)

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` is true on every rank."""
        return flag

    def barrier(self) -> None:
        """Wait until every rank is here."""

    def close(self) -> None:
        """Give back what the ranks' messages hold (nothing for a rank alone)."""

    def send(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        """Start sending `data` (a contiguous CPU tensor) to rank `peer`, whose `receive` names the same `tag` (not 0:
        the collectives' own); returns the transfer, whose `wait()` returns once it ended."""
        raise ValueError(f"a rank alone has no rank {peer} to send to")

    def receive(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        """Start filling `data` with what rank `peer` sends with `tag`; returns the transfer (`wait()`)."""
        raise ValueError(f"a rank alone has no rank {peer} to receive from")


class GlooRanks(Ranks):
    """The ranks of torch.distributed, through a gloo group of their own (created once, with a timeout).

    Every collective is a star of point-to-point messages through the leader (JSON values as bytes, no pickle): each
    rank knows which rank it waits for, so one that never answers within the timeout (dead, partitioned, stopped)
    or whose connection closed is named in the `CollectiveTimeout` every waiting rank raises."""

    def __init__(self, timeout: timedelta):
        super().__init__(*topology())
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._broken: CollectiveTimeout | None = None  # gloo closes a pair that timed out: the group is done for

    def close(self) -> None:
        """Destroy the group: its sockets and threads (~5 fds and 3 threads a rank) would otherwise live as long as
        the process, one set per manager an evaluation sweep opens."""
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def _op(self, op: str, peer: int | None, call: Callable[[], Any]) -> Any:
        """`call()`, a message to or from rank `peer` (None: a reduction among all): a timeout or a closed connection
        (raised by the call or by the wait) becomes a `CollectiveTimeout` naming `peer`."""
        if self._broken is not None:  # every later message would fail at once, naming a closed pair, not the cause
            raise CollectiveTimeout(
                op,
                self.rank,
                peer,
                RuntimeError(
                    f"this manager's group broke earlier ({self._broken}); the ranks are out of step: make a new "
                    "CheckpointManager on every rank"
                ),
            )
        try:
            return call()
        except RuntimeError as e:
            self._broken = CollectiveTimeout(op, self.rank, peer, e)
            raise self._broken from e

    def _send(self, op: str, messages: Mapping[int, bytes]) -> None:
        """Send each rank its bytes (the length first), all at once; return once every send is done. The same bytes
        sent to several ranks are copied into a tensor once."""
        sent, payloads = [], {}
        for dst, data in messages.items():
            tensors = [torch.tensor([len(data)], dtype=torch.int64)]
            if data:
                if id(data) not in payloads:
                    payloads[id(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                tensors.append(payloads[id(data)])
            for t in tensors:  # each tensor lives until its send is done
                sent.append((dst, t, self._op(op, dst, lambda t=t, dst=dst: dist.isend(t, dst=dst, group=self.group))))
        for dst, _, work in sent:
            self._op(op, dst, work.wait)

    def _recv(self, op: str, src: int) -> bytes:
        length = torch.zeros(1, dtype=torch.int64)
        self._op(op, src, lambda: dist.irecv(length, src=src, group=self.group).wait())
        if not int(length.item()):
            return b""
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._op(op, src, lambda: dist.irecv(payload, src=src, group=self.group).wait())
        return payload.numpy().tobytes()

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON value, in rank order."""
        return self.broadcast_json(self.gather_json(obj, "an all-gather"), "an all-gather")

    def gather_json(self, obj: Any, op: str = "a gather") -> list[Any] | None:
        data = _encode(obj)
        if not self.leader:
            self._send(op, {0: data})
            return None
        return [json.loads(data if r == 0 else self._recv(op, r)) for r in range(self.world_size)]

    def scatter_json(self, parts: list[Any] | None) -> Any:
        if not self.leader:
            return json.loads(self._recv("a scatter", 0))
        encoded = [_encode(p) for p in parts]
        self._send("a scatter", {r: encoded[r] for r in range(1, self.world_size)})
        return json.loads(encoded[0])

    def broadcast_json(self, obj: Any, op: str = "a broadcast") -> Any:
        if not self.leader:
            return json.loads(self._recv(op, 0))
        data = _encode(obj)
        self._send(op, {r: data for r in range(1, self.world_size)})
        return json.loads(data)

    def broadcast_bytes(self, data: bytes | None, op: str = "a broadcast of bytes") -> bytes:
        """Down a binomial tree rooted at the leader, not a star: each rank receives the bytes from its parent and
        sends them on to its children, so the leader sends log2(ranks) copies, not ranks - 1 (a 100 MB manifest to
        1,000 ranks: 10 copies from the leader, 10 transfers deep). A rank whose parent never sends names it, and
        the ranks the bytes come through (the one that failed may be above it)."""
        parent, children = _tree(self.rank, self.world_size)
        if parent is not None:
            path, up = [parent], parent
            while up:
                up = _tree(up, self.world_size)[0] or 0
                path.append(up)
            via = f" (from {' -> '.join(f'rank {r}' for r in reversed(path))})" if parent else ""
            data = self._recv(op + via, parent)
        assert data is not None
        if children:
            self._send(op, {c: data for c in children})
        return data

    def max_ints(self, values: list[int]) -> list[int]:
        out = torch.tensor(values, dtype=torch.int64)
        self._op("an all-reduce", None, lambda: dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group))
        return out.tolist()

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather_json(bool(flag)))

    def barrier(self) -> None:
        self.all_gather_json(None)

    def send(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.isend(data, peer, group=self.group, tag=tag)

    def receive(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.irecv(data, peer, group=self.group, tag=tag)


def leader_reads(ranks: Ranks, read: Callable[[], Any], doing: str, *, raw: bool = False) -> Any:
    """`read()` on the leader alone, its value on every rank: what every rank needs from one shared root (a step's
    manifest and listing, the committed steps) is read once, not once per rank. Collective: every
    rank calls it and takes part in its messages whatever it meets. What the leader meets reaches every rank: the
    leader raises its own error, the others `errors.from_leader` of it (a missing step as StepNotFoundError, damage
    as the same CorruptCheckpointError, any other error as a CheckpointError naming rank 0 and what it was `doing`).
    `raw`: the value is bytes, sent down a tree (`broadcast_bytes`) after the outcome; else a JSON value, sent with
    it."""
    if ranks.world_size == 1:
        return read()
    value, failure = None, None
    if ranks.leader:
        try:
            value = read()
        except Exception as e:  # told to every rank, which then fails as this one does
            failure = e
    told = None if failure is None else leader_failure(failure)
    if raw:
        told = ranks.broadcast_json(told)
    else:
        told, value = ranks.broadcast_json([told, value])
    if failure is not None:
        raise failure
    if told is not None:
        raise from_leader(told, doing)
    return ranks.broadcast_bytes(value) if raw else value


def _tree(rank: int, world_size: int) -> tuple[int | None, list[int]]:
    """`rank`'s parent (None for the leader) and children, largest subtree first, in the binomial tree of
    `world_size` ranks rooted at rank 0: rank r's parent is r less its lowest set bit, its children r + 2^k for every
    2^k below that bit (below `world_size` for the leader)."""
    low = rank & -rank if rank else 1 << max(world_size - 1, 0).bit_length()
    parent = rank - low if rank else None
    children = [rank + (1 << k) for k in reversed(range(low.bit_length() - 1)) if rank + (1 << k) < world_size]
    return parent, children


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False).encode()


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """The local data of a (D)Tensor and the box of the global array it covers."""
    if is_dtensor(t):
        mesh = t.device_mesh  # the key holds our coordinate: an equal mesh of a later group may place us elsewhere
        where = tuple(mesh.get_coordinate() or ())
        return t.to_local(), _shard_box(tuple(t.shape), mesh, tuple(t.placements), where)
    return t, _whole(tuple(t.shape))


@functools.lru_cache(maxsize=1 << 16)  # every save and restore asks again: ~23 us a DTensor computed, ~1 us cached
def _shard_box(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], coordinate: tuple[int, ...]) -> Box:
    """The box this rank's shard covers of a global array of `shape` laid out on `mesh` by `placements`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple((o, o + s) for o, s in zip(offset, local))


@functools.lru_cache(maxsize=1 << 16)  # the same shapes come back every save; this is on the stall path
def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def read_region(info: ArrayInfo, template: Any, key: str) -> tuple[Any, Box] | None:
    """For a DTensor target (at `key`, which errors name), the local shard and the box of the global array it holds;
    else None (read whole)."""
    if not is_dtensor(template):
        return None
    if tuple(template.shape) != info.shape:
        raise StateMismatchError(
            f"restore of key {key!r}: checkpoint has global shape {list(info.shape)}, "
            f"the target DTensor has {list(template.shape)}"
        )
    if is_partial(template):  # each rank would take the whole value: their sum (the DTensor's value) N times it
        raise StateMismatchError(
            f"restore of key {key!r}: the target DTensor has placements {tuple(template.placements)}, and a Partial "
            f"placement (a reduction still pending) cannot take a value; redistribute it to Replicate or Shard first"
        )
    return template, local_box(template)[1]


class ShardedLike:
    """Where a restore reads an optimizer's state tensor for a DTensor parameter that has no state yet: sharded as
    the parameter is, when the saved array has its shape (not the step count)."""

    def __init__(self, param: Any, key: Any):
        self.param, self.key = param, key

    def tensor(self, info: ArrayInfo) -> torch.Tensor | None:
        """An uninitialised DTensor laid out as the parameter, of the saved dtype; None: read the array whole.

        Made from a local tensor: `torch.empty_like` on the DTensor runs DTensor's sharding propagation, ~1 ms for
        each shape a fresh process has not met yet, against ~30 us."""
        from torch.distributed.tensor import DTensor

        p = self.param
        if tuple(p.shape) != info.shape or (p.dim() == 0 and self.key == "step"):
            return None
        local = torch.empty_like(p.to_local(), dtype=torch_dtype(info.dtype))
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


class _EveryKey(Mapping):
    """The template of one parameter's optimizer state: any key (exp_avg, momentum_buffer...) is sharded like it."""

    def __init__(self, param: Any):
        self.param = param

    def __getitem__(self, key: Any) -> ShardedLike:
        return ShardedLike(self.param, key)

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0


def restore_template(obj: Any) -> Any:
    """What a restore reads a Stateful object's state into: its state_dict, and for an optimizer of DTensor parameters
    that has no state yet (a fresh process), per parameter a template that shards each state tensor like it. DCP
    runs an optimizer step on zero gradients instead (`_init_optim_state`): that costs a step's compute and leaves
    state (step 1) behind even when there is no checkpoint."""
    sd = obj.state_dict()
    if isinstance(obj, torch.optim.Optimizer) and not obj.state:
        params = [p for g in obj.param_groups for p in g["params"]]
        if any(is_dtensor(p) for p in params):
            sd = {**sd, "state": {i: _EveryKey(p) for i, p in enumerate(params) if is_dtensor(p)}}
    return sd
