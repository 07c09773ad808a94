"""Stock `transformers.Trainer` vs `CkptTrainer` on the same tiny GPT-2 and arguments: `train()` seconds, ratio.

Each run is a fresh process (every trainer pays its own first-call costs inside `train()`; imports and model
construction are outside the timing), alternating the kinds, each into a new output dir. Kinds: ``stock``,
``ckpt`` (the default CkptTrainer: HF-native folders) and ``ckpt-bare`` (``folder_files=False``: what the folders'
config + model.safetensors cost). Prints the medians and the ratios to stock, and for the ckpt kinds the median
per save of the stall (the snapshot, on the training thread) and of the background write + commit, from the
manager's log. Default: 60 steps, save_steps=10, save_total_limit=2, 5 runs each.

Run: python bench/hf_overhead.py [--runs 5] [--steps 60] [--profile stock|ckpt|ckpt-bare]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from kit import positive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("stock", "ckpt", "ckpt-bare")


def child(kind: str, output_dir: str, steps: int, profile: bool) -> None:
    """One timed train() in this process; prints 'seconds WALL CPU' and one 'save STALL BACKGROUND' per commit."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from integrations.hf import CkptTrainer

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": x, "labels": x} for x in ids]
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=4,
        save_steps=10,
        save_total_limit=2,
        logging_steps=10,
        seed=0,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if kind == "stock":
        trainer = Trainer(model=model, args=args, train_dataset=data)
    else:
        trainer = CkptTrainer(model=model, args=args, train_dataset=data, folder_files=kind == "ckpt")
    saves: list[tuple[float, float]] = []

    class Commits(logging.Handler):  # the manager logs "committed step N: ..., stall S, background B" per save
        def emit(self, record: logging.LogRecord) -> None:
            m = re.search(r"stall ([0-9.]+)s, background ([0-9.]+)s", record.getMessage())
            if m:
                saves.append((float(m.group(1)), float(m.group(2))))

    log = logging.getLogger("ckpt")
    log.addHandler(Commits())
    log.setLevel(logging.INFO)
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if profile:
        prof.disable()
        pstats.Stats(prof).sort_stats(os.environ.get("HF_BENCH_SORT", "cumulative")).print_stats(45)
    for stall, background in saves:
        print(f"save {stall:.4f} {background:.4f}", flush=True)
    print(f"seconds {seconds:.4f} {cpu:.4f}", flush=True)


def timed(kind: str, steps: int) -> tuple[float, float, list[tuple[float, float]]]:
    """train() wall and CPU seconds (all threads) of one fresh process of `kind`, and (stall, background) per save."""
    with tempfile.TemporaryDirectory(prefix=f"hf-bench-{kind}-") as out:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", kind, out, "--steps", str(steps)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"},
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("seconds ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    saves = [(float(x.split()[1]), float(x.split()[2])) for x in proc.stdout.splitlines() if x.startswith("save ")]
    return float(lines[-1].split()[1]), float(lines[-1].split()[2]), saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=positive(int), default=5)
    parser.add_argument("--steps", type=positive(int), default=60)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--profile", choices=KINDS, help="one cProfiled train() of that kind (HF_BENCH_SORT=tottime)")
    a = parser.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.steps, profile=bool(os.environ.get("HF_BENCH_PROFILE")))
        return
    if a.profile:
        with tempfile.TemporaryDirectory() as out:
            subprocess.run(
                [sys.executable, __file__, "--child", a.profile, out, "--steps", str(a.steps)],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "HF_BENCH_PROFILE": "1"},
            )
        return
    runs: dict[str, list[tuple[float, float, list[tuple[float, float]]]]] = {kind: [] for kind in KINDS}
    for _ in range(a.runs):
        for kind in runs:
            runs[kind].append(timed(kind, a.steps))
    wall = {kind: statistics.median(w for w, _, _ in rs) for kind, rs in runs.items()}
    cpu = {kind: statistics.median(c for _, c, _ in rs) for kind, rs in runs.items()}
    print(
        f"{a.steps} steps, save_steps=10, save_total_limit=2, tiny GPT-2 (2 layers, 32 wide), CPU; train() "
        f"seconds, median of {a.runs} fresh processes each (cpu: all threads, less sensitive to a busy machine; "
        f"paired: median over rounds of the ratio to that round's stock run)"
    )
    # each round runs every kind back to back: the ratio within a round shares the machine's load of the moment
    paired = {kind: statistics.median(r[0] / s[0] for r, s in zip(rs, runs["stock"])) for kind, rs in runs.items()}
    for kind, rs in runs.items():
        ratio = "" if kind == "stock" else f" ({wall[kind] / wall['stock']:.2f}x; paired {paired[kind]:.2f}x)"
        cratio = "" if kind == "stock" else f" ({cpu[kind] / cpu['stock']:.2f}x)"
        print(
            f"  {kind:<9} wall {wall[kind]:6.3f} s{ratio:<23} cpu {cpu[kind]:6.3f} s{cratio:<8} "
            f"runs (wall): {', '.join(f'{w:.3f}' for w, _, _ in rs)}"
        )
    for kind, rs in runs.items():
        saves = [s for _, _, ss in rs for s in ss]
        if saves:
            print(
                f"  {kind:<9} per save (median of {len(saves)}): stall {statistics.median(s for s, _ in saves) * 1e3:.1f} "
                f"ms, background write + commit {statistics.median(b for _, b in saves) * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
