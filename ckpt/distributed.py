"""Ranks: this process's place among them, the collectives of checkpointing, and the box of the global array a
(D)Tensor holds. Who writes which box is `planner.py`'s.

Every collective runs on a dedicated gloo group (created with the manager, with a timeout), never on
the training group, so background saves do not interleave with training collectives (NCCL or gloo)
and a dead rank turns into an error after the timeout instead of a hang.
"""

from __future__ import annotations

import functools
import json
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .errors import StateMismatchError
from .format import ArrayInfo
from .state import is_dtensor

Box = tuple[tuple[int, int], ...]


def topology() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's when initialized, else (0, 1). The one place ckpt
    asks; ettr reads the launcher's variables itself, so that it stands without ckpt."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` is true on every rank."""
        return flag

    def barrier(self) -> None:
        """Wait until every rank is here."""

    def send(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        """Start sending `data` (a contiguous CPU tensor) to rank `peer`, whose `receive` names the same `tag`;
        returns the transfer, whose `wait()` returns once it ended."""
        raise ValueError(f"a rank alone has no rank {peer} to send to")

    def receive(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        """Start filling `data` with what rank `peer` sends with `tag`; returns the transfer (`wait()`)."""
        raise ValueError(f"a rank alone has no rank {peer} to receive from")


class GlooRanks(Ranks):
    """The ranks of torch.distributed, through a gloo group of their own (created once, with a timeout)."""

    def __init__(self, timeout: timedelta):
        super().__init__(*topology())
        self.group = dist.new_group(backend="gloo", timeout=timeout)

    # JSON values travel as bytes over gloo (no pickle), each padded to the longest with its length in front

    def _longest(self, data: bytes) -> int:
        """The longest of every rank's encoded value (the framing included)."""
        n = torch.tensor([len(data) + _LEN], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return int(n.item())

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON value, in rank order."""
        data = _encode(obj)
        longest = self._longest(data)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, _framed(data, longest), group=self.group)
        return [_decode(o) for o in out]

    def gather_json(self, obj: Any) -> list[Any] | None:
        data = _encode(obj)
        longest = self._longest(data)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)] if self.leader else None
        dist.gather(_framed(data, longest), out, dst=0, group=self.group)
        return None if out is None else [_decode(o) for o in out]

    def scatter_json(self, parts: list[Any] | None) -> Any:
        encoded = [_encode(p) for p in parts] if self.leader and parts is not None else []
        longest = torch.tensor([max(map(len, encoded), default=0) + _LEN], dtype=torch.int64)
        dist.broadcast(longest, src=0, group=self.group)
        n = int(longest.item())
        out = torch.empty(n, dtype=torch.uint8)
        dist.scatter(out, [_framed(d, n) for d in encoded] if self.leader else None, src=0, group=self.group)
        return _decode(out)

    def broadcast_json(self, obj: Any) -> Any:
        data = _encode(obj) if self.leader else b""
        n = torch.tensor([len(data) + _LEN], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group)
        out = _framed(data, int(n.item()))
        dist.broadcast(out, src=0, group=self.group)
        return _decode(out)

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def send(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.isend(data, peer, group=self.group, tag=tag)

    def receive(self, data: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.irecv(data, peer, group=self.group, tag=tag)


_LEN = 8  # bytes of the length in front of an encoded value


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False).encode()


def _framed(data: bytes, size: int) -> torch.Tensor:
    """`data` with its length in front, zero-padded to `size` bytes, as a uint8 tensor."""
    out = torch.zeros(size, dtype=torch.uint8)
    framed = len(data).to_bytes(_LEN, "little") + data
    out[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
    return out


def _decode(t: torch.Tensor) -> Any:
    raw = t.numpy().tobytes()
    return json.loads(raw[_LEN : _LEN + int.from_bytes(raw[:_LEN], "little")])


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """The local data of a (D)Tensor and the box of the global array it covers."""
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple((o, o + s) for o, s in zip(offset, shape))
    return t, _whole(tuple(t.shape))


@functools.lru_cache(maxsize=1 << 16)  # the same shapes come back every save; this is on the stall path
def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def read_region(info: ArrayInfo, template: Any) -> tuple[Any, Box] | None:
    """For a DTensor target, the local shard and the box of the global array it holds; else None (read whole)."""
    if not is_dtensor(template):
        return None
    if tuple(template.shape) != info.shape:
        raise StateMismatchError(
            f"restore of key {info.name!r}: checkpoint has global shape {list(info.shape)}, "
            f"the target DTensor has {list(template.shape)}"
        )
    return template, local_box(template)[1]


def prepare_optimizers(state: Mapping[str, Any], keys: Any) -> None:
    """Give optimizers of sharded (DTensor) parameters their state tensors, so a restore can fill them in place."""
    for k, v in state.items():
        if (
            (keys is None or k in keys)
            and isinstance(v, torch.optim.Optimizer)
            and not v.state
            and any(is_dtensor(p) for g in v.param_groups for p in g["params"])
        ):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(v)
