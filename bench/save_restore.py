"""Save/restore benchmark: torch.save+fsync, DCP save, DCP async_save and ckpt, side by side.

One driver invocation runs every method (the kit's adapters, bench/kit.py) in a fresh child process (so that
each method's peak RSS is its own) on identical state: the kit's transformer-like model plus its Adam state,
generated from a seed.
For each method it reports the training stall (time until control returns), the time until the save is
durable (fsync'd and committed), the restore time from a dropped page cache, and the peak extra RSS
(VmHWM, reset through /proc/self/clear_refs, minus the RSS right after the state was generated) during
saves and during restores. Figures are medians of `--repeats` runs. Two floors are measured first: the
copy bandwidth into warm (pre-touched) buffers of the state's size, and the fsync'd sequential write
bandwidth of the same bytes into one file (plus, for reference, the cold sequential read of that file).

    .venv/bin/python bench/save_restore.py                       # 2 GiB, 3 repeats, everything
    .venv/bin/python bench/save_restore.py --quick               # smoke run (small state, 1 repeat)
    .venv/bin/python bench/save_restore.py --only ckpt --chunk-mb 16,64,256,tensor
    .venv/bin/python bench/save_restore.py --ranks 2             # distributed: 1 GiB, FSDP2, 2 gloo ranks

Distributed mode (`--ranks N`): every method runs as N processes (gloo on 127.0.0.1), the same state
sharded with FSDP2 (`fully_shard` on each block and the root, CPU mesh); dcp.save / dcp.async_save go
through get_state_dict / set_state_dict, ckpt through `CheckpointManager.save/restore` on every rank. A
restore goes into a freshly built sharded model and a stateless Adam. Each figure is the slowest rank's
(per run, then the median); rank 0 drops the page cache between restores; every restored tensor's
full_tensor() checksum is compared with the saved one.

Restores need root (`echo 3 > /proc/sys/vm/drop_caches`); without it they are marked "warm cache".

Chunk size (measured on the 2-core / ~0.4 GB/s VM of docs/benchmarks.md, 2 GiB, 3 repeats):
16 MiB, 64 MiB, 256 MiB and one chunk per tensor all save and restore within run-to-run noise of each
other; the disk dominates. 64 MiB stays the default (see docs/benchmarks.md for the numbers).
"""

from __future__ import annotations

import argparse
import gc
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
    PeakRSS,
    build_model,
    build_state,
    drop_caches,
    exit_on_sigterm,
    fingerprint,
    fsync_path,
    positive,
    proc_status,
    run_ranks,
    scramble,
    state_bytes,
    state_tensors,
    timed_save,
)

METHODS = ("torch_save", "dcp_save", "dcp_async", "ckpt")
# the kit's adapter of each method, single-process and distributed (there: the same ckpt calls on every rank, each
# writing its shards; DCP through get/set_state_dict)
CLASSES = {m: ADAPTERS[m] for m in METHODS}
DIST_CLASSES = {
    "dcp_save": ADAPTERS["dcp_save_fsdp"],
    "dcp_async": ADAPTERS["dcp_async_fsdp"],
    "ckpt": ADAPTERS["ckpt"],
}
DIST_METHODS = tuple(DIST_CLASSES)


class Solo:
    """The single-process setting: one rank, the state is scrambled in place before each restore."""

    rank, world = 0, 1
    shard = None
    classes = CLASSES

    def barrier(self) -> None:
        pass

    def drop_caches(self) -> bool:
        return drop_caches()

    def fresh(self, impl, args) -> None:
        scramble(impl.model, impl.optim)

    def combine(self, res: dict) -> dict | None:
        return res

    def close(self) -> None:
        pass


class Group(Solo):
    """One rank of the distributed mode: gloo on 127.0.0.1 (RANK/WORLD_SIZE/MASTER_* set by the driver),
    FSDP2 on a CPU mesh; a restore goes into a freshly built sharded model and a stateless optimizer."""

    classes = DIST_CLASSES

    def __init__(self):
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (self.world,))

    def shard(self, model) -> None:
        """fully_shard every block, then the root (embedding, final norm and head)."""
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)

    def barrier(self) -> None:
        self.dist.barrier()

    def drop_caches(self) -> bool:
        """Rank 0 drops the page cache (every rank has synced and arrived); all ranks learn whether it could."""
        os.sync()
        self.barrier()
        ok = [drop_caches() if self.rank == 0 else None]
        self.dist.broadcast_object_list(ok, src=0)
        return bool(ok[0])

    def fresh(self, impl, args) -> None:
        """Replace the benchmark's state by a newly built sharded model (zeroed) and an Adam without state."""
        import torch

        impl.model = impl.optim = None
        gc.collect()
        model = build_model(args.size_gb, args.seed + 1)
        self.shard(model)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        impl.model, impl.optim = model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def combine(self, res: dict) -> dict | None:
        """Rank 0 gets one row: per run the slowest rank's figure (and the largest RSS); the others get None."""
        rows = [None] * self.world
        self.dist.all_gather_object(rows, res)
        if self.rank:
            return None
        out = dict(
            rows[0], ranks=self.world, per_rank={k: [r[k] for r in rows] for k in ("stall", "durable", "restore")}
        )
        for k in ("stall", "durable", "restore", "load"):
            out[k] = [max(vals) for vals in zip(*(r[k] for r in rows))]
        for k in ("first_stall", "first_durable", "save_peak_extra", "restore_peak_extra"):
            out[k] = max(r[k] for r in rows)
        out["cold"] = all(r["cold"] for r in rows)
        return out

    def close(self) -> None:
        """Leave together: a rank exiting while a peer is still in a gloo call makes the peer abort."""
        self.barrier()
        self.dist.destroy_process_group()


def run_method(args) -> dict | None:
    """One method in this process (one rank of it in the distributed mode); rank 0 returns the row."""
    import torch

    warnings.filterwarnings("ignore")
    env = Group() if args.ranks > 1 else Solo()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.world))
    model, optim = build_state(args.size_gb, args.seed, env.shard)
    nbytes, ntensors = state_bytes(model, optim), len(state_tensors(model, optim))
    expect = fingerprint(model, optim)
    gc.collect()
    workdir = os.path.join(args.dir, args.method + (f"-{args.chunk_label}" if args.method == "ckpt" else ""))
    os.makedirs(workdir, exist_ok=True)
    options = {"chunk_bytes": args.chunk_bytes} if args.method == "ckpt" else {}
    impl = env.classes[args.method](workdir, model, optim, **options)
    del model, optim  # from here on the state is impl.model / impl.optim (a restore may replace them)
    base = proc_status("VmRSS")
    res = {
        "method": args.method,
        "bytes": nbytes,
        "tensors": ntensors,
        "stall": [],
        "durable": [],
        "restore": [],
        "load": [os.getloadavg()[0]],
    }
    save_peak = restore_peak = 0
    # One untimed-for-the-median first save per method: ckpt allocates its staging arena there (later saves
    # reuse it), and on this VM every method's first save in a fresh process is 2-3x slower (fresh page
    # cache / guest memory), so the steady figures of all methods are taken from the saves after it.
    step = 0
    env.barrier()
    with PeakRSS() as pk:
        res["first_stall"], res["first_durable"] = timed_save(impl, step)
    save_peak = pk.peak
    for _ in range(args.repeats):
        env.barrier()  # every rank's save is durable before rank 0 deletes it
        if env.rank == 0:
            impl.delete(step)  # keep one checkpoint on disk; deleting is not timed
        step += 1
        os.sync()
        env.barrier()  # the ranks start each timed save together
        with PeakRSS() as pk:
            stall, durable = timed_save(impl, step)
        save_peak = max(save_peak, pk.peak)
        res["stall"].append(stall)
        res["durable"].append(durable)
    impl.end_saves()
    env.barrier()  # every rank's last save is durable: the root holds that one checkpoint
    res["files"], res["disk_bytes"] = footprint(workdir)
    cold = True
    for _ in range(args.repeats):
        env.fresh(impl, args)
        gc.collect()
        cold = env.drop_caches() and cold
        env.barrier()
        with PeakRSS() as pk:
            t0 = time.perf_counter()
            impl.restore(step)
            res["restore"].append(time.perf_counter() - t0)
        restore_peak = max(restore_peak, pk.peak)
        impl.end_restore()
        got = fingerprint(impl.model, impl.optim)
        if got != expect:
            raise SystemExit(f"{args.method}: restored state differs from the saved state")
    res["load"].append(os.getloadavg()[0])
    res.update(save_peak_extra=save_peak - base, restore_peak_extra=restore_peak - base, cold=cold)
    row = env.combine(res)
    env.close()
    return row


def footprint(root: str) -> tuple[int, int]:
    """(files, bytes) under a root that holds one checkpoint: every file a save leaves, metadata included (on an
    object store each would be one PUT)."""
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs]
    return len(sizes), sum(sizes)


def run_floors(args) -> dict:
    """Warm-buffer copy bandwidth and fsync'd sequential write bandwidth of the state's bytes."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model, optim = build_state(args.size_gb, args.seed)
    tensors = state_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # pre-touch

    def copy_all():
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            dst[off : off + n].view(t.dtype).view(t.shape).copy_(t)
            off += n

    copy_all()
    copies = []
    for _ in range(max(3, args.repeats)):
        t0 = time.perf_counter()
        copy_all()
        copies.append(time.perf_counter() - t0)
    path = os.path.join(args.dir, "floor.bin")
    writes, reads, cold = [], [], True
    for _ in range(args.repeats):
        os.sync()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in tensors:
                mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                while mv:
                    mv = mv[os.write(fd, mv) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(args.dir)
        writes.append(time.perf_counter() - t0)
        cold = drop_caches() and cold
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            mv = memoryview(dst.numpy())
            while mv:
                mv = mv[f.readinto(mv) :]
        reads.append(time.perf_counter() - t0)
        os.remove(path)
    med = statistics.median
    return {"bytes": nbytes, "copy_s": med(copies), "write_s": med(writes), "read_s": med(reads), "cold": cold}


# -- driver ---------------------------------------------------------------------------------------------


def chunk_spec(text: str) -> tuple[str, int]:
    """A `--chunk-mb` value as (label, chunk_bytes); "tensor": the largest chunk the manager takes, one per tensor."""
    from ckpt.format import MAX_CHUNK_BYTES

    if text in ("tensor", "0"):
        return "tensor", MAX_CHUNK_BYTES
    mb = float(text)
    return f"{text}MiB", int(mb * (1 << 20))


def chunk_list(text: str) -> str:
    """The argparse type of `--chunk-mb`: every value one that `chunk_spec` reads and the manager takes."""
    from ckpt.format import MAX_CHUNK_BYTES

    for item in text.split(","):
        try:
            ok = 1 <= chunk_spec(item)[1] <= MAX_CHUNK_BYTES
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"expected MiB in (0, {MAX_CHUNK_BYTES >> 20}] or 'tensor', got {item!r}")
    return text


def child(args, kind: str, extra: list[str]) -> dict:
    """Run `kind` (a method or "floors") in fresh process(es): one, or one per rank; the JSON row of rank 0."""
    argv = [os.path.abspath(__file__), "--_child", kind, "--size-gb", str(args.size_gb), "--repeats", str(args.repeats)]
    argv += ["--seed", str(args.seed), "--dir", args.dir, *extra]
    ranks = 1 if kind == "floors" else args.ranks
    if ranks > 1:
        argv += ["--ranks", str(ranks)]
    return run_ranks(argv, ranks, f"child {kind} {' '.join(extra)}")


def fmt_gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def report(floors: dict | None, rows: list[dict], args) -> str:
    med = statistics.median
    lines = []
    nbytes = rows[0]["bytes"] if rows else floors["bytes"]
    lines.append(
        f"state: {nbytes / GIB:.2f} GiB in {rows[0]['tensors'] if rows else '?'} tensors, "
        f"medians of {args.repeats} run(s)"
        + (
            f"; {args.ranks} ranks (gloo, FSDP2 on a CPU mesh), every figure the slowest rank's, "
            f"RSS+ the largest rank's"
            if args.ranks > 1
            else ""
        )
    )
    if floors:
        gb = floors["bytes"] / 1e9
        lines.append(f"floor  copy into warm buffers : {gb / floors['copy_s']:6.2f} GB/s -> {floors['copy_s']:.3f} s")
        lines.append(f"floor  fsync'd write        : {gb / floors['write_s']:6.2f} GB/s -> {floors['write_s']:.3f} s")
        lines.append(
            f"(ref)  cold sequential read : {gb / floors['read_s']:6.2f} GB/s -> {floors['read_s']:.3f} s"
            + ("" if floors["cold"] else "  (warm cache!)")
        )
    ref = next((r for r in rows if r["method"] == "ckpt"), None)
    head = (
        f"{'method':<22}{'stall s':>9}{'durable s':>11}{'restore s':>11}{'save RSS+':>11}{'rest RSS+':>11}"
        f"{'files':>7}{'stall/ck':>10}{'dur/ck':>8}{'rest/ck':>9}{'load':>6}"
    )
    lines += ["", head, "-" * len(head)]
    for r in rows:
        s, d, rs = med(r["stall"]), med(r["durable"]), med(r["restore"])
        ratio = ""
        if ref:
            ratio = f"{s / med(ref['stall']):>10.2f}{d / med(ref['durable']):>8.2f}{rs / med(ref['restore']):>9.2f}"
        lines.append(
            f"{r['label']:<22}{s:>9.3f}{d:>11.3f}{rs:>11.3f}{fmt_gib(r['save_peak_extra']):>11}"
            f"{fmt_gib(r['restore_peak_extra']):>11}{r['files']:>7}{ratio}{max(r['load']):>6.1f}"
            + ("" if r["cold"] else "  (warm cache!)")
        )
    lines.append(
        "RSS+ in GiB; files = every file of the one checkpoint on disk (metadata included); "
        "x/ck = the method's figure divided by ckpt's (first ckpt row); "
        "load = 1-min load average (max of start/end) on this machine while the method ran"
    )
    lines.append("first save in a fresh process (not in the medians; ckpt allocates its staging arena there):")
    for r in rows:
        lines.append(
            f"  {r['label']:<20} stall {r['first_stall']:7.3f} s  durable {r['first_durable']:7.3f} s   "
            f"runs: stall {' '.join(f'{x:.2f}' for x in r['stall'])} | durable "
            f"{' '.join(f'{x:.2f}' for x in r['durable'])} | restore {' '.join(f'{x:.2f}' for x in r['restore'])}"
        )
    peers = [r for r in rows if r["method"] != "ckpt"]
    if ref and floors and len(peers) == 3:
        s, d, rs = med(ref["stall"]), med(ref["durable"]), med(ref["restore"])
        dcp_async = med(next(r for r in peers if r["method"] == "dcp_async")["stall"])
        best_d = min(med(r["durable"]) for r in peers)
        best_r = min(med(r["restore"]) for r in peers)
        checks = [
            (
                f"stall {s:.3f} s <= 1.3 x copy floor {floors['copy_s']:.3f} s = {1.3 * floors['copy_s']:.3f} s",
                s <= 1.3 * floors["copy_s"],
            ),
            (
                f"stall {s:.3f} s <= 0.3 x dcp.async_save stall {dcp_async:.3f} s = {0.3 * dcp_async:.3f} s",
                s <= 0.3 * dcp_async,
            ),
            (f"durable {d:.3f} s <= 1.2 x best peer {best_d:.3f} s = {1.2 * best_d:.3f} s", d <= 1.2 * best_d),
            (f"restore {rs:.3f} s <= best peer {best_r:.3f} s", rs <= best_r),
        ]
        lines.append("")
        lines.append("acceptance (ckpt = first ckpt row):")
        lines += [f"  [{'PASS' if ok else 'FAIL'}] {text}" for text, ok in checks]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--size-gb",
        type=positive(float),
        default=None,
        help="state size in GiB (params + Adam moments); default 2, or 1 with --ranks > 1",
    )
    ap.add_argument(
        "--ranks",
        type=positive(int),
        default=1,
        help="distributed mode: this many ranks (gloo on 127.0.0.1, FSDP2), methods dcp_save, "
        "dcp_async, ckpt (floors: single process)",
    )
    ap.add_argument("--repeats", type=positive(int), default=3, help="runs per figure (the median is reported)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp, deleted after)")
    ap.add_argument(
        "--only",
        default=None,
        help=f"comma list from {','.join(METHODS)},floors (--ranks > 1: {','.join(DIST_METHODS)},floors)",
    )
    ap.add_argument(
        "--chunk-mb",
        type=chunk_list,
        default="64",
        help="ckpt chunk size(s), comma list of MiB or 'tensor' (one chunk per tensor); one ckpt row per value",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.25 GiB, 1 repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size_gb is None:
        args.size_gb = 2.0 if args.ranks == 1 else 1.0
    if args._child:
        if args._child == "floors":
            print(json.dumps(run_floors(args)))
        else:
            args.method = args._child
            args.chunk_label, args.chunk_bytes = chunk_spec(args.chunk_mb)
            row = run_method(args)
            if row is not None:  # rank 0
                print(json.dumps(row))
        return
    exit_on_sigterm()
    if args.quick:
        args.size_gb, args.repeats = min(args.size_gb, 0.25), 1
    methods = METHODS if args.ranks == 1 else DIST_METHODS
    only = set(args.only.split(",")) if args.only else set(methods) | {"floors"}
    bad = only - set(methods) - {"floors"}
    if bad:
        ap.error(f"unknown --only entries {sorted(bad)}")
    made = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="ckpt-bench-", dir="/tmp") if made else os.path.abspath(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    try:
        floors = child(args, "floors", []) if "floors" in only else None
        rows = []
        for method in methods:
            if method not in only:
                continue
            for chunk in args.chunk_mb.split(",") if method == "ckpt" else ["64"]:
                print(f"... {method} {chunk if method == 'ckpt' else ''}", file=sys.stderr, flush=True)
                r = child(args, method, ["--chunk-mb", chunk])
                label, _ = chunk_spec(chunk)
                r["label"] = CLASSES[method].label + (f" ({label})" if method == "ckpt" else "")
                rows.append(r)
        # ckpt rows last in the table, the default chunk first among them
        rows.sort(key=lambda r: r["method"] == "ckpt")
        print(report(floors, rows, args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"floors": floors, "rows": rows, "args": vars(args)}, f, indent=1)
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
