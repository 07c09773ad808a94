"""How fast RandomWindowSampler draws window starts from a space of 10^12 windows (median of several runs)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from kit import positive

from ckpt import RandomWindowSampler


def main() -> None:
    """Time sampler.indices over a million consecutive global counters, mid-stream and across an epoch boundary."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=positive(float), default=1e12)
    parser.add_argument("--count", type=positive(int), default=1_000_000)
    parser.add_argument("--runs", type=positive(int), default=5)
    args = parser.parse_args()
    windows, window, stride = int(args.windows), 2048, 1
    sampler = RandomWindowSampler(windows - 1 + window, window, stride, global_batch_size=1024, seed=1)
    assert sampler.num_items == windows
    for label, start in [("mid-epoch", 123_456_789_012), ("epoch boundary", windows - args.count // 2)]:
        counters = np.arange(start, start + args.count, dtype=np.int64)
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            starts = sampler.indices(counters) * stride
            times.append(time.perf_counter() - t0)
        assert starts.max() <= sampler.n_tokens - window
        median = statistics.median(times)
        print(f"{label}: {args.count:,} window starts from {windows:.3g} windows: median {median * 1e3:.1f} ms "
              f"over {args.runs} runs ({args.count / median / 1e6:.1f} M/s)")  # fmt: skip


if __name__ == "__main__":
    main()
