"""Two-tier benchmark: a local tier beside the durable root against single-tier saves to the durable root.

The kit's state (bench/kit.py: transformer-like model + Adam, ~--size-gb). Figures, medians of --repeats:

- single tier: `save()` stall and time until committed in the durable root;
- two tiers (`local=`, persist_every=1): `save()` stall, time until committed in the local tier, and the
  persist's time until committed in the durable root (it runs in the background, after the local commit);
- restore: from the local tier and from the durable root (the local tier removed), each into the live state,
  page cache dropped first when run as root (else warm: say so).

    .venv/bin/python bench/tiers.py                       # 1 GiB, local tier in /dev/shm
    .venv/bin/python bench/tiers.py --quick               # smoke run: 0.1 GiB, 1 repeat
    .venv/bin/python bench/tiers.py --dir /mnt/shared --local /nvme/ckpt
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

from kit import GIB, build_state, drop_caches, exit_on_sigterm, positive, state_bytes  # noqa: E402


def saves(state, durable: str, local: str | None, repeats: int) -> dict[str, list[float]]:
    """Save `repeats` steps (after one warm-up save): stall, time to the (local) commit, time to the durable one."""
    import ckpt

    out: dict[str, list[float]] = {"stall": [], "commit": [], "durable": []}
    kw = {"local": local, "persist_every": 1, "keep_local": 2} if local else {}
    with ckpt.CheckpointManager(durable, keep_last=2, **kw) as m:
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            handle = m.save(step, state)
            t1 = time.perf_counter()
            handle.wait()
            t2 = time.perf_counter()
            m.wait()  # two tiers: the persist of this step
            t3 = time.perf_counter()
            if step:  # the first save faults the staging arena in: not what a running job sees
                out["stall"].append(t1 - t0)
                out["commit"].append(t2 - t0)
                out["durable"].append(t3 - t0)
    return out


def restore(state, durable: str, local: str) -> tuple[float, bool]:
    """Seconds of one restore into the live state (the newest step: in the local tier while there is one), and
    whether the page cache was cold."""
    import ckpt

    cold = drop_caches()
    with ckpt.CheckpointManager(durable, local=local) as m:
        t0 = time.perf_counter()
        m.restore(state)
        seconds = time.perf_counter() - t0
    return seconds, cold


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=positive(float), default=1.0, help="state size (model + Adam)")
    ap.add_argument(
        "--repeats", type=positive(int), default=3, help="saves and restores per figure (the median is reported)"
    )
    ap.add_argument("--dir", default=None, help="the durable root's parent (default: a temp dir under /tmp)")
    ap.add_argument("--local", default=None, help="the local tier's parent (default: /dev/shm when there)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.1 GiB, 1 repeat")
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gb, args.repeats = 0.1, 1
    model, optim = build_state(args.size_gb, 0)
    state = {"model": model, "optim": optim}
    nbytes = state_bytes(model, optim)
    exit_on_sigterm()
    durable_parent = tempfile.mkdtemp(prefix="ckpt-tiers-", dir=args.dir)
    local_parent = tempfile.mkdtemp(
        prefix="ckpt-tiers-local-", dir=args.local or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    try:
        single = os.path.join(durable_parent, "single")
        two, local = os.path.join(durable_parent, "two"), os.path.join(local_parent, "local")
        rows = {
            "single tier": saves(state, single, None, args.repeats),
            "two tiers": saves(state, two, local, args.repeats),
        }
        restores: dict[str, list[float]] = {"local": [], "durable": []}
        cold = True
        for _ in range(args.repeats):
            seconds, c = restore(state, two, local)
            restores["local"].append(seconds)
            cold = cold and c
        shutil.rmtree(local)  # the node is gone: the durable tier it is
        for _ in range(args.repeats):
            seconds, c = restore(state, two, local)
            restores["durable"].append(seconds)
            cold = cold and c
    finally:
        shutil.rmtree(durable_parent, ignore_errors=True)
        shutil.rmtree(local_parent, ignore_errors=True)

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    print(f"state {nbytes / GIB:.2f} GiB, durable {durable_parent}, local {local_parent}, medians of {args.repeats}")
    print(f"{'':<12} {'stall s':>9} {'commit s':>9} {'durable s':>10}")
    for name, r in rows.items():
        print(f"{name:<12} {med(r['stall']):>9.3f} {med(r['commit']):>9.3f} {med(r['durable']):>10.3f}")
    print(
        f"restore from the local tier {med(restores['local']):.3f} s, from the durable root "
        f"{med(restores['durable']):.3f} s ({'cold' if cold else 'warm'} page cache)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": nbytes, "saves": rows, "restores": restores, "cold": cold}, f, indent=1)


if __name__ == "__main__":
    main()
