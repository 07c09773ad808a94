"""Random token windows from a cold page cache: today's memory-mapped path, the window reader and fio, one run.

Each row runs in a fresh child process that imports everything, drops the page cache (root), then reads windows
drawn by `RandomWindowSampler` (stride = window, so windows are page-aligned like fio's blocks) and reports
windows/s (timed from the first batch on), MB/s, disk bytes read per window byte (/proc/diskstats of the file's
disk, around the loop only) and CPU seconds per 1,000 windows (the process and its DataLoader workers). fio runs
`--rw=randread --direct=1 --ioengine=libaio` on the same file at the same block size and queue depths 1, 16, 64.
Figures are medians of `--repeats`; the ratios compare the reader at 0 workers with fio's best row.

    sudo .venv/bin/python bench/data_read.py                 # 4 GiB file, 4 KiB and 32 KiB windows, 3 repeats
    sudo .venv/bin/python bench/data_read.py --size-gb 1 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from kit import exit_on_sigterm, positive, positives

ROWS = {  # name -> (kind, workers, reader backend, O_DIRECT)
    "mmap (today), 0 workers": ("mmap", 0, None, True),
    "mmap (today), 4 workers": ("mmap", 4, None, True),
    "reader, 0 workers": ("reader", 0, None, True),
    "reader, 2 workers": ("reader", 2, None, True),
    "reader threads+O_DIRECT, 0 w": ("reader", 0, "threads", True),
    "reader threads+FADV_RANDOM, 0 w": ("reader", 0, "threads", False),
}
FIO_DEPTHS = (1, 16, 64)
# windows per batch (one rank) by window bytes: the permutation's cost is per batch (small batches pay it more
# often), the int64 batch tensor's fresh pages per window (a batch over 32 MiB is a fresh mmap each time)
BATCHES = "4096:256,32768:64"
SETTLE_S = 1.0


def disk_bytes_read(path: str) -> int:
    """Bytes read so far from the disk holding `path` (/proc/diskstats sectors read x 512)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if int(fields[0]) == major and int(fields[1]) == minor:
                return int(fields[5]) * 512
    raise RuntimeError(f"no /proc/diskstats line for {path}'s device {major}:{minor}")


def drop_caches() -> bool:
    """Empty the page cache (needs root); False when not possible, so rows can say the cache was warm."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (DataLoader workers after shutdown)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def child(args: argparse.Namespace) -> None:
    """One row: read `--count` windows as the row says, print its figures as JSON."""
    import numpy as np
    from torch.utils.data import DataLoader, Dataset

    from ckpt import RandomWindowSampler, TokenWindowDataset, make_loader

    kind, workers, backend, direct = ROWS[args.row]
    tokens = args.window // 2
    dataset = TokenWindowDataset(args.file, np.uint16, tokens, seed=1)
    batch = args.batch
    sampler = RandomWindowSampler(dataset.n_tokens, tokens, tokens, batch, seed=args.seed, rank=0, world_size=1)

    class PerItem(Dataset):  # today's path: one memory-mapped window per __getitem__
        def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
            return dataset[key]

    if kind == "mmap":
        loader = DataLoader(PerItem(), batch_sampler=sampler, num_workers=workers)
    else:
        if backend is not None:
            dataset._reader_options = {"backend": backend, "direct": direct}  # each thread's and worker's reader
        loader = make_loader(dataset, sampler, num_workers=workers)
    batches = args.count // batch
    it = iter(loader)
    next(it)  # workers started, code paths warm; then the cache is dropped and left to settle (other processes
    warm = drop_caches()  # fault their own pages back in, which /proc/diskstats would count as ours)
    time.sleep(SETTLE_S)
    cpu0, disk0 = cpu_seconds(), disk_bytes_read(args.file)
    t0 = time.perf_counter()
    for _ in range(batches - 1):
        next(it)
    elapsed = time.perf_counter() - t0
    del it  # joins the workers, so their CPU is counted
    windows = batches * batch
    print(
        json.dumps(
            {
                "windows_s": (windows - batch) / elapsed,
                "amp": (disk_bytes_read(args.file) - disk0) / ((windows - batch) * args.window),
                "cpu_per_1k": 1000 * (cpu_seconds() - cpu0) / windows,
                "cold": warm,
            }
        )
    )


def run_fio(path: str, block: int, depth: int, seconds: float) -> dict[str, Any]:
    """fio random reads of `block` bytes at queue depth `depth` from a dropped cache."""
    cold = drop_caches()
    time.sleep(SETTLE_S)
    disk0 = disk_bytes_read(path)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--direct=1", "--ioengine=libaio",
         f"--bs={block}", f"--iodepth={depth}", f"--runtime={seconds}", "--time_based", "--norandommap",
         "--output-format=json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    job = json.loads(out[out.index("{") :])["jobs"][0]["read"]
    ios = job["total_ios"]
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return {
        "windows_s": job["iops"],
        "amp": (disk_bytes_read(path) - disk0) / (ios * block),
        "cpu_per_1k": 1000 * cpu / ios,
        "cold": cold,
    }


def make_file(path: str, size_gb: float) -> None:
    """A token file of random uint16 tokens, written in 64 MiB pieces and fsync'd (kept if it has the size)."""
    import numpy as np

    size = int(size_gb * (1 << 30)) // 4096 * 4096
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for done in range(0, size, 64 << 20):
            rng.integers(0, 65_000, min(64 << 20, size - done) // 2, dtype=np.uint16).tofile(f)
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=positive(float), default=4.0)
    parser.add_argument(
        "--windows", type=positives(int), default="4096,32768", help="window sizes in bytes (uint16 tokens)"
    )
    parser.add_argument("--batch", default=BATCHES, help="WINDOW_BYTES:WINDOWS_PER_BATCH,... (child: a number)")
    parser.add_argument("--repeats", type=positive(int), default=3)
    parser.add_argument("--fio-seconds", type=positive(float), default=4.0)
    parser.add_argument("--dir", default=None, help="where the token file goes (default: a temp dir, deleted)")
    parser.add_argument("--keep", action="store_true", help="keep the token file (reused by the next run)")
    parser.add_argument("--json", default=None, help="write the raw per-run figures here")
    parser.add_argument("--_child", dest="row", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        args.batch = int(args.batch)
        return child(args)
    try:
        batch_of = {int(w): int(b) for w, b in (item.split(":") for item in args.batch.split(","))}
    except ValueError:
        parser.error(f"argument --batch: expected WINDOW_BYTES:WINDOWS_PER_BATCH,..., got {args.batch!r}")
    windows = [int(w) for w in args.windows.split(",")]
    if missing := [w for w in windows if w not in batch_of]:
        parser.error(f"argument --batch: no batch for window(s) {missing}, it has {sorted(batch_of)}")
    exit_on_sigterm()
    folder = args.dir or tempfile.mkdtemp(prefix="ckpt-data-bench-", dir="/tmp")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokens.bin")
    make_file(path, args.size_gb)
    has_fio = shutil.which("fio") is not None
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for window in windows:
            runs = raw.setdefault(str(window), {})
            for repeat in range(args.repeats):
                for row, (kind, workers, _, _) in ROWS.items():
                    batch = batch_of[window]
                    count = (2560 if kind == "mmap" else 20480) * (workers or 1) // batch * batch
                    out = subprocess.run(
                        [sys.executable, __file__, "--_child", row, "--file", path, "--window", str(window),
                         "--count", str(count), "--seed", str(repeat), "--batch", str(batch)],
                        check=True, capture_output=True, text=True,
                    ).stdout  # fmt: skip
                    runs.setdefault(row, []).append(json.loads(out.strip().splitlines()[-1]))
                for depth in FIO_DEPTHS if has_fio else ():
                    runs.setdefault(f"fio iodepth {depth}", []).append(run_fio(path, window, depth, args.fio_seconds))
            report(window, batch_of[window], runs, args.size_gb, args.repeats, has_fio)
    finally:
        if not args.keep:
            os.remove(path)
            if not args.dir:
                os.rmdir(folder)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


def report(
    window: int, batch: int, runs: dict[str, list[dict[str, Any]]], size_gb: float, repeats: int, has_fio: bool
) -> None:
    """Print one window size's table of medians, and the reader's ratios to fio's best row."""
    med = {
        row: {k: statistics.median(r[k] for r in rs) for k in ("windows_s", "amp", "cpu_per_1k")}
        for row, rs in runs.items()
    }
    cold = all(r["cold"] for rs in runs.values() for r in rs)
    print(f"\n{window // 1024} KiB windows ({window // 2} uint16 tokens, {batch} a batch), {size_gb:g} GiB file, "
          f"medians of {repeats}"
          f"{'' if cold else ', WARM CACHE (not root?)'}")  # fmt: skip
    print(f"{'reader':34s} {'windows/s':>10s} {'MB/s':>8s} {'disk B/window B':>16s} {'CPU s/1k win':>13s}")
    for row, m in med.items():
        print(
            f"{row:34s} {m['windows_s']:10,.0f} {m['windows_s'] * window / 1e6:8,.0f} {m['amp']:16.2f} {m['cpu_per_1k']:13.3f}"
        )
    if not has_fio:
        print("fio: missing (apt-get install fio); no fio rows")
        return
    best = max((r for r in med if r.startswith("fio")), key=lambda r: med[r]["windows_s"])
    ours, today = med["reader, 0 workers"], med["mmap (today), 0 workers"]
    print(f"reader, 0 workers / {best} (best fio): {ours['windows_s'] / med[best]['windows_s']:.2f}x windows/s "
          f"(= MB/s); reader / today (0 workers): {ours['windows_s'] / today['windows_s']:.1f}x windows/s")  # fmt: skip


if __name__ == "__main__":
    main()
