"""Interference benchmark: what a background save costs the training that goes on meanwhile, ckpt vs DCP async_save.

A training stand-in (a 256x256 matmul plus a pure-Python loop per step, one torch thread: one core's worth
of work, as the Python side of a GPU job) runs while each method saves the kit's state (bench/kit.py:
a transformer-like model + Adam). Two settings, interleaved save by save:

- thread: the loop runs in the saving process's main thread. It calls save, then steps until the save is
  durable. stall = time in the save call; background = from there until durable; kept = steps/s during
  the background / idle steps/s (the mean of the idle loop just before and just after the save: other
  load drifts); lost = stall + (1 - kept) x background.
- process: the loop runs in another process (spawned; its step count and worst step read through shared
  memory), while this process saves and waits. kept = its steps/s from the save call until durable / its
  idle steps/s (before and after, as above); lost = (1 - kept) x durable (the save call stalls nobody there).

noise = how far the idle rate drifted between just before and just after the save, as seconds of the write
window (|after - before| / idle x window): a lost figure below it cannot be told from zero, and no lost/dcp
ratio is printed when dcp.async_save's lost is below its noise.

Per save also: durable = stall + background, and the worst latency of one training step during it. Every
figure is the median of the measured saves (`--repeats` per child x `--rounds` children per variant, the
variants' children interleaved round by round). Each variant runs in fresh child processes; the first save
of each child is not in the medians: it is reported as "1st stall", taken `--first-after` seconds after the
child's start (ckpt: after a fresh-start `restore`, which reserves the staging arena in the background), the
stand-in training until then as a job does and as it does before every measured save.
DCP async_save uses a FileSystemWriter with sync_files=True (every file fsync'd; ckpt fsyncs every chunk).
`ckpt` is the manager's default (``snapshot="sync"``: every tensor copied inside save); `ckpt:snapshot=overlap` the
opt-in overlapped snapshot (the parameters and Adam's state copied after save returns; the next optimizer step
waits for that copy: see --optim-ms).
`raw` writes the same bytes with no library (`kit.RawWrite`: a copy into a warm buffer, then one thread's crc32c, O_DIRECT
writes and fdatasyncs of 64 MiB files): the floor of what the disk IO itself costs a training thread on this machine.

    .venv/bin/python bench/interference.py                          # 1 and 2 GiB, medians of 3
    .venv/bin/python bench/interference.py --quick                  # 0.125 GiB, 3 saves (~1-2 min)
    .venv/bin/python bench/interference.py --sizes 0.25 --rounds 3 --repeats 1 \\
        --variants dcp_async,ckpt,ckpt:nice=0,ckpt:cores=0.5        # compare write budgets, interleaved
    .venv/bin/python bench/interference.py --sizes 1,2 --rounds 2 --variants dcp_async,ckpt,ckpt:snapshot=overlap
    .venv/bin/python bench/interference.py --sizes 2 --rounds 2 --variants dcp_async,ckpt,raw   # against the floor
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kit  # noqa: E402

_PY_LOOP = 4000  # iterations of pure Python per step


# -- the training stand-in ------------------------------------------------------------------------------


class Trainer:
    """One training step: a matmul (torch, one thread) and some pure-Python work, about 1 ms on this machine.

    With `optim_ms`, every `optim_ms` ms the stand-in also takes an optimizer step (SGD on a tensor of its own):
    the end of a GPU step that long. ckpt's overlapped snapshot (`ckpt:snapshot=overlap`) makes every optimizer
    step wait for its copy, so this measures what that wait costs; without it the saved state is never stepped
    (the issue's stand-in)."""

    def __init__(self, optim_ms: float = 0.0):
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(1)
        self.a = torch.randn(256, 256)
        self.w = torch.zeros(8, requires_grad=True)
        self.w.grad = torch.ones(8)
        self.opt = torch.optim.SGD([self.w], lr=1e-3)
        self.optim_s, self.last_opt = optim_ms / 1e3, time.perf_counter()

    def step(self) -> None:
        self.a.matmul(self.a)
        s = 0
        for i in range(_PY_LOOP):
            s += i
        if self.optim_s and time.perf_counter() - self.last_opt >= self.optim_s:
            self.opt.step()
            self.last_opt = time.perf_counter()

    def rate(self, seconds: float) -> float:
        """Idle steps per second, over `seconds`."""
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.step()
            n += 1
        return n / (time.perf_counter() - t0)

    def run_until(self, done) -> tuple[int, float, float]:
        """Step until `done()`; returns (steps, seconds, worst step in seconds)."""
        n, t0 = 0, time.perf_counter()
        last, worst = t0, 0.0
        while not done():
            self.step()
            n += 1
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        return n, time.perf_counter() - t0, worst


def _train_forever(shared) -> None:
    """The separate-process loop: shared[0] = steps so far, shared[1] = worst step (s) since shared[2] was set;
    it ends when shared[3] is set and idles while shared[4] is (a thread-mode save is being measured)."""
    t = Trainer()
    last = time.perf_counter()
    while shared[3] == 0:
        if shared[4]:
            time.sleep(0.01)
            last = time.perf_counter()
            continue
        t.step()
        now = time.perf_counter()
        if shared[2]:
            shared[1], shared[2] = 0.0, 0
        shared[1] = max(shared[1], now - last)
        shared[0] += 1
        last = now


class OtherProcess:
    """The training loop in a spawned process; its progress read through shared memory."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.shared = ctx.RawArray("d", 5)
        self.proc = ctx.Process(target=_train_forever, args=(self.shared,), daemon=True)
        self.proc.start()
        while self.shared[0] < 100:  # started and warm
            time.sleep(0.05)

    def pause(self, paused: bool) -> None:
        self.shared[4] = float(paused)

    def rate(self, seconds: float) -> float:
        n0, t0 = self.shared[0], time.perf_counter()
        time.sleep(seconds)
        return (self.shared[0] - n0) / (time.perf_counter() - t0)

    def mark(self) -> tuple[float, float]:
        self.shared[2] = 1  # the loop resets its worst step at its next step
        return self.shared[0], time.perf_counter()

    def since(self, mark: tuple[float, float]) -> tuple[float, float, float]:
        """(steps, seconds, worst step) since `mark`."""
        return self.shared[0] - mark[0], time.perf_counter() - mark[1], self.shared[1]

    def close(self) -> None:
        self.shared[3] = 1
        self.proc.join(10)


def thread_times() -> dict[int, tuple[str, float, float]]:
    """Per thread of this process: (name, CPU seconds, seconds runnable but waiting for a CPU); Linux procfs."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                waited = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError):  # ended meanwhile, or no schedstat
            continue
        out[int(tid)] = (names.get(int(tid), comm), (int(fields[11]) + int(fields[12])) / tick, waited)
    return out


def where_cpu_went(before: dict, after: dict, main: int) -> dict[str, float]:
    """CPU seconds per group of threads between two `thread_times`, and the training thread's run-queue wait."""
    out = {"train_cpu": 0.0, "train_wait": 0.0, "pool_cpu": 0.0, "ckpt_cpu": 0.0, "other_cpu": 0.0}
    for tid, (name, cpu, waited) in after.items():
        _, cpu0, waited0 = before.get(tid, (name, 0.0, 0.0))
        if tid == main:
            out["train_cpu"], out["train_wait"] = cpu - cpu0, waited - waited0
        else:
            group = "pool" if name == "ts_pool_worker" else "ckpt" if name.startswith("ckpt-") else "other"
            out[f"{group}_cpu"] += cpu - cpu0
    return out


# -- methods --------------------------------------------------------------------------------------------


METHODS = ("ckpt", "dcp_async", "raw")  # a variant's name before its first ':'; the kit's adapters


def adapter(variant: str, work: str, model, optim) -> kit.Adapter:
    """The kit's adapter of `variant` (ckpt's with the options after its name: see `options_of`)."""
    method, _, spec = variant.partition(":")
    if method != "ckpt":
        return kit.ADAPTERS[method](work, model, optim)
    budget, snapshot = options_of(spec)
    mode = {} if snapshot is None else {"snapshot": snapshot}  # None: the manager's default ("sync")
    impl = kit.Ckpt(work, model, optim, write_budget=budget, **mode)
    impl.label = "ckpt" + (f" [{spec}]" if spec else "")
    return impl


def options_of(spec: str):
    """`cores=0.5:files=4:nice=0:snapshot=overlap` -> (WriteBudget(cores=0.5, file_ops_per_core=4, nice=0),
    "overlap"); "" -> the defaults (snapshot None: the manager's own, "sync"). A bad spec raises ValueError."""
    from ckpt import WriteBudget
    from ckpt.snapshot import MODES

    names = {"cores": ("cores", float), "files": ("file_ops_per_core", int), "nice": ("nice", int)}
    kw, snapshot = {}, None
    for part in filter(None, spec.split(":")):
        key, _, value = part.partition("=")
        if key == "snapshot" and value in MODES:
            snapshot = value
        elif key in names:
            name, kind = names[key]
            kw[name] = kind(value)
        else:
            raise ValueError(f"{part!r}: expected cores=X, files=N, nice=N or snapshot={'|'.join(MODES)}")
    return WriteBudget(**kw), snapshot


def run_child(args) -> dict:
    """One variant in this (fresh) process: a first save, then `repeats` x (thread-mode save, process-mode save)."""
    warnings.filterwarnings("ignore")
    t_start = time.perf_counter()
    model, optim = kit.build_state(args.size, args.seed)
    work = tempfile.mkdtemp(dir=args.dir, prefix=f"{args._child.partition(':')[0]}-")
    impl = adapter(args._child, work, model, optim)
    trainer = Trainer(args.optim_ms)
    impl.fresh_start()
    other = OtherProcess()
    other.pause(True)
    trainer.rate(max(0.0, args.first_after - args.idle_s - (time.perf_counter() - t_start)))  # a job trains until then
    gc.collect()  # prepared as every measured save is (a collection due inside the save call is not the save)
    os.sync()
    trainer.rate(args.idle_s)
    first, _ = kit.timed_save(impl, 0)
    impl.delete(0)
    rows = {"thread": [], "process": []}
    step = 1
    for _ in range(args.repeats):
        for mode in ("thread", "process"):
            gc.collect()
            os.sync()
            other.pause(mode == "thread")
            if mode == "thread":
                idle = trainer.rate(args.idle_s)
                before = thread_times()
                t0 = time.perf_counter()
                handle = impl.save(step)
                stall = time.perf_counter() - t0
                n, bg, worst = trainer.run_until(handle.done)
                handle.wait()
                cpu = where_cpu_went(before, thread_times(), threading.get_native_id())
                after = trainer.rate(args.idle_s)
                idle, drift = (idle + after) / 2, abs(after - idle)  # before and after: other load drifts
                kept = n / bg / idle
                lost = stall + (1 - kept) * bg
                noise = drift / idle * bg
            else:
                time.sleep(0.2)  # let it warm up again
                idle = other.rate(args.idle_s)
                mark = other.mark()
                stall, _ = kit.timed_save(impl, step)
                n, durable, worst = other.since(mark)
                after = other.rate(args.idle_s)
                idle, drift = (idle + after) / 2, abs(after - idle)
                bg = durable - stall
                kept = n / durable / idle
                lost = (1 - kept) * durable
                noise = drift / idle * durable
                cpu = {}
            rows[mode].append(
                {
                    "stall": stall,
                    "bg": bg,
                    "durable": stall + bg,
                    "kept": kept,
                    "worst": worst,
                    "lost": lost,
                    "noise": noise,
                    "idle": idle,
                }
                | cpu
            )
            impl.delete(step)
            step += 1
    other.close()
    shutil.rmtree(work, ignore_errors=True)
    return {"label": impl.label, "first": first, "rows": rows}


# -- driver ---------------------------------------------------------------------------------------------


def spawn(script: str, variant: str, size: float, argv: list[str]) -> dict:
    """Run one variant of a benchmark `script` in a fresh Python process; its last line of output is its JSON."""
    cmd = [sys.executable, os.path.abspath(script), "--_child", variant, "--size", str(size), *argv]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode:
        raise SystemExit(f"child {variant} ({size} GiB) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_or_run_child(ap: argparse.ArgumentParser, argv, run_child) -> argparse.Namespace | None:
    """The driver's arguments; in a child spawned by `spawn`, runs `run_child` and prints its JSON instead (None)."""
    ap.add_argument("--size", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        print(json.dumps(run_child(args)))
        return None
    return args


def interleaved(args, variants: list[str], child, prefix: str) -> Iterator[tuple[float, dict[str, list[dict]]]]:
    """Per size of `args.sizes`: each variant's `args.rounds` children, interleaved round by round, in `args.dir`
    (a temp dir with `prefix` unless given, deleted after)."""
    kit.exit_on_sigterm()  # its children are ended by subprocess.run, the dir by the `finally` below
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix=prefix)
    try:
        for size in map(float, args.sizes.split(",")):
            results: dict[str, list[dict]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v in variants:
                    results[v].append(child(args, v, size))
            yield size, results
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)


def child(args, variant: str, size: float) -> dict:
    argv = ["--repeats", str(args.repeats), "--idle-s", str(args.idle_s), "--first-after", str(args.first_after)]
    argv += ["--seed", str(args.seed), "--dir", args.dir, "--optim-ms", str(args.optim_ms)]
    return spawn(__file__, variant, size, argv)


COLUMNS = ("stall", "bg", "durable", "kept", "worst", "lost", "noise")


def report(size: float, results: dict[str, list[dict]], args) -> str:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    lines = []
    for mode, title in (
        ("thread", "training loop in the saving process's main thread"),
        ("process", "training loop in another process"),
    ):
        n = len(results[next(iter(results))][0]["rows"][mode]) * len(results[next(iter(results))])
        optim = f", an optimizer step every {args.optim_ms:g} ms" if args.optim_ms and mode == "thread" else ""
        lines.append(f"\n{size:g} GiB, {mode} mode ({title}{optim}), medians of {n}")
        lines.append(
            f"{'method':<28}{'stall s':>9}{'bg s':>8}{'durable s':>11}{'kept x':>8}{'max step ms':>13}"
            f"{'lost s':>8}{'noise s':>9}{'lost/dcp':>10}{'1st stall s':>13}{'idle st/s':>11}"
        )
        meds = {}
        for variant, runs in results.items():
            rows = [r for run in runs for r in run["rows"][mode]]
            meds[variant] = {c: med([r[c] for r in rows]) for c in COLUMNS + ("idle",)}
            meds[variant]["first"] = med([run["first"] for run in runs])
            meds[variant]["label"] = runs[0]["label"]
        ref = meds.get("dcp_async")
        for variant, m in meds.items():
            ratio = f"{m['lost'] / ref['lost']:.2f}" if ref and ref["lost"] > ref["noise"] else "-"
            lines.append(
                f"{m['label']:<28}{m['stall']:>9.3f}{m['bg']:>8.3f}{m['durable']:>11.3f}{m['kept']:>8.2f}"
                f"{m['worst'] * 1e3:>13.0f}{m['lost']:>8.3f}{m['noise']:>9.3f}{ratio:>10}{m['first']:>13.3f}"
                f"{m['idle']:>11.0f}"
            )
        if mode == "thread":
            lines.append(
                "  CPU s during the write: training thread on CPU / waiting to run | tensorstore pool | ckpt | other"
            )
            for variant, runs in results.items():
                rows = [r for run in runs for r in run["rows"][mode]]
                c = {
                    k: med([r[k] for r in rows])
                    for k in ("train_cpu", "train_wait", "pool_cpu", "ckpt_cpu", "other_cpu")
                }
                lines.append(
                    f"  {meds[variant]['label']:<26}{c['train_cpu']:>6.2f} /{c['train_wait']:>6.2f} |{c['pool_cpu']:>6.2f}"
                    f" |{c['ckpt_cpu']:>6.2f} |{c['other_cpu']:>6.2f}"
                )
        ck = meds.get("ckpt")
        if ck and ref:
            if ref["lost"] > ref["noise"]:
                verdict = "PASS" if ck["lost"] <= 0.3 * ref["lost"] else "FAIL"
                lost_line = f"[{verdict}] ckpt lost {ck['lost']:.3f} s <= 0.3 x dcp.async_save's {ref['lost']:.3f} s"
            else:  # a ratio of two figures within the noise says nothing
                lost_line = (
                    f"[----] dcp.async_save's lost {ref['lost']:.3f} s is within the noise ({ref['noise']:.3f} s): no "
                    f"ratio; ckpt lost {ck['lost']:.3f} s (noise {ck['noise']:.3f} s)"
                )
            lines.append(
                f"  [{'PASS' if ck['kept'] >= 0.5 else 'FAIL'}] ckpt keeps {ck['kept']:.2f}x >= 0.5x of idle\n"
                f"  {lost_line}\n"
                f"  [{'PASS' if ck['durable'] <= 1.2 * ref['durable'] else 'FAIL'}] ckpt durable {ck['durable']:.3f} s "
                f"<= 1.2 x dcp.async_save's {ref['durable']:.3f} s\n"
                f"  [{'PASS' if ck['first'] <= 1.5 * ck['stall'] else 'FAIL'}] ckpt 1st stall {ck['first']:.3f} s "
                f"<= 1.5 x its steady stall {ck['stall']:.3f} s"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sizes",
        type=kit.positives(float),
        default=None,
        help="state sizes in GiB, comma separated (default 1,2; quick 0.125)",
    )
    ap.add_argument(
        "--variants",
        default="dcp_async,ckpt",
        help="dcp_async, ckpt (the manager's defaults: snapshot=sync), ckpt:cores=X:files=N:nice=N:snapshot=overlap"
        " (or snapshot=sync), raw (no library: the floor)",
    )
    ap.add_argument("--repeats", type=kit.positive(int), default=3, help="measured saves per mode per child")
    ap.add_argument(
        "--rounds", type=kit.positive(int), default=1, help="children per variant, interleaved across variants"
    )
    ap.add_argument(
        "--idle-s", type=kit.positive(float), default=1.0, help="seconds of idle rate measured before each save"
    )
    ap.add_argument("--first-after", type=float, default=10.0, help="the first save comes this long after start")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp, deleted after)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.125 GiB, 3 saves, 0.5 s idle, first at 2 s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--optim-ms",
        type=float,
        default=0.0,
        help="thread mode: the stand-in also takes an optimizer step every this many ms (0: never)",
    )
    ap.add_argument("--json", default=None, help="also write the raw per-save figures to this file")
    args = parse_or_run_child(ap, argv, run_child)
    if args is None:
        return
    if args.quick:
        args.sizes, args.idle_s, args.first_after = args.sizes or "0.125", 0.5, 2.0
    args.sizes = args.sizes or "1,2"
    variants = args.variants.split(",")
    unknown = [v for v in variants if v.partition(":")[0] not in METHODS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}: the methods are {', '.join(METHODS)}")
    for v in variants:  # a bad spec is refused here, not as a traceback in its child
        method, _, spec = v.partition(":")
        try:
            if spec and method != "ckpt":
                raise ValueError("only ckpt takes options")
            options_of(spec)
        except ValueError as e:
            ap.error(f"variant {v!r}: {e}")
    raw = {}
    for size, results in interleaved(args, variants, child, "ckpt-interference-"):
        raw[size] = results
        print(report(size, results, args), flush=True)
    print(
        "\nkept = training steps/s during the write / idle steps/s (mean of just before and just after); lost = training seconds lost per "
        "checkpoint (thread: stall + (1 - kept) x bg; process: (1 - kept) x durable); max step = worst single step "
        "during the write; noise = the idle rate's drift across the save, in seconds of the write window; 1st stall = the "
        "first save of a fresh process"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
