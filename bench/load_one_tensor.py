"""Reading one tensor of a checkpoint with `ckpt.load(root, keys=[...])`: time and bytes read against the tensor's size.

Builds the kit's state (bench/kit.py: transformer-like model + Adam, ~--size-gb), saves it as one ckpt step,
then reads one tensor (default the input embedding, the largest) and a region of it (its first 1/16 of rows),
from a dropped page cache when run as root. Bytes read come from /proc/self/io: `read_bytes` (from the disk; only
meaningful with a dropped cache) and `rchar` (every byte read through read/pread, cached or not). The promise:
at most 1.1x the bytes of the chunks that hold what is asked for: the tensor's own bytes for a whole tensor; for
a region, the whole chunks it touches (a chunk is verified by its crc32c, so it is read whole).

    .venv/bin/python bench/load_one_tensor.py                    # 2 GiB checkpoint
    .venv/bin/python bench/load_one_tensor.py --size-gb 0.25     # smoke run
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kit import GIB, build_state, drop_caches, exit_on_sigterm, positive  # noqa: E402


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def chunk_bytes(root: str, key: str, region: tuple[slice, ...] | None) -> int:
    """Bytes that must be read for `region` of the tensor at `key` in step 1: the segments of its placed boxes
    that hold the region's rows (ckpt/5), or the chunk files (content + crc32c) that hold it."""
    from ckpt.reader import StepReader, region_box
    from ckpt.storage import open_storage

    reader = StepReader(open_storage(root), 1, None)  # the manifest only: no pool needed
    info = next(leaf.array for leaf in reader.leaves([key]) if leaf.array is not None)
    box = region_box(info, region, key) if region is not None else tuple((0, n) for n in info.shape)
    if info.places is None:
        return len(info.chunks(box)) * (info.chunk_nbytes + 4)
    total = 0
    for j, stored in enumerate(info.boxes):
        rows = (max(box[0][0], stored[0][0]), min(box[0][1], stored[0][1])) if stored else (0, 1)
        if rows[0] < rows[1]:
            row = info.box_nbytes(stored[1:])
            lo, hi = (
                (rows[0] - (stored[0][0] if stored else 0)) * row,
                (rows[1] - (stored[0][0] if stored else 0)) * row,
            )
            total += sum(b - a for a, b, _ in info.segments(j, lo, hi))
    return total


def measure(root: str, key: str, region: tuple[slice, ...] | None) -> dict:
    """One cold (when possible) read: seconds, bytes asked for, read_bytes and rchar."""
    import ckpt

    cold = drop_caches()
    before, t0 = io_counters(), time.perf_counter()
    value = ckpt.load(root, keys=[key], region=region)
    seconds = time.perf_counter() - t0
    after = io_counters()
    value = next(_leaves(value))
    asked = value.numel() * value.element_size()
    return {
        "seconds": seconds,
        "bytes": asked,
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "rchar": after["rchar"] - before["rchar"],
        "cold": cold,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=positive(float), default=2.0)
    ap.add_argument("--key", default="model.embed.weight", help="dotted key of the tensor to read")
    ap.add_argument("--repeats", type=positive(int), default=3, help="reads per figure (the median is reported)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, deleted after)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)

    import ckpt

    exit_on_sigterm()
    work = args.dir or tempfile.mkdtemp(prefix="ckpt-load-bench-")
    root = os.path.join(work, "root")
    try:
        model, optim = build_state(args.size_gb, args.seed)
        with ckpt.CheckpointManager(root) as manager:
            manager.save(1, {"model": model, "optim": optim}).wait()
        total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        del model, optim
        gc.collect()
        ckpt.load(root, keys=["model.ln_f.bias"])  # imports and first-call costs out of the figures
        try:
            shape = next(_leaves(ckpt.load(root, keys=[args.key]))).shape  # and warms the path for non-root runs
        except ckpt.StateKeyError as e:
            raise SystemExit(f"--key {args.key!r}: {e}") from None
        if not shape:
            raise SystemExit(f"--key {args.key!r}: a 0-d tensor has no rows to read a region of")
        rows = shape[0]
        rows_part = (slice(0, max(1, rows // 16)),)
        results = {}
        for label, region in (("whole tensor", None), (f"rows 0:{rows_part[0].stop} (region=)", rows_part)):
            runs = [measure(root, args.key, region) for _ in range(args.repeats)]
            results[label] = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "read_bytes", "rchar")}
            results[label].update(
                bytes=runs[0]["bytes"], cold=all(r["cold"] for r in runs), chunks=chunk_bytes(root, args.key, region)
            )
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    cold = all(r["cold"] for r in results.values())
    print(
        f"checkpoint: {total / GIB:.2f} GiB on disk; key {args.key!r}; median of {args.repeats} "
        + ("cold reads (page cache dropped)" if cold else "reads, WARM CACHE (not root): read_bytes means nothing")
    )
    print(
        f"{'read':<28} {'asked MiB':>9} {'chunks MiB':>10} {'seconds':>8} {'GB/s':>6} {'read_bytes':>10} {'rchar':>10}"
        f"  (read_bytes and rchar: x the chunks' bytes)"
    )
    for label, r in results.items():
        print(
            f"{label:<28} {r['bytes'] / (1 << 20):>9.1f} {r['chunks'] / (1 << 20):>10.1f} {r['seconds']:>8.3f} "
            f"{r['bytes'] / r['seconds'] / 1e9:>6.2f} {r['read_bytes'] / r['chunks']:>10.3f} {r['rchar'] / r['chunks']:>10.3f}"
        )
    ok = all(max(r["rchar"], r["read_bytes"]) <= 1.1 * r["chunks"] for r in results.values())
    print(f"at most 1.1x the bytes of the chunks that hold what was asked: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"size_gb": args.size_gb, "checkpoint_bytes": total, "key": args.key, "results": results}, f, indent=1
            )
    if not ok:
        sys.exit(1)


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


if __name__ == "__main__":
    main()
