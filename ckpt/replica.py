"""Mechanism of the peer replica: a step committed in one rank's local tier sent over gloo into another rank's.

A rank's local tier holds what that rank needs to restore, and a node's loss takes it away. So after each local
commit every rank sends its step's files to its peer (a ring, r -> r+1 by default), which keeps them under
``_replica/rank_<r>/`` of its own local tier: a root of the same layout, its manifest written last. When a
rank's local tier is lost, its peer sends the copy back (`transfer` the other way) and the restore reads it as
a local step. Bytes travel as uint8 tensors on the manager's own gloo group (no pickle); the received files are
checked, like any local step, when a restore reads them. The tiers policy decides who sends what to whom.
"""

from __future__ import annotations

import json
import os
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import layout
from .distributed import Ranks
from .errors import CollectiveTimeout
from .save import begin_step, commit_step
from .storage import LocalStorage

PIECE = 64 << 20  # bytes per message: a file larger than this goes in several


class Transferred(NamedTuple):
    """What one `transfer` did: bytes received, and seconds until the peers met (the first message between them
    arrives once both are in `transfer`), so a log can tell waiting for a late peer from moving bytes."""

    received: int
    waited: float


def _files(storage: LocalStorage, step: int) -> list[tuple[str, int]]:
    """(path relative to the step directory, size) of a committed local step's files, the manifest last."""
    base = storage.local_path(layout.step_dir(step))
    skip = {layout.MANIFEST, layout.IN_PROGRESS}
    files = [
        (f, os.path.getsize(os.path.join(base, f))) for f in storage.list_files(layout.step_dir(step)) if f not in skip
    ]
    manifest = os.path.join(base, layout.MANIFEST)
    return files + [(layout.MANIFEST, os.path.getsize(manifest))]


def _pieces(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + PIECE, size)) for a in range(0, size, PIECE)]


def transfer(
    ranks: Ranks,
    step: int,
    *,
    send_to: int | None = None,
    source: LocalStorage | None = None,
    recv_from: int | None = None,
    dest: LocalStorage | None = None,
) -> Transferred:
    """Send `source`'s step to rank `send_to` and/or receive rank `recv_from`'s into `dest`, both at once.

    The receiver writes every file, then the manifest last, only if the sender read every file it sent; a step
    already committed in `dest` is replaced (a replica is a copy). Returns the bytes received and the wait.
    """
    began = time.perf_counter()
    group = getattr(ranks, "group", None)
    op = f"the replica of step {step}"

    def exchange(out: torch.Tensor | None, into: torch.Tensor | None) -> None:
        peer = send_to
        try:
            request = dist.isend(out, dst=send_to, group=group) if out is not None else None
            peer = recv_from
            if into is not None:
                dist.recv(into, src=recv_from, group=group)
            peer = send_to
            if request is not None:
                request.wait()
        except RuntimeError as e:  # a timeout or a closed connection: name the rank this one waited for
            raise CollectiveTimeout(op, ranks.rank, peer, e) from e

    sending = send_to is not None
    receiving = recv_from is not None
    read_error: BaseException | None = None
    try:
        files = _files(source, step) if sending else []
    except OSError as e:  # the receiver still gets a header (no files, no manifest) and fails, instead of hanging
        files, read_error = [], e
    header = json.dumps(files).encode()
    length = torch.zeros(1, dtype=torch.int64)
    exchange(torch.tensor([len(header)], dtype=torch.int64) if sending else None, length if receiving else None)
    waited = time.perf_counter() - began
    theirs = torch.zeros(int(length.item()) if receiving else 0, dtype=torch.uint8)
    exchange(_tensor(header) if sending else None, theirs if receiving else None)
    incoming = json.loads(bytes(theirs.numpy())) if receiving else []
    write_error: BaseException | None = None
    if receiving:
        try:
            if layout.is_committed(dest, step):
                dest.delete_file(layout.manifest_path(step))
            begin_step(dest, step, None)
        except Exception as e:
            write_error = e
    # the files travel as one stream (their bytes in order, cut into PIECE messages): a step of many small files
    # (the local tier's arrays) costs a message or two, not a round trip per file
    out_msgs = _pieces(sum(size for _, size in files))
    in_msgs = _pieces(sum(size for _, size in incoming))
    unsent = iter(range(len(files)))
    outbuf = bytearray()  # read, not yet sent
    inbuf = bytearray()  # received, not yet a whole file
    whole = iter(range(len(incoming)))
    j = next(whole, None)  # the next incoming file to complete (they complete in order)
    manifest: bytes | None = None
    for k in range(max(len(out_msgs), len(in_msgs), 1)):
        out = None
        if k < len(out_msgs):
            a, b = out_msgs[k]
            while len(outbuf) < b - a:
                i = next(unsent)
                data = source.read(f"{layout.step_dir(step)}/{files[i][0]}") or b""
                if len(data) != files[i][1]:
                    read_error = read_error or OSError(f"{files[i][0]} of step {step} changed while being sent")
                    data = bytes(files[i][1])
                outbuf += data
            out = _tensor(outbuf[: b - a])
            del outbuf[: b - a]
        into = None
        if k < len(in_msgs):
            into = torch.empty(in_msgs[k][1] - in_msgs[k][0], dtype=torch.uint8)
        if out is not None or into is not None:
            exchange(out, into)
        if into is not None:
            inbuf += into.numpy().tobytes()
        while j is not None and len(inbuf) >= incoming[j][1]:
            name, size = incoming[j]
            data = bytes(inbuf[:size])
            del inbuf[:size]
            if name == layout.MANIFEST:
                manifest = data
            elif write_error is None:
                try:
                    dest.write_atomic(f"{layout.step_dir(step)}/{name}", data)
                except Exception as e:
                    write_error = e
            j = next(whole, None)
    status = torch.zeros(1, dtype=torch.int64)
    exchange(
        torch.tensor([0 if read_error is None else 1], dtype=torch.int64) if sending else None,
        status if receiving else None,
    )
    if receiving and write_error is None:
        if int(status.item()) != 0 or manifest is None:
            write_error = OSError(f"rank {recv_from} could not read its copy of step {step}")
        else:
            try:
                commit_step(dest, step, manifest, None)
            except Exception as e:
                write_error = e
        if write_error is not None:
            dest.delete_tree(layout.step_dir(step))
    if read_error is not None:
        raise read_error
    if write_error is not None:
        raise write_error
    return Transferred(sum(size for _, size in incoming), waited)


def _tensor(data: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
