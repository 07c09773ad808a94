"""One rank of tests/test_replica_transfer.py: gloo on 127.0.0.1, `ckpt.replica.transfer` of a committed step
between two ranks (each sends the step under ROOT/src to the other, into ROOT/dest<rank>).

Modes: "ok" sends it as it is; "changed" has rank 0 read its third file one byte short (a file that changed while
being sent). PIECE is cut to 1,000 bytes, so files span messages and messages span files. Prints
``rank R got BYTES`` or ``rank R failed TYPE: MESSAGE``, then ``rank R committed [steps]``.
Started through `tests/test_distributed.run_ranks(..., worker=replica_worker)`.
"""

import os
from datetime import timedelta

import torch.distributed as dist

from ckpt import layout, replica
from ckpt.distributed import GlooRanks
from ckpt.storage import LocalStorage
from dist_worker import redirect

STEP = 4


def run(mode: str, root: str, rank: int, world: int, port: int, log: str) -> None:
    redirect(rank, world, port, log)
    dist.init_process_group("gloo")
    replica.PIECE = 1000
    source = LocalStorage(os.path.join(root, "src"))
    if mode == "changed" and rank == 0:
        read, calls = source.read, [0]

        def short_third(path: str) -> bytes | None:
            calls[0] += 1
            data = read(path)
            return data[:-1] if calls[0] == 3 and data else data

        source.read = short_third
    dest = LocalStorage(os.path.join(root, f"dest{rank}"))
    peer = 1 - rank
    try:
        done = replica.transfer(
            GlooRanks(timedelta(seconds=30)), STEP, send_to=peer, source=source, recv_from=peer, dest=dest
        )
        print(f"rank {rank} got {done.received}", flush=True)
    except Exception as e:
        print(f"rank {rank} failed {type(e).__name__}: {e}", flush=True)
    print(f"rank {rank} committed {layout.committed_steps(dest)}", flush=True)
    dist.destroy_process_group()
