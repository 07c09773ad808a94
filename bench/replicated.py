"""Replicated (DDP) restore: bytes read from the root and restore time at N ranks, ckpt against dcp.save's dcp.load.

Every rank holds the same state (the kit's transformer + Adam from one seed, unsharded: DDP replicas). Each method
saves it once, then restores it `--repeats` times into the zeroed state, each from a dropped page cache (root
needed, else marked warm), every rank in its own process (gloo on 127.0.0.1). Per restore: the slowest rank's time,
and the bytes read summed over the ranks (`rchar` of /proc/self/io: every read()/pread()/preadv() of a file, from
the disk or the page cache alike, so a rank reading what another already brought into the cache still counts, as it
would against a shared file system or an object store; the ranks' gloo transfers are not counted). The restored state
is checked against the saved one on every rank. Figures are medians.

    .venv/bin/python bench/replicated.py                         # 4 ranks, 0.25 GiB, 3 repeats
    .venv/bin/python bench/replicated.py --ranks 2 --size-gb 0.125 --repeats 1   # smoke run
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
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kit import (  # noqa: E402
    ADAPTERS,
    GIB,
    ROOT,
    build_state,
    bytes_read,
    drop_caches,
    exit_on_sigterm,
    fingerprint,
    names,
    positive,
    run_ranks,
    scramble,
    state_bytes,
)

METHODS = ("dcp_save", "ckpt")


def run_rank(args) -> None:
    """One rank of one method: save once, then `repeats` timed restores; rank 0 prints the JSON row."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model, optim = build_state(args.size_gb, args.seed)  # the same on every rank: replicas
    expect = fingerprint(model, optim)
    workdir = os.path.join(args.dir, args.method)
    impl = ADAPTERS[args.method](workdir, model, optim)
    dist.barrier()
    impl.save(1).wait()
    impl.end_saves()
    dist.barrier()
    times, reads, cold = [], [], True
    for _ in range(args.repeats):
        scramble(impl.model, impl.optim)
        os.sync()
        dist.barrier()
        flag = [drop_caches() if rank == 0 else None]
        dist.broadcast_object_list(flag, src=0)
        cold = cold and bool(flag[0])
        dist.barrier()
        before, t0 = bytes_read(), time.perf_counter()
        impl.restore(1)
        times.append(time.perf_counter() - t0)
        reads.append(bytes_read() - before)
        impl.end_restore()
        if fingerprint(impl.model, impl.optim) != expect:
            raise SystemExit(f"{args.method}: rank {rank} restored a state that differs from the saved one")
    rows = [None] * world
    dist.all_gather_object(rows, {"times": times, "reads": reads, "cold": cold})
    if rank == 0:
        row = {
            "method": impl.label,
            "bytes": state_bytes(impl.model, impl.optim),
            "restore": [max(ts) for ts in zip(*(r["times"] for r in rows))],
            "read": [sum(rs) for rs in zip(*(r["reads"] for r in rows))],
            "read_per_rank": [statistics.median(r["reads"]) for r in rows],
            "cold": all(r["cold"] for r in rows),
        }
        print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_method(args, method: str) -> dict:
    """`method` as `args.ranks` processes; the JSON row of rank 0."""
    argv = [os.path.abspath(__file__), "--_rank", method, "--size-gb", str(args.size_gb)]
    argv += ["--repeats", str(args.repeats), "--seed", str(args.seed), "--dir", args.dir]
    return run_ranks(argv, args.ranks, method)


def report(rows: list[dict], args) -> str:
    med = statistics.median
    nbytes = rows[0]["bytes"]
    lines = [
        f"{args.ranks} ranks, every one holding the same {nbytes / GIB:.3f} GiB (DDP replicas), medians of "
        f"{args.repeats}{'' if all(r['cold'] for r in rows) else ' (warm cache: not root)'}",
        "",
        "| method | restore s (slowest rank) | bytes read, all ranks | x checkpoint | per rank (GiB) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        read = med(r["read"])
        per_rank = " / ".join(f"{b / GIB:.3f}" for b in r["read_per_rank"])
        lines.append(
            f"| {r['method']} | {med(r['restore']):.3f} | {read / GIB:.3f} GiB | {read / nbytes:.2f}x | {per_rank} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=positive(int), default=4)
    parser.add_argument(
        "--size-gb", type=positive(float), default=0.25, help="state size in GiB (params + Adam moments)"
    )
    parser.add_argument("--repeats", type=positive(int), default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only", type=names(METHODS), default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}"
    )
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._rank is not None:
        args.method = args._rank
        run_rank(args)
        return
    exit_on_sigterm()
    own = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-replicated-", dir=ROOT)
    try:
        rows = [run_method(args, m) for m in args.only.split(",")]
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(report(rows, args))


if __name__ == "__main__":
    main()
