"""The manifest at a multi-rank restore from one shared root: bytes read by all ranks and the restore's time.

Each of T float32 tensors of shape (4R, 16) is row-sharded over R ranks (a DTensor, Shard(0)), as FSDP shards it:
R x T boxes in the manifest, and 256 bytes of data per box, so that the manifest is about as large as the data
itself. Step 1 is saved once, then restored `--repeats` times into the same tensors, every rank in its own process
(gloo on 127.0.0.1). Per restore: the slowest rank's time, the bytes read summed over the ranks (`rchar` of
/proc/self/io: every read of a file, from the disk or the page cache alike, as each would be a GET from an object
store; the gloo transfers are not counted) and the manifest's size. Medians.

    .venv/bin/python bench/manifest_ranks.py                     # 4 ranks, 20,000 tensors, 3 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kit import bytes_read, exit_on_sigterm, positive, run_ranks  # noqa: E402

COLS = 16


def run_rank(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckpt

    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(4, COLS, generator=g) for _ in range(args.tensors)]
    state = {
        f"layers.{t}.weight": DTensor.from_local(
            x, mesh, [Shard(0)], shape=(4 * world, COLS), stride=(COLS, 1), run_check=False
        )
        for t, x in enumerate(local)
    }
    saved = [x.clone() for x in local]
    with ckpt.CheckpointManager(args.dir, collective_timeout=600) as m:
        m.save(1, state).wait()
    times, reads = [], []
    for _ in range(args.repeats):
        for x in local:
            x.zero_()
        dist.barrier()
        with ckpt.CheckpointManager(args.dir, collective_timeout=600) as m:
            dist.barrier()
            before, t0 = bytes_read(), time.perf_counter()
            m.restore(state)
            times.append(time.perf_counter() - t0)
            reads.append(bytes_read() - before)
        if any(not torch.equal(a, b) for a, b in zip(local, saved)):
            raise SystemExit(f"rank {rank} restored a state that differs from the saved one")
    rows = [None] * world
    dist.all_gather_object(rows, {"times": times, "reads": reads})
    if rank == 0:
        manifest = os.path.getsize(os.path.join(args.dir, "step_00000001", "manifest.json"))
        row = {
            "ranks": world,
            "tensors": args.tensors,
            "manifest": manifest,
            "restore": statistics.median(max(ts) for ts in zip(*(r["times"] for r in rows))),
            "read": statistics.median(sum(rs) for rs in zip(*(r["reads"] for r in rows))),
            "read_per_rank": [statistics.median(r["reads"]) for r in rows],
        }
        print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> dict:
    """The restore as `args.ranks` processes; the JSON row of rank 0."""
    argv = [os.path.abspath(__file__), "--_rank", "--tensors", str(args.tensors)]
    argv += ["--repeats", str(args.repeats), "--dir", args.dir]
    return run_ranks(argv, args.ranks, "the restore")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=positive(int), default=4)
    p.add_argument("--tensors", type=positive(int), default=20_000)
    p.add_argument("--repeats", type=positive(int), default=3)
    p.add_argument("--dir", default=None, help="where to save (default: a temporary directory, removed after)")
    p.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._rank:
        return run_rank(args)
    exit_on_sigterm()
    temporary = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckpt-manifest-ranks-")
    try:
        row = run(args)
    finally:
        if temporary:
            shutil.rmtree(args.dir, ignore_errors=True)
    mb = 1e6
    print(
        f"{row['ranks']} ranks x {row['tensors']:,} tensors: manifest {row['manifest'] / mb:.1f} MB; restore "
        f"{row['restore']:.2f} s (slowest rank); read by all ranks {row['read'] / mb:.1f} MB, per rank "
        f"{', '.join(f'{b / mb:.1f}' for b in row['read_per_rank'])} MB"
    )


if __name__ == "__main__":
    main()
