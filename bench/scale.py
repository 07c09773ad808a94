"""Scale benchmark: how stall, durable time, restore, files and planning grow with ranks and tensors, ckpt beside
dcp.save and dcp.async_save.

Two sweeps, every configuration in fresh processes (gloo on 127.0.0.1, one process per rank):

1. ranks x state size: bench/save_restore.py's distributed mode (the kit's transformer + Adam, FSDP2 on a CPU
   mesh; 448 tensors) at each world size, for each state size: stall, durable time, restore from a dropped page
   cache (root needed, else marked warm), and the files of one checkpoint on disk, metadata included (on an object
   store each is one PUT, and a restore's GETs are one per file or per ranged read). World size 1 is the
   single-process mode of the same script.
2. ranks x tensor count: bench/planning.py's T small replicated tensors per rank: the stall of ckpt's first save
   (which agrees the plan), of its later saves (which reuse it), of dcp.async_save (which plans every save) and
   dcp.save's whole save, and the files of one checkpoint.

It ends with the growth of each cost as a least-squares line in the world size, and what that line predicts at
1,000 ranks; the files' line is also the format's: ckpt writes per rank at most 4 pack files and one zarr.json,
whatever the tensor count (docs/checkpointing.md, "On disk"), DCP one file per rank, and both one metadata file.

    .venv/bin/python bench/scale.py                                   # worlds 1,2,4,8; 0.125 and 1 GiB; 100-10,000
    .venv/bin/python bench/scale.py --worlds 1,2 --sizes 0.125 --tensors 100 --repeats 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import planning  # noqa: E402
from kit import positive, positives  # noqa: E402

METHODS = ("dcp_save", "dcp_async", "ckpt")


def sweep_sizes(worlds: list[int], sizes: list[float], repeats: int) -> list[dict]:
    """One row per (size, world, method): medians from bench/save_restore.py."""
    rows = []
    for size in sizes:
        for world in worlds:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                cmd = [sys.executable, os.path.join(HERE, "save_restore.py"), "--ranks", str(world)]
                cmd += ["--size-gb", str(size), "--only", ",".join(METHODS), "--repeats", str(repeats)]
                subprocess.run(cmd + ["--json", out.name], check=True, stdout=subprocess.DEVNULL)
                result = json.load(open(out.name))
            for r in result["rows"]:
                med = {k: statistics.median(r[k]) for k in ("stall", "durable", "restore")}
                rows.append(dict(size=size, world=world, method=r["method"], files=r["files"], cold=r["cold"], **med))
                print(
                    f"{size:>6} GiB {world:>3} ranks  {r['method']:<10} stall {med['stall']:7.3f}  durable "
                    f"{med['durable']:7.3f}  restore {med['restore']:7.3f}  files {r['files']:>5}"
                    + ("" if r["cold"] else "  (warm cache)"),
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def sweep_tensors(worlds: list[int], counts: list[int], repeats: int) -> list[dict]:
    """One row per (tensor count, world): bench/planning.py's medians."""
    rows = []
    for tensors in counts:
        for world in worlds:
            r = planning.run(world, tensors, repeats)
            rows.append(dict(tensors=tensors, world=world, **r))
            print(f"{tensors:>6} tensors {world:>3} ranks  {r}", file=sys.stderr, flush=True)
    return rows


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    if len(set(xs)) < 2:
        return ys[0], 0.0
    b, a = statistics.linear_regression(xs, ys)
    return a, b


def growth(label: str, xs: list[float], ys: list[float]) -> str:
    """The fitted line of `ys` against the world size and its value at R = 1,000; a line falling with R (noise over
    a cost that does not grow, or too few worlds) is said to be flat, never extrapolated to a negative cost."""
    a, b = fit(xs, ys)
    if b <= 0:
        return f"  {label} flat over R = {min(xs):g}..{max(xs):g} (largest {max(ys):.4g}): no growth to extrapolate"
    return f"  {label} = {a:8.4f} + {b:8.5f} R  -> {a + 1000 * b:10.2f}"


def report(sizes: list[dict], tensors: list[dict]) -> str:
    lines = []
    for size in sorted({r["size"] for r in sizes}):
        lines += [
            "",
            f"{size} GiB (kit transformer + Adam, FSDP2), medians; ratio = ckpt / the best peer's (dcp.save for durable)",
            f"{'ranks':>5}  {'method':<10}{'stall s':>9}{'durable s':>11}{'restore s':>11}{'files':>7}",
        ]
        for world in sorted({r["world"] for r in sizes if r["size"] == size}):
            group = {r["method"]: r for r in sizes if r["size"] == size and r["world"] == world}
            for m in METHODS:
                r = group[m]
                lines.append(
                    f"{world:>5}  {m:<10}{r['stall']:>9.3f}{r['durable']:>11.3f}{r['restore']:>11.3f}{r['files']:>7}"
                    + ("" if r["cold"] else "  warm cache")
                )
            c = group["ckpt"]
            best_restore = min(group[m]["restore"] for m in METHODS if m != "ckpt")
            lines.append(
                f"{'':>5}  {'ratio':<10}{c['stall'] / group['dcp_async']['stall']:>9.2f}"
                f"{c['durable'] / group['dcp_save']['durable']:>11.2f}{c['restore'] / best_restore:>11.2f}"
            )
    if tensors:
        lines += [
            "",
            "planning: T small replicated tensors per rank; stall s (dcp.save: whole save), medians",
            f"{'tensors':>7} {'ranks':>5}  {'ckpt 1st':>9} {'ckpt next':>9} {'dcp.async':>9} {'dcp.save':>9}"
            f"  {'files ckpt':>10} {'dcp':>5}",
        ]
        for r in tensors:
            lines.append(
                f"{r['tensors']:>7} {r['world']:>5}  {r['ckpt_first']:>9.4f} {r['ckpt_next']:>9.4f} "
                f"{r['dcp_async']:>9.4f} {r['dcp_save']:>9.4f}  {r['ckpt_files']:>10.0f} {r['dcp_files']:>5.0f}"
            )
    lines += ["", "growth in the world size R (least squares over the worlds run), and its value at R = 1,000:"]
    for size in sorted({r["size"] for r in sizes}):
        for m in METHODS:
            pts = [r for r in sizes if r["size"] == size and r["method"] == m and r["world"] > 1]
            for k in ("durable", "restore", "files"):
                if len(pts) >= 2:
                    lines.append(growth(f"{size} GiB {m:<10} {k:<8}", [r["world"] for r in pts], [r[k] for r in pts]))
    for count in sorted({r["tensors"] for r in tensors}):
        for k in ("ckpt_first", "ckpt_next", "dcp_async", "ckpt_files", "dcp_files"):
            pts = [r for r in tensors if r["tensors"] == count]
            if len(pts) >= 2:
                lines.append(growth(f"{count} tensors {k:<10}", [r["world"] for r in pts], [r[k] for r in pts]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=positives(int), default="1,2,4,8")
    ap.add_argument(
        "--sizes",
        type=positives(float),
        default="0.125,1",
        help="state sizes in GiB for the ranks sweep ('' to skip it)",
    )
    ap.add_argument(
        "--tensors",
        type=positives(int),
        default="100,1000,10000",
        help="tensor counts for the planning sweep ('' to skip)",
    )
    ap.add_argument("--repeats", type=positive(int), default=3)
    ap.add_argument("--json", default=None, help="also write the raw rows to this file")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    sizes = sweep_sizes(worlds, [float(s) for s in args.sizes.split(",") if s], args.repeats)
    counts = sweep_tensors(worlds, [int(t) for t in args.tensors.split(",") if t], args.repeats)
    print(report(sizes, counts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "tensors": counts, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
