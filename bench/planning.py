"""Planning cost per save against world size and tensor count: ckpt beside dcp.async_save and dcp.save.

Every rank (gloo on 127.0.0.1, one process each) holds the same T small replicated tensors (1 KiB each), so that a
save's stall is almost all planning (agreeing who writes what) and little copying. For each world size and T it
reports ckpt's first save (which agrees the plan), the median of its next saves (which reuse it), and the median
stall of dcp.async_save and durable time of dcp.save on the same state (DCP plans every save), each the slowest
rank's, after one warm-up save. Every save is fsync'd (ckpt always; DCP's filesystem writer syncs its files).

    .venv/bin/python bench/planning.py                          # worlds 1,2,4,8; 100, 1,000 and 10,000 tensors
    .venv/bin/python bench/planning.py --worlds 1,2 --tensors 100 --repeats 3
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kit import free_port, positive, positives  # noqa: E402


def _rank(rank: int, world: int, port: int, tensors: int, repeats: int, workdir: str, out: str) -> None:
    """One rank: ckpt saves (first, then `repeats` more), then DCP's, each timed; rank 0 writes the slowest's."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckpt

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo")
    state = {f"layer{i}.w": torch.full((256,), float(i)) for i in range(tensors)}

    def slowest(seconds: float) -> float:
        if world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    res: dict[str, list[float]] = {"ckpt_first": [], "ckpt_next": [], "dcp_async": [], "dcp_save": []}
    with ckpt.CheckpointManager(os.path.join(workdir, "ckpt"), keep_last=2) as m:
        for step in range(repeats + 1):
            barrier()
            t0 = time.perf_counter()
            h = m.save(step, state)
            stall = time.perf_counter() - t0
            h.wait()
            res["ckpt_first" if step == 0 else "ckpt_next"].append(slowest(stall))
    group = dist.new_group(backend="gloo") if world > 1 else None
    for step in range(repeats + 1):
        path = os.path.join(workdir, f"dcp_async_{step}")
        barrier()
        t0 = time.perf_counter()
        f = dcp.async_save(state, checkpoint_id=path, process_group=group)
        stall = time.perf_counter() - t0
        f.result()
        if step:
            res["dcp_async"].append(slowest(stall))
    for step in range(repeats + 1):
        path = os.path.join(workdir, f"dcp_save_{step}")
        barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path, process_group=group)
        if step:
            res["dcp_save"].append(slowest(time.perf_counter() - t0))
    barrier()
    if rank == 0:
        res["ckpt_files"] = [_files(os.path.join(workdir, "ckpt", f"step_{repeats:08d}"))]
        res["dcp_files"] = [_files(os.path.join(workdir, f"dcp_save_{repeats}"))]
        with open(out, "w") as f:
            json.dump(res, f)
    if world > 1:
        dist.destroy_process_group()


def _files(path: str) -> int:
    """Files of one checkpoint (its directory)."""
    return sum(len(fs) for _, _, fs in os.walk(path))


def run(world: int, tensors: int, repeats: int) -> dict[str, float]:
    """Medians of one configuration, from fresh rank processes."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="ckpt-planning-", dir=os.environ.get("BENCH_DIR", "/tmp"))
    out = os.path.join(workdir, "result.json")
    try:
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, tensors, repeats, workdir, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.exitcode != 0:
                raise RuntimeError(f"a rank of world {world}, {tensors} tensors exited with {p.exitcode}")
        with open(out) as f:
            res = json.load(f)
        return {k: statistics.median(v) for k, v in res.items()}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=positives(int), default="1,2,4,8")
    ap.add_argument("--tensors", type=positives(int), default="100,1000,10000")
    ap.add_argument("--repeats", type=positive(int), default=3, help="saves after the first, per method (medians)")
    args = ap.parse_args(argv)
    print(
        f"{'world':>5} {'tensors':>7}  {'ckpt 1st s':>10} {'ckpt next s':>11} {'dcp.async s':>11} "
        f"{'dcp.save s':>10}  {'next/async':>10} {'1st/async':>9}  {'files ckpt':>10} {'dcp':>5}  load"
    )
    for tensors in map(int, args.tensors.split(",")):
        for world in map(int, args.worlds.split(",")):
            r = run(world, tensors, args.repeats)
            print(
                f"{world:>5} {tensors:>7}  {r['ckpt_first']:>10.4f} {r['ckpt_next']:>11.4f} {r['dcp_async']:>11.4f} "
                f"{r['dcp_save']:>10.4f}  {r['ckpt_next'] / r['dcp_async']:>10.2f} "
                f"{r['ckpt_first'] / r['dcp_async']:>9.2f}  {r['ckpt_files']:>10.0f} {r['dcp_files']:>5.0f}  "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
    print("stall of each save's call (ckpt: plan + copy; dcp.async_save: plan + staging), dcp.save: the whole save;")
    print("the slowest rank's, medians; 'next' = ckpt's saves after the first, which reuse its plan")


if __name__ == "__main__":
    main()
