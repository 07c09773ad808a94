"""End to end: train, SIGKILL at a random step (or mid background write), resume, and match a straight run bitwise.

Run as a script this file is the training child; as a test module it drives children through subprocess.
Negative controls leave one RNG source (or the sampler, or the loader generator) out and must see a divergence that
starts exactly at the first resumed step: everything before the resume matches a straight run of the same program.
Kill points are drawn from CKPT_KILL_SEED (printed with every failure) among those where a step is surely committed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ckpt import CheckpointManager, RandomWindowSampler, RNGState, TokenWindowDataset, explain, make_loader
from ckpt.determinism.data import hash_batch
from test_data_sampler import noisy, write_tokens

STEPS, EVERY, VOCAB, DIM, WINDOW, STRIDE, BATCH, SEED = 30, 3, 64, 16, 17, 5, 8, 5
OMIT = ("torch", "numpy", "python", "generators", "sampler", "loader_generator")
KILL_SEED = int(os.environ.get("CKPT_KILL_SEED", random.SystemRandom().randrange(1 << 30)))
SEED_NOTE = f"rerun with CKPT_KILL_SEED={KILL_SEED}"


class TinyLM(torch.nn.Module):
    """Embedding, dropout, linear: enough to make every RNG source change the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(DIM, VOCAB)


def small_tokens(tokens: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """Fold tokens into the tiny vocabulary, then add per-sample augmentation noise."""
    return noisy(tokens % VOCAB, rng)


def train(root: str, tokens: str, log_path: str, final_path: str, omit: str | None, hold_at: int | None) -> None:
    """The child: resume from the newest checkpoint if any, train to STEPS, log losses and batch hashes; at step
    `hold_at` it waits to be killed (a kill that came late would otherwise find it exited)."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = TinyLM()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    dataset = TokenWindowDataset(tokens, np.uint16, WINDOW, SEED, transform=small_tokens)
    sampler = RandomWindowSampler(dataset.n_tokens, WINDOW, STRIDE, BATCH, SEED, fingerprint=dataset.fingerprint())
    noise_gen, smooth_rng = torch.Generator().manual_seed(1), np.random.default_rng(2)
    generators = {} if omit == "generators" else {"noise": noise_gen, "smooth": smooth_rng}
    rng = RNGState(generators, torch=omit != "torch", numpy=omit != "numpy", python=omit != "python")
    state = {"model": model, "optim": optim, "rng": rng, **({} if omit == "sampler" else {"sampler": sampler})}
    with CheckpointManager(root) as manager, open(log_path, "a") as log:
        start = manager.restore(state) or 0
        print(f"restored {start}", flush=True)
        log.write(json.dumps({"restored": start}) + "\n")  # an attempt begins
        if omit == "loader_generator":
            loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        else:
            loader = make_loader(dataset, sampler, num_workers=2, prefetch_factor=3)
        for step, batch in zip(range(start + 1, STEPS + 1), sampler.track(loader)):  # steps count from 1
            x = batch["tokens"]
            h = model.emb(x[:, :-1]) * float(np.random.uniform(0.9, 1.1))
            h = model.drop(h + 0.01 * torch.randn(h.shape, generator=noise_gen))
            logits = model.out(h).reshape(-1, VOCAB)
            loss = F.cross_entropy(logits, x[:, 1:].reshape(-1), label_smoothing=float(smooth_rng.uniform(0, 0.1)))
            loss = loss * (1 + 0.1 * random.random())
            optim.zero_grad()
            loss.backward()
            optim.step()
            record = {
                "step": step,
                "loss": loss.item().hex(),
                "hash": hash_batch(batch["t"].tolist(), batch["start"].tolist()),
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"step {step}", flush=True)
            if step == hold_at:
                time.sleep(600)
            if step % EVERY == 0:
                manager.save(step, state)
                print(f"saving {step}", flush=True)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    Path(final_path).write_bytes(weights.numpy().tobytes())


def _child(run: Path, tokens: Path, omit: str | None, kill_on: str | None) -> list[str]:
    """The child's command; killed on "step N" it holds there, on "saving N" at the next step (its write goes on)."""
    args = [sys.executable, __file__, "--root", str(run / "ckpt"), "--tokens", str(tokens), "--log", str(run / "log.jsonl"),
            "--final", str(run / "final.bin")]  # fmt: skip
    if kill_on:
        what, step = kill_on.split()
        args += ["--hold-at", str(int(step) + (what == "saving"))]
    return args + (["--omit", omit] if omit else [])


def _run(run: Path, tokens: Path, omit: str | None = None, kill_on: str | None = None) -> list[str]:
    """Run the child to the end, or SIGKILL it when it prints `kill_on`; return the lines it printed."""
    run.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        _child(run, tokens, omit, kill_on), stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent
    )
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == kill_on:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.stdout.close()
    code = proc.wait(timeout=120)
    assert code == (-signal.SIGKILL if kill_on else 0), (SEED_NOTE, kill_on, lines[-5:])
    return lines


def _attempts(run: Path) -> list[tuple[int, dict[int, str]]]:
    """Per attempt, in order: the step it resumed from (0: none) and the loss it logged for each step."""
    attempts: list[tuple[int, dict[int, str]]] = []
    for line in (run / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "restored" in record:
            attempts.append((record["restored"], {}))
        else:
            attempts[-1][1][record["step"]] = record["loss"]
    return attempts


def _weights(run: Path) -> bytes:
    return (run / "final.bin").read_bytes()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    return write_tokens(tmp_path_factory.mktemp("data") / "tokens.bin", 3000)


def _kill_point(case: int) -> str:
    """Case 1 dies right after a save returned (its write still in the background), the others at a random step.

    Only points where a step is surely committed: `save` drains the save before it, so once "saving 6" (or
    "step 7") is printed, step 3 is durable and the restart must resume from a step > 0.
    """
    rnd = random.Random(KILL_SEED + case)
    return (
        f"saving {EVERY * rnd.randrange(2, STEPS // EVERY)}"
        if case == 1
        else f"step {rnd.randrange(2 * EVERY + 1, STEPS - 1)}"
    )


def _scenario(run: Path, tokens: Path, kill_on: str | None, omit: str | None) -> int | None:
    """A straight run (kill_on None), or a run killed at `kill_on` and restarted; returns the step resumed from."""
    if kill_on is None:
        _run(run, tokens, omit)
        return None
    _run(run, tokens, omit, kill_on)
    return int(_run(run, tokens, omit)[0].split()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokens) -> dict[str, tuple[Path, int | None, str | None]]:
    """Every child run of this module, two at a time (the children are independent; the test process only waits)."""
    jobs = {"reference": (None, None), "reference-loader_generator": (None, "loader_generator"),
            **{f"kill{c}": (_kill_point(c), None) for c in range(3)},
            **{f"omit-{o}": ("step 13", o) for o in OMIT}}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        futures = {name: (tmp_path_factory.mktemp(name), kill_on, omit) for name, (kill_on, omit) in jobs.items()}
        futures = {name: (run, kill_on, pool.submit(_scenario, run, tokens, kill_on, omit))
                   for name, (run, kill_on, omit) in futures.items()}  # fmt: skip
    return {name: (run, future.result(), kill_on) for name, (run, kill_on, future) in futures.items()}


@pytest.mark.parametrize("case", range(3))
def test_resume_after_sigkill_is_bitwise_identical(runs, case):
    run, resumed_from, kill_on = runs[f"kill{case}"]
    context = f"{SEED_NOTE}: killed on {kill_on!r}, resumed from {resumed_from}"
    ((_, reference),) = _attempts(runs["reference"][0])
    (first, killed), (again, resumed) = _attempts(run)
    assert first == 0 and again == resumed_from and 0 < resumed_from <= max(killed), context  # a restore was tested
    assert killed == {s: reference[s] for s in killed}, context
    assert resumed == {s: reference[s] for s in range(resumed_from + 1, STEPS + 1)}, context
    assert _weights(run) == _weights(runs["reference"][0]), context


def test_explain_from_checkpoint_matches_logged_hashes(runs):
    """The sampler state stored in a checkpoint explains every step's batch, past and future, with the logged hash."""

    class Captured:
        tree: dict = {}

        def state_dict(self) -> dict:
            return self.tree

        def load_state_dict(self, tree: dict) -> None:
            self.tree = tree

    captured, reference = Captured(), runs["reference"][0]
    with CheckpointManager(reference / "ckpt") as manager:
        assert manager.restore({"sampler": captured}, step=15, keys=["sampler"]) == 15
    assert captured.tree["step"] == 15 and captured.tree["t"] == 15 * BATCH
    records = [json.loads(line) for line in (reference / "log.jsonl").read_text().splitlines()]
    logged = [r["hash"] for r in records if "hash" in r]
    assert [explain(captured.tree, step).batch_hash for step in range(1, STEPS + 1)] == logged


@pytest.mark.parametrize("omit", OMIT)
def test_negative_control_leaving_a_source_out_diverges_at_the_resume(runs, omit):
    """Leaving a source out changes nothing until the resume, and the very first resumed step differs.

    The reference is a straight run of the same program: the loader_generator control uses a plain DataLoader,
    whose iter() draws a base seed from the global RNG, in its straight run too (a resume draws it again, later).
    """
    run, resumed_from, _ = runs[f"omit-{omit}"]
    reference_run = runs["reference-loader_generator" if omit == "loader_generator" else "reference"][0]
    ((_, reference),) = _attempts(reference_run)
    (_, killed), (again, resumed) = _attempts(run)
    assert again == resumed_from and resumed_from > 0
    assert killed == {s: reference[s] for s in killed}, f"leaving out {omit} changed the run before any resume"
    diverged = [s for s in sorted(resumed) if resumed[s] != reference[s]]
    assert diverged, f"leaving out {omit} went unnoticed"
    assert diverged[0] == resumed_from + 1, (
        f"leaving out {omit}: first difference at {diverged[0]}, resumed at {resumed_from}"
    )
    assert _weights(run) != _weights(reference_run)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="training child of the determinism kill test")
    for flag in ("--root", "--tokens", "--log", "--final"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--omit", choices=OMIT)
    parser.add_argument("--hold-at", type=int)
    a = parser.parse_args()
    train(a.root, a.tokens, a.log, a.final, a.omit, a.hold_at)
    gc.freeze()  # the child ends here: no final collections over torch's objects (~0.8 s a child)
