"""Export benchmark: `ckpt export` to safetensors (and to one torch.save file) against DCP's `dcp_to_torch_save`.

The kit's state (bench/kit.py: transformer-like model + Adam, ~--size-gb) is saved once as a ckpt step and
once with `torch.distributed.checkpoint.save`; then each conversion runs in a fresh child process, from a dropped
page cache when run as root: time until the output is durable (written and fsync'd: ckpt's export fsyncs, DCP's
`dcp_to_torch_save` does not, so its file is fsync'd after it returns and that is counted) and the peak extra RSS
(VmHWM reset through /proc/self/clear_refs, plus a 2 ms sampler, minus the RSS once the libraries are imported).
Every method converts the whole state (model and optimizer tensors; safetensors holds tensors only, so the
optimizer's hyper-parameters are left out there).

    .venv/bin/python bench/export_weights.py                  # 2 GiB of state
    .venv/bin/python bench/export_weights.py --size-gb 0.25   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kit import (  # noqa: E402
    GIB,
    ROOT,
    PeakRSS,
    build_state,
    drop_caches,
    exit_on_sigterm,
    fsync_path,
    names,
    positive,
    proc_status,
    state_bytes,
)

METHODS = {
    "ckpt_safetensors": "ckpt export --format safetensors",
    "ckpt_torch": "ckpt export --format torch",
    "dcp_to_torch_save": "DCP dcp_to_torch_save (+ fsync)",
}


def run_child(method: str, work: str) -> dict:
    """One conversion in this (fresh) process: seconds, bytes written, peak extra RSS, cold or warm cache."""
    import torch  # noqa: F401 - every library imported before the baseline RSS
    import torch.distributed.checkpoint.format_utils as fu

    import ckpt

    out = os.path.join(work, f"out-{method}")
    baseline = proc_status("VmRSS")
    cold = drop_caches()
    with PeakRSS() as peak, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        if method == "dcp_to_torch_save":
            fu.dcp_to_torch_save(os.path.join(work, "dcp"), out)
            fsync_path(out)
        else:
            ckpt.export(
                os.path.join(work, "ckpt"),
                out,
                format=method.removeprefix("ckpt_"),
                keys=["model", "optim"],
                progress=False,
            )
        seconds = time.perf_counter() - t0
    written = (
        sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        if os.path.isdir(out)
        else os.path.getsize(out)
    )
    shutil.rmtree(out) if os.path.isdir(out) else os.unlink(out)
    return {"seconds": seconds, "bytes": written, "rss": peak.peak - baseline, "cold": cold}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=positive(float), default=2.0)
    ap.add_argument("--repeats", type=positive(int), default=1, help="runs per method (the median is reported)")
    ap.add_argument(
        "--only", type=names(tuple(METHODS)), default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, deleted after)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        print(json.dumps(run_child(args._child, args.dir)))
        return

    import torch.distributed.checkpoint as dcp

    import ckpt

    exit_on_sigterm()
    work = args.dir or tempfile.mkdtemp(prefix="ckpt-export-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        model, optim = build_state(args.size_gb, args.seed)
        with ckpt.CheckpointManager(os.path.join(work, "ckpt")) as manager:
            manager.save(1, {"model": model, "optim": optim}).wait()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: a single process writes
            dcp.save(
                {"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=os.path.join(work, "dcp")
            )
        nbytes = state_bytes(model, optim)
        del model, optim, manager  # the manager's staging arena too: the children measure their own memory
        gc.collect()
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        rows = {}
        for method in args.only.split(","):
            runs = []
            for _ in range(args.repeats):
                proc = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--_child", method, "--dir", work],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=ROOT,
                )
                if proc.returncode:
                    raise SystemExit(f"{method} failed:\n{proc.stderr[-3000:]}")
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            rows[method] = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "bytes", "rss")}
            rows[method]["cold"] = all(r["cold"] for r in runs)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    cold = all(r["cold"] for r in rows.values())
    print(
        f"state: {nbytes / GIB:.2f} GiB of tensors; median of {args.repeats}; "
        + ("cold page cache" if cold else "WARM CACHE (not root)")
    )
    ref = rows.get("ckpt_safetensors")
    print(f"{'method':<36} {'seconds':>8} {'GB/s':>6} {'out GiB':>8} {'peak RSS+ GiB':>13} {'x time':>7} {'x RSS':>6}")
    for method, r in rows.items():
        rel_t = f"{r['seconds'] / ref['seconds']:.2f}" if ref else "-"
        rel_m = f"{r['rss'] / ref['rss']:.1f}" if ref and ref["rss"] > 0 else "-"
        print(
            f"{METHODS[method]:<36} {r['seconds']:>8.2f} {nbytes / r['seconds'] / 1e9:>6.2f} "
            f"{r['bytes'] / GIB:>8.2f} {r['rss'] / GIB:>13.3f} {rel_t:>7} {rel_m:>6}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_gb": args.size_gb, "state_bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
