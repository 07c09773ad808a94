"""integrations.TrainLoop with real files, real signals and real child processes (this file is also the child).

The child trains a tiny model with dropout on a RandomWindowSampler over a token file, RNG state on by default.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ckpt import (
    EveryNSeconds,
    EveryNSteps,
    RandomWindowSampler,
    ShuffledSampler,
    TokenWindowDataset,
    layout,
    make_loader,
)
from ckpt.determinism.data import hash_batch
from ckpt.storage import open_storage
from ettr import GoodputTracker, advise, attribute_root, read_ledgers, report_text
from ettr.replay import bits_value
from integrations import Preempted, TrainLoop

TOTAL, EVERY, WINDOW, BATCH, VOCAB = 24, 4, 9, 4, 64
REPO = Path(__file__).resolve().parents[1]


def tiny_model() -> torch.nn.Module:
    """Embedding, dropout, linear: dropout makes the global torch RNG matter."""
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, VOCAB))


def train(root: str, tokens: str, every: int, local: str | None = None) -> None:
    """The child: resume, train to TOTAL printing each step, write the final weights to ROOT/final.bin.

    With `local`, two tiers: every save to the local tier LOCAL, none persisted by the interval (persist_every). With
    PERTURB_STEP in the environment, that step's loss is nudged (a divergence for the replay check to find). With
    HOLD_AT, the child stops after that step's lines until a signal comes (a SIGKILL ends it there, a SIGTERM is
    seen by the loop): the signal lands in that step however late the parent sends it. WORKERS: the loader's
    worker processes."""
    perturb, hold = int(os.environ.get("PERTURB_STEP", "0")), int(os.environ.get("HOLD_AT", "0"))
    workers = int(os.environ.get("WORKERS", "0"))  # DataLoader worker processes
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    dataset = TokenWindowDataset(tokens, np.uint16, WINDOW, seed=3)
    sampler = RandomWindowSampler(dataset.n_tokens, WINDOW, 3, BATCH, seed=3, fingerprint=dataset.fingerprint())
    try:
        tracker = GoodputTracker(root, flush_interval=0)  # every step reaches the ledger before its "step" line
        tiers = {"local": local, "persist_every": 1000} if local else {}
        with TrainLoop(
            root,
            {"model": model, "optim": optim},
            sampler=sampler,
            every_steps=every,
            tracker=tracker,
            **tiers,
        ) as loop:
            print(f"restored {loop.start_step}", flush=True)
            batches = sampler.track(make_loader(dataset, sampler, num_workers=workers))
            for step, batch in zip(loop.steps(TOTAL), batches):
                x = batch["tokens"] % VOCAB
                loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
                if step == perturb:
                    loss = loss * (1 + 2**-10)
                optim.zero_grad()
                loss.backward()
                optim.step()
                loop.on_step_end(step, {"loss": loss.item()})
                print(f"step {step}", flush=True)
                print(f"batch {step} {hash_batch(batch['t'].tolist(), batch['start'].tolist())}", flush=True)
                deadline = time.monotonic() + 120
                while step == hold and not loop.preempted and time.monotonic() < deadline:
                    time.sleep(0.005)
    except Preempted as e:
        print(f"preempted {e.step}", flush=True)
        raise
    Path(root, "final.bin").write_bytes(b"".join(t.numpy().tobytes() for t in model.state_dict().values()))


def run_child(
    root: Path,
    tokens: Path,
    *,
    every: int = EVERY,
    signal_on: tuple[str, int] | None = None,
    local: Path | None = None,
    stderr: Path | None = None,
    env: dict[str, str] | None = None,
    group: bool = False,
) -> tuple[int, list[str]]:
    """Run the child (with `env` added to its environment); send `signal_on[1]` when it prints `signal_on[0]`
    ("step N": the child waits there for the signal), with `group` to its whole process group (its loader's workers
    too, as scancel or `kill -TERM -PGID` do). Returns its exit status and lines; its stderr goes to the file
    `stderr` if given."""
    cmd = [sys.executable, __file__, str(root), str(tokens), str(every)]
    if signal_on:
        env = {**(env or {}), "HOLD_AT": signal_on[0].split()[1]}
    cmd += [f"--local={local}"] if local else []
    with open(stderr, "w") if stderr else contextlib.nullcontext() as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=Path(__file__).parent,
            env={**os.environ, **(env or {})},
            start_new_session=group,
        )
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if signal_on and line.strip() == signal_on[0]:
                (os.killpg if group else os.kill)(proc.pid, signal_on[1])
        return proc.wait(timeout=120), lines


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    np.random.default_rng(0).integers(50_000, size=2000, dtype=np.uint16).tofile(path)
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tokens) -> tuple[Path, list[str]]:
    """An uninterrupted run to TOTAL: its root and printed lines."""
    root = tmp_path_factory.mktemp("reference") / "run"
    code, lines = run_child(root, tokens)
    assert code == 0, lines[-3:]
    return root, lines


def test_explain_shows_the_batch_of_the_step_training_logged(reference):
    """One step numbering: the step a loop logs, its checkpoint's name and `ckpt explain --step` agree."""
    root, lines = reference
    logged = {int(step): digest for kind, step, digest in (l.split() for l in lines if l.startswith("batch"))}
    assert sorted(logged) == list(range(1, TOTAL + 1))
    assert ettr_steps(root) == (1, TOTAL) and layout.committed_steps(open_storage(root)) == list(
        range(EVERY, TOTAL + 1, EVERY)
    )
    for step, checkpoint in ((1, []), (TOTAL, []), (13, ["--checkpoint", "8"])):  # past, last, and after a checkpoint
        out = subprocess.run(
            [sys.executable, "-m", "ckpt", "explain", str(root), "--step", str(step), *checkpoint],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert out.returncode == 0, out.stderr
        assert f"\nstep {step}: " in out.stdout and f"batch hash {logged[step]}\n" in out.stdout, out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "ckpt", "explain", str(root), "--step", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 2 and "steps count from 1" in out.stderr


def ettr_steps(root: Path) -> tuple[int, int]:
    """(first, last) step number in the goodput ledger of a one-attempt run."""
    (attempt,) = attribute_root(str(root)).attempts
    return attempt.first_step, attempt.last_step


def test_sigterm_saves_the_current_step_says_so_in_one_line_and_restart_loses_nothing(tmp_path, tokens):
    root = tmp_path / "run"
    code, lines = run_child(root, tokens, every=1000, signal_on=("step 7", signal.SIGTERM), stderr=tmp_path / "err")
    assert code == 128 + signal.SIGTERM, lines[-3:]
    saved = int(lines[-1].split()[1])  # "preempted <step>": the step in progress when SIGTERM came
    assert lines[-1].startswith("preempted") and saved > 7
    said = (tmp_path / "err").read_text().splitlines()
    pattern = rf"SIGTERM received: checkpoint of step {saved} committed in \d+\.\d{{3}} s; exiting with status 143"
    sigterm = [line for line in said if "SIGTERM" in line]
    assert len(sigterm) == 1 and re.fullmatch(pattern, sigterm[0]), said
    code, resumed = run_child(root, tokens, every=1000)
    assert code == 0 and resumed[0] == f"restored {saved}" and resumed[1] == f"step {saved + 1}"
    a = attribute_root(str(root))
    assert [at.status for at in a.attempts] == ["preempted", "ok"]
    assert [at.lost_steps for at in a.attempts] == [0, 0] and a.micros["lost"] == 0
    assert [at.restored_step for at in a.attempts] == [None, saved]
    assert a.committed_steps == (saved, TOTAL)  # the restart's end saved its last step


def test_sigterm_to_the_process_group_with_loader_workers_saves_and_exits_143(tmp_path, tokens):
    """scancel or `kill -TERM -PGID` signals the loader's workers too: they died of it, and the main process raised
    "DataLoader worker ... is killed by signal" from its next batch instead of saving. The workers now leave it to the
    main process, which saves, and ends them at exit (multiprocessing's own SIGTERM would go unheeded: a hang)."""
    root = tmp_path / "run"
    signal_on = ("step 7", signal.SIGTERM)
    code, lines = run_child(
        root, tokens, every=1000, signal_on=signal_on, stderr=tmp_path / "err", env={"WORKERS": "2"}, group=True
    )
    said = (tmp_path / "err").read_text()
    assert code == 128 + signal.SIGTERM and lines[-1].startswith("preempted"), (lines[-3:], said[-2000:])
    assert "killed by signal" not in said and "SIGTERM received: checkpoint of step" in said, said[-2000:]
    code, resumed = run_child(root, tokens, every=1000)
    assert code == 0 and resumed[0] == f"restored {lines[-1].split()[1]}"


def test_loader_workers_leave_preemption_signals_to_the_main_process(tokens):
    """A SIGTERM or SIGUSR1 that reaches a worker of `make_loader` (a signal to the whole process group) used to kill
    it: the next batch raised "DataLoader worker ... is killed by signal". It is ignored there; the batches go on."""
    import multiprocessing

    dataset = TokenWindowDataset(tokens, np.uint16, WINDOW, seed=3)
    sampler = RandomWindowSampler(dataset.n_tokens, WINDOW, 3, BATCH, seed=3, fingerprint=dataset.fingerprint())
    batches = iter(make_loader(dataset, sampler, num_workers=1, prefetch_factor=1))
    next(batches)  # the worker has run its init
    (worker,) = multiprocessing.active_children()
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        os.kill(worker.pid, signum)
    assert len([next(batches) for _ in range(6)]) == 6 and worker.is_alive()
    del batches  # ends its worker as a finished DataLoader does
    worker.join(60)
    assert not worker.is_alive()


def test_sigterm_with_two_tiers_persists_the_preemption_save_so_a_new_node_resumes_from_it(tmp_path, tokens):
    root, local = tmp_path / "run", tmp_path / "local"
    code, lines = run_child(root, tokens, every=2, local=local, signal_on=("step 7", signal.SIGTERM))
    assert code == 128 + signal.SIGTERM and lines[-1].startswith("preempted"), lines[-3:]
    saved = int(lines[-1].split()[1])
    assert layout.committed_steps(open_storage(root)) == [saved]  # the interval saves stayed local
    shutil.rmtree(local)  # the job comes back on another node: the local tier is gone
    code, resumed = run_child(root, tokens, every=2, local=local)
    assert code == 0 and resumed[0] == f"restored {saved}", resumed[:2]
    assert attribute_root(str(root)).restores_per_tier["durable"][0] == 1


def test_with_two_tiers_the_save_of_the_last_step_is_persisted(tmp_path):
    root, local = tmp_path / "run", tmp_path / "local"
    with TrainLoop(
        str(root), {"w": torch.zeros(2)}, every_steps=2, rng=False, local=str(local), persist_every=100
    ) as loop:
        for step in loop.steps(6):
            loop.on_step_end(step)
    assert layout.committed_steps(open_storage(root)) == [6]  # 2 and 4 stayed local; the job's end is durable


def test_with_two_tiers_a_last_step_saved_at_its_interval_is_persisted_too(tmp_path):
    """A break right after an interval save, or a preemption after a save of the step the loop made already: that
    step was in the local tier alone (save_last skips a step saved already), so a new node started from scratch."""
    root, local = tmp_path / "run", tmp_path / "local"
    kw = dict(every_steps=2, rng=False, local=str(local), persist_every=100)
    with TrainLoop(str(root), {"w": torch.zeros(2)}, **kw) as loop:
        for step in loop.steps(10):
            loop.on_step_end(step)
            if step == 4:
                break
    assert layout.committed_steps(open_storage(root)) == [4]
    assert layout.committed_steps(open_storage(str(local))) == [2, 4]
    with pytest.raises(Preempted):
        with TrainLoop(str(root), {"w": torch.zeros(2)}, **kw) as loop:
            for step in loop.steps(10):
                loop.save(step)  # the user's own save of the open step (after its optimizer step)
                if step == 5:
                    os.kill(os.getpid(), signal.SIGTERM)
                loop.on_step_end(step)
    assert layout.committed_steps(open_storage(root)) == [4, 5]


def test_sigkill_resume_is_bitwise_identical_and_the_report_shows_it(tmp_path, tokens, reference):
    reference, run = reference[0], tmp_path / "run"
    code, killed = run_child(run, tokens, signal_on=("step 10", signal.SIGKILL))
    assert code == -signal.SIGKILL
    code, resumed = run_child(run, tokens)
    restored = int(resumed[0].split()[1])
    assert code == 0 and restored > 0 and restored % EVERY == 0  # 8, or 4 while 8 was still being written
    assert (run / "final.bin").read_bytes() == (reference / "final.bin").read_bytes()

    a = attribute_root(str(run))
    first, second = a.attempts
    assert (first.status, second.status, a.failures) == ("failed", "ok", 1)
    assert second.restored_step == restored and first.last_step >= 10
    assert first.lost_steps == first.last_step - restored > 0 and a.micros["lost"] > 0
    assert a.micros["checkpoint_restore"] > 0 and a.micros["downtime"] > 0
    assert sum(a.micros.values()) == a.wall_us

    # the steps after the checkpoint were trained twice, with the same loss bits and batch: the report says so
    replayed = first.last_step - restored
    assert (a.replay.replayed, a.replay.equal, a.replay.diverged) == (replayed, replayed, 0)
    assert f"replayed {replayed} step(s): {replayed} bitwise equal" in report_text(a).splitlines()
    logged = {int(step): digest for kind, step, digest in (l.split() for l in killed if l.startswith("batch"))}
    (ledger,) = [l for l in read_ledgers(str(run)) if l.attempt == second.attempt]
    records = {r["s"]: r for r in ledger.records if r["k"] == "step"}
    assert all(records[s]["h"] == logged[s] for s in logged if s > restored)  # the sampler's hash, as logged


def test_a_loss_that_differs_after_the_resume_is_reported_at_its_step_with_the_batch_equal(tmp_path, tokens):
    """Killed after step 10, resumed from 4 or 8 with step 9's loss nudged: steps after the checkpoint up to 8 are
    equal, 9 diverges first (and everything after it); a warning in the log, the report, the explain command."""
    run = tmp_path / "run"
    code, killed = run_child(run, tokens, signal_on=("step 10", signal.SIGKILL))
    assert code == -signal.SIGKILL
    code, resumed = run_child(run, tokens, env={"PERTURB_STEP": "9"}, stderr=tmp_path / "err")
    assert code == 0, resumed[-3:]
    restored = int(resumed[0].split()[1])
    a = attribute_root(str(run))
    last = a.attempts[0].last_step
    r = a.replay
    assert (r.replayed, r.equal, r.diverged) == (last - restored, 8 - restored, last - 8)
    d = r.first_divergence
    logged = {int(step): digest for kind, step, digest in (l.split() for l in killed if l.startswith("batch"))}
    assert d.step == 9 and d.first.batch == d.again.batch == logged[9] and d.first.loss != d.again.loss
    assert d.text() == (
        f"loss 0x{d.first.loss} ({bits_value(d.first.loss)!r}) vs 0x{d.again.loss} ({bits_value(d.again.loss)!r}), "
        "batch equal"
    )
    lines = report_text(a).splitlines()
    assert (
        f"replayed {last - restored} step(s): {8 - restored} bitwise equal, {last - 8} diverged; diverged first at step 9: {d.text()}"
        in lines
    )
    assert f"  its batch: python -m ckpt explain {run} --step 9" in lines
    warned = [l for l in (tmp_path / "err").read_text().splitlines() if "replay diverged" in l]
    assert warned == [
        f"replay diverged at step 9: {d.text()} (attempt {d.attempt} against {d.first_attempt}); its batch: "
        f"python -m ckpt explain {run} --step 9"
    ]
    out = subprocess.run(
        [sys.executable, "-m", "ckpt", "explain", str(run), "--step", "9"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0 and f"batch hash {logged[9]}\n" in out.stdout, out.stderr


def test_preemption_right_after_an_interval_save_does_not_save_twice(tmp_path, caplog):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(Preempted) as raised, caplog.at_level("WARNING", logger="integrations"):
        with TrainLoop(str(tmp_path), {"model": model}, every_steps=2, rng=False) as loop:
            for step in loop.steps(10):
                if step == 4:
                    os.kill(os.getpid(), signal.SIGUSR1)
                loop.on_step_end(step)
    assert (raised.value.code, raised.value.step) == (128 + signal.SIGUSR1, 4)
    assert loop.manager.steps() == [2, 4]
    (said,) = [r.getMessage() for r in caplog.records if r.name == "integrations"]
    assert re.fullmatch(
        r"SIGUSR1 received: checkpoint of step 4 committed in \d+\.\d{3} s; exiting with status 138", said
    )
    (ledger,) = read_ledgers(str(tmp_path))
    assert [r["status"] for r in ledger.records if r["k"] == "end"] == ["preempted"]


def test_signal_handlers_are_restored_and_a_restart_resumes(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    state = {"model": torch.nn.Linear(2, 2)}
    with TrainLoop(str(tmp_path), state, every_steps=3) as loop:
        assert signal.getsignal(signal.SIGTERM) == loop.preemption.handle
        for step in loop.steps(7):
            assert loop.on_step_end(step) == (step in (3, 6, 7))  # and the last step
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    with TrainLoop(str(tmp_path), state, every_steps=3) as loop:
        assert loop.start_step == 7
        assert [step for step in loop.steps(8) if loop.on_step_end(step)] == [8]
        assert 0 < loop.ettr() < 1


def test_a_planned_end_saves_the_last_step_whatever_the_interval(tmp_path):
    """47 steps with a save every 5: the newest checkpoint is 47, not 45, and a restart has nothing left to do."""
    w = torch.zeros(2)
    with TrainLoop(str(tmp_path), {"w": w}, every_steps=5, rng=False) as loop:
        for step in loop.steps(47):
            w += 1
            loop.on_step_end(step, {"loss": 1.0 / step})
    assert layout.committed_steps(open_storage(tmp_path)) == [*range(5, 46, 5), 47]
    assert layout.saved_metadata(open_storage(tmp_path), 47) == {"loss": 1.0 / 47}  # the last step's metrics
    again = torch.zeros(2)
    with TrainLoop(str(tmp_path), {"w": again}, every_steps=5, rng=False) as loop:
        assert loop.start_step == 47 and list(loop.steps(47)) == [] and torch.equal(again, w)


def test_a_clean_exit_saves_the_last_ended_step_but_never_a_half_done_one(tmp_path):
    """A `break` after a step's on_step_end saves that step at exit; one before it saves nothing and says so."""
    with TrainLoop(str(tmp_path / "a"), {"w": torch.zeros(2)}, every_steps=5, rng=False) as loop:
        for step in loop.steps(100):
            loop.on_step_end(step)
            if step == 12:
                break
    assert layout.committed_steps(open_storage(tmp_path / "a")) == [5, 10, 12]
    with pytest.warns(RuntimeWarning, match=r"step 13 was begun but never ended .* resumes after step 10"):
        with TrainLoop(str(tmp_path / "b"), {"w": torch.zeros(2)}, every_steps=5, rng=False) as loop:
            for step in loop.steps(100):
                if step == 13:
                    break
                loop.on_step_end(step)
    assert layout.committed_steps(open_storage(tmp_path / "b")) == [5, 10]


def test_advise_replaces_the_interval_after_the_first_save(tmp_path):
    with TrainLoop(str(tmp_path), {"w": torch.zeros(3)}, every_steps=2, advise=True, mttf_s=3600.0) as loop:
        for step in loop.steps(2):
            loop.on_step_end(step)
        assert isinstance(loop.decision.current, EveryNSeconds) and loop.decision.current.seconds > 0


def test_advise_reads_the_ledgers_where_the_given_tracker_keeps_them(tmp_path):
    """With a tracker on another root, advise=True fitted the loop root's ledgers, where there were none: the
    interval never moved from every_steps, and nothing said so."""
    tracker = GoodputTracker(str(tmp_path / "goodput"))
    root = str(tmp_path / "ckpt")
    with TrainLoop(root, {"w": torch.zeros(3)}, every_steps=2, advise=True, mttf_s=3600.0, tracker=tracker) as loop:
        for step in loop.steps(2):
            loop.on_step_end(step)
        assert isinstance(loop.decision.current, EveryNSeconds) and loop.decision.current.seconds > 0


def test_an_advised_loop_reads_an_ended_attempts_ledger_once_and_advises_as_from_scratch(tmp_path):
    """advise=True refits from the job's ledgers after every save: it re-read and re-attributed every attempt's
    ledger each time, a stall that grew with the job (5.6 s per save at 100 attempts x 3,000 steps). The ledger of
    an attempt that ended is read once now, at the start: replaced by garbage after it, the advice is still the one
    `ettr.advise` fits from scratch to the ledgers as they were, and no warning says they cannot be read."""
    root = str(tmp_path)
    with TrainLoop(root, {"w": torch.zeros(3)}, every_steps=2, rng=False) as loop:  # the first attempt ends
        for step in loop.steps(4):
            loop.on_step_end(step)
    (first,) = (tmp_path / "ettr").iterdir()
    ended = first.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "the goodput ledgers cannot be read" would raise
        with TrainLoop(root, {"w": torch.zeros(3)}, every_steps=2, advise=True, mttf_s=3600.0, rng=False) as loop:
            first.write_text("not a\nledger\n")
            for step in loop.steps(10):
                loop.on_step_end(step)
            advised = loop.decision.interval_s()  # the advisor's answer now, as after the last save
            first.write_bytes(ended)
            scratch = advise(attribute_root(root), mttf_s=3600.0).recommended_interval_s
    assert advised is not None and advised == scratch
    assert isinstance(loop.decision.current, EveryNSeconds)


def test_a_save_decision_object_drives_the_loop(tmp_path):
    with TrainLoop(str(tmp_path), {"w": torch.zeros(2)}, decision=EveryNSteps(3), rng=False) as loop:
        saved = [step for step in loop.steps(8) if loop.on_step_end(step)]
    assert saved == [3, 6, 8] and loop.manager.steps() == [3, 6, 8]  # 8: the last step
    with pytest.raises(ValueError, match="not both"):
        TrainLoop(str(tmp_path), {}, decision=EveryNSteps(3), every_steps=2)


def test_after_its_first_step_a_fresh_loop_reserves_staging_for_the_optimizers_state_too(tmp_path):
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    with TrainLoop(str(tmp_path), {"model": model, "optim": optim}, every_steps=5, rng=False) as loop:
        for step in loop.steps(1):
            model(torch.randn(4, 64)).sum().backward()
            optim.step()
            loop.on_step_end(step)
        loop.manager.wait()  # the reservation runs on the writer thread
        params = sum(p.nbytes for p in model.parameters())
        assert loop.manager._background.arena.capacity >= 3 * params  # parameters, exp_avg and exp_avg_sq


def test_the_loop_copies_the_whole_state_inside_a_save_unless_overlap_is_asked_for(tmp_path):
    """The loop cannot tell what the user's code writes between a save and the next optimizer step (weight
    clipping through .data here): its saves use the manager's default, the exact `snapshot="sync"`."""
    import copy

    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    with TrainLoop(str(tmp_path / "a"), {"model": model, "optim": optim}, every_steps=1, rng=False) as loop:
        assert loop.manager.snapshot == "sync"
        for step in loop.steps(1):
            model(torch.randn(4, 64)).sum().backward()
            optim.step()
            at_save = copy.deepcopy(model.state_dict())
            assert loop.on_step_end(step)
            model.weight.data.clamp_(-0.01, 0.01)  # right after the save, before any wait
            loop.wait_for_staging()  # nothing left to copy: returns at once
    fresh = torch.nn.Linear(64, 64)
    state = {"model": fresh, "optim": torch.optim.Adam(fresh.parameters())}
    with TrainLoop(str(tmp_path / "a"), state, every_steps=1, rng=False) as loop:
        assert loop.start_step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_save.items())
    with TrainLoop(str(tmp_path / "b"), {}, every_steps=1, snapshot="overlap") as loop:
        assert loop.manager.snapshot == "overlap"  # the opt-in, through the manager's options
    with pytest.warns(DeprecationWarning, match="snapshot='overlap'"):
        loop = TrainLoop(str(tmp_path / "c"), {}, every_steps=1, overlap=True)
    with loop:
        assert loop.manager.snapshot == "overlap"


@pytest.mark.parametrize(
    "kw, error, message",
    [
        ({"rng": "yes"}, TypeError, "rng must be True, False or a ckpt.RNGState"),  # saved as the string 'yes'
        ({"sampler": [1, 2]}, TypeError, "sampler must be checkpointable"),  # saved as a JSON list
        ({"signals": [signal.SIGKILL]}, ValueError, "is not a signal a handler can catch"),  # OSError at enter
        ({"signals": ["SIGTERM"]}, ValueError, "is not a signal a handler can catch"),
        ({"signals": signal.SIGTERM}, TypeError, "signals must be a list of signals, e.g. \\[signal.SIGTERM\\]"),
        ({"signals": "SIGTERM"}, TypeError, "signals must be a list of signals"),  # its letters, one by one
        ({"mttf_s": -5}, ValueError, "mttf_s must be a finite positive number"),  # after the root was made
        ({"tracker": "x"}, TypeError, "tracker must be an unstarted ettr.GoodputTracker"),
        ({"advise": "no"}, TypeError, "advise must be True or False, got 'no'"),  # an advised interval
        ({"overlap": "no"}, TypeError, "overlap must be True or False, got 'no'"),  # snapshot='overlap'
        ({"every_steps": None, "decision": "x"}, TypeError, "decision must be a ckpt.SaveDecision"),  # at step 1
    ],
)
def test_bad_arguments_are_refused_at_construction_and_make_nothing(tmp_path, kw, error, message):
    root = tmp_path / "ck"
    with pytest.raises(error, match=message):
        TrainLoop(str(root), {"w": torch.zeros(1)}, **{"every_steps": 1, **kw})
    with pytest.raises(TypeError, match="root must be a path or URL, got None"):  # a folder named 'None'
        TrainLoop(None, {"w": torch.zeros(1)}, every_steps=1)
    assert not root.exists()


def test_misuse_fails_loudly(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        TrainLoop(str(tmp_path), {"rng": 1}, every_steps=1)
    with pytest.raises(ValueError, match="every_steps or every_seconds"):
        TrainLoop(str(tmp_path), {})
    with TrainLoop(str(tmp_path), {"w": torch.zeros(1)}, every_steps=1) as loop:
        with pytest.raises(RuntimeError, match="without step_begin"):
            loop.on_step_end(1)
        loop.step_begin(1)
        with pytest.raises(RuntimeError, match="never ended"):
            loop.step_begin(2)
        loop.on_step_end(1)


def test_a_step_that_ends_with_the_sampler_behind_fails_before_its_save(tmp_path):
    """A loop over the loader without sampler.track saved the sampler's position of step 0 at every save: a resume
    replayed the data from the start, and explain named batches that were not trained. It fails at that step's end,
    before any save."""
    sampler = ShuffledSampler(64, 8, seed=1)
    with TrainLoop(str(tmp_path / "untracked"), {"w": torch.zeros(1)}, sampler=sampler, every_steps=1) as loop:
        loop.step_begin(1)
        with pytest.raises(RuntimeError, match="step 1 ended with the sampler at step 0: iterate sampler.track"):
            loop.on_step_end(1)
        assert loop.manager.steps() == []
    sampler = ShuffledSampler(64, 8, seed=1)
    with TrainLoop(str(tmp_path / "tracked"), {"w": torch.zeros(1)}, sampler=sampler, every_steps=1) as loop:
        for step, _ in zip(loop.steps(2), sampler.track(iter(sampler))):
            loop.on_step_end(step)
        loop.manager.wait()
        assert loop.manager.steps() == [1, 2]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="training child of the plain-loop tests")
    parser.add_argument("root")
    parser.add_argument("tokens")
    parser.add_argument("every", type=int)
    parser.add_argument("--local", help="a local tier: two tiers")
    args = parser.parse_args()
    train(args.root, args.tokens, args.every, args.local)
    gc.freeze()  # the child ends here: no final collections over torch's objects (~0.8 s a child)


def test_a_second_loop_on_a_live_root_fails_at_its_start_and_leaves_the_ledger_alone(tmp_path):
    """A second TrainLoop on a root another live loop writes restored that loop's newest step, trained a whole
    interval and failed only at its first save (LeaseHeldError), its attempt recorded as a failure among the first
    job's. The loop is a writer: it takes the root's lease on entry, before its ledger, signal handlers or restore."""
    from ckpt import LeaseHeldError

    root = str(tmp_path)
    with TrainLoop(root, {"w": torch.zeros(2)}, every_steps=2, rng=False) as first:
        for step in first.steps(2):
            first.on_step_end(step)
        second = TrainLoop(root, {"w": torch.zeros(2)}, every_steps=100, rng=False)
        before = signal.getsignal(signal.SIGTERM)
        with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
            with second:
                pytest.fail("the second loop entered")
        assert signal.getsignal(signal.SIGTERM) == before
        assert [ledger.attempt for ledger in read_ledgers(root)] == [first.tracker.attempt_id]
    assert layout.committed_steps(open_storage(root)) == [2]
    with TrainLoop(root, {"w": torch.zeros(2)}, every_steps=100, rng=False) as after:  # once the first is done
        assert after.start_step == 2


def test_step_numbers_only_go_up_so_no_step_is_left_unsaved(tmp_path):
    """A counter that restarts each epoch (steps 1..10, then 1..10 again) saved nothing in the second epoch, and a
    restart resumed from the first epoch's end without a word; a second `steps()` began again at start_step + 1 and
    so refused to save its steps. A step begun at or below the last ended (or restored) one is refused, naming both,
    and `steps()` goes on after the last ended one."""
    with TrainLoop(str(tmp_path / "a"), {"w": torch.zeros(2)}, every_steps=5, rng=False) as loop:
        for step in range(1, 11):
            loop.step_begin(step)
            loop.on_step_end(step)
        with pytest.raises(ValueError, match=r"step_begin\(1\) after step 10: step numbers only go up"):
            loop.step_begin(1)
        with pytest.raises(ValueError, match=r"step_begin\(10\) after step 10"):
            loop.step_begin(10)
        loop.step_begin(11)  # the refusals left no step open
        loop.on_step_end(11)
    with TrainLoop(str(tmp_path / "a"), {"w": torch.zeros(2)}, every_steps=5, rng=False) as loop:
        with pytest.raises(ValueError, match=r"step_begin\(11\) after step 11 \(restored\)"):
            loop.step_begin(11)
    with TrainLoop(str(tmp_path / "b"), {"w": torch.zeros(2)}, every_steps=5, rng=False) as loop:
        with pytest.raises(ValueError, match=r"step_begin\(0\) after step 0: .*from 1"):
            loop.step_begin(0)
        assert [s for s in loop.steps(4) if loop.on_step_end(s) or True] == [1, 2, 3, 4]
        phase_two = []
        for step in loop.steps(7):  # a second phase goes on after step 4
            phase_two.append(step)
            loop.on_step_end(step)
    assert phase_two == [5, 6, 7] and layout.committed_steps(open_storage(tmp_path / "b")) == [4, 7]


def test_an_advised_loop_trains_on_when_an_earlier_attempts_ledger_is_damaged(tmp_path):
    """advise=True refits from the ledgers at the start and after every save: one bad line in an earlier attempt's
    ledger raised LedgerError out of TrainLoop.__enter__, and the job could not start again. Now the interval given
    stays, with a warning naming the file and line, as the tracker's telemetry already did."""
    root = str(tmp_path)
    with TrainLoop(root, {"w": torch.zeros(3)}, every_steps=2, advise=True, rng=False) as loop:
        for step in loop.steps(4):
            loop.on_step_end(step)
    (ledger,) = (tmp_path / "ettr").iterdir()
    lines = ledger.read_text().splitlines(keepends=True)
    ledger.write_text("".join([*lines[:2], "not a record\n", *lines[2:]]))
    with pytest.warns(RuntimeWarning, match=re.escape(f"{ledger}:3: not a JSON record")):
        with TrainLoop(root, {"w": torch.zeros(3)}, every_steps=2, advise=True, rng=False) as loop:
            assert loop.start_step == 4
            for step in loop.steps(8):
                loop.on_step_end(step)
    assert isinstance(loop.decision.current, EveryNSteps)  # the interval given stays
    assert layout.committed_steps(open_storage(root)) == [2, 4, 6, 8]


def test_a_loop_is_entered_once_and_a_refused_entry_leaves_the_root_free(tmp_path):
    """A nested `with loop:` replaced the live loop's manager with a new one: the outer loop lost its lease holder
    and failed its final save ("CheckpointManager is closed"); a second `with` after the first, or a tracker started
    already, failed in tracker.start() after the lease was taken, and that lease stayed held: the next loop of the
    process got LeaseHeldError naming its own pid. Now both are refused before the root is touched."""
    root = str(tmp_path)
    loop = TrainLoop(root, {"w": torch.zeros(2)}, every_steps=2, rng=False)
    with loop:
        for step in loop.steps(3):
            loop.on_step_end(step)
        with pytest.raises(RuntimeError, match="entered already .* make a new TrainLoop"):
            with loop:
                pytest.fail("entered twice")
        for step in loop.steps(5):  # the outer loop goes on
            loop.on_step_end(step)
    with pytest.raises(RuntimeError, match="entered already"):
        with loop:
            pytest.fail("entered after its exit")
    started = GoodputTracker(root).start()
    with pytest.raises(RuntimeError, match="start\\(\\) called twice"):
        with TrainLoop(root, {"w": torch.zeros(2)}, every_steps=2, rng=False, tracker=started):
            pytest.fail("entered with a started tracker")
    started.end()
    with TrainLoop(root, {"w": torch.zeros(2)}, every_steps=2, rng=False) as after:  # the root is free
        assert after.start_step == 5
    assert layout.committed_steps(open_storage(root)) == [2, 3, 5]


@pytest.mark.parametrize("last", [4, 5])
def test_a_final_save_that_fails_at_exit_ends_the_attempt_as_an_error_and_frees_the_root(tmp_path, last):
    """Step 4's write fails (a file is where its directory goes). Ended at 4, the exit's drain raised the write
    error, yet the ledger said `ok` (no failure in the report); ended at 5, the exit's save of 5 raised it and the
    manager was never closed: the root's lease stayed held, and the next loop of the process got LeaseHeldError. Now
    the attempt ends `error` and the root is free: the next loop resumes from step 2."""
    from ckpt import CheckpointWriteError

    root = str(tmp_path)
    with pytest.raises(CheckpointWriteError, match="saving step 4 failed"):
        with TrainLoop(root, {"w": torch.zeros(2)}, every_steps=2, rng=False) as loop:
            for step in loop.steps(100):
                if step == 3:
                    (tmp_path / "step_00000004").write_text("in the way")
                loop.on_step_end(step)
                if step == last:
                    break
    (ledger,) = read_ledgers(root)
    assert [r["status"] for r in ledger.records if r["k"] == "end"] == ["error"]
    (tmp_path / "step_00000004").unlink()
    with TrainLoop(root, {"w": torch.zeros(2)}, every_steps=2, rng=False) as after:
        assert after.start_step == 2
    assert attribute_root(root).failures == 1


def test_the_step_and_save_calls_outside_the_with_block_say_so(tmp_path):
    """Before the `with` block loop.save(1) failed "AttributeError: 'NoneType' object has no attribute 'save'" and
    step_begin with the tracker's "GoodputTracker records nothing before start()"; after it, step_begin failed "the
    ledger is closed" and save "CheckpointManager is closed": none named the loop or the block. Each now says it."""
    loop = TrainLoop(str(tmp_path), {"w": torch.zeros(1)}, every_steps=1, rng=False)
    for call in (lambda: loop.step_begin(1), lambda: loop.save(1), loop.save_last):
        with pytest.raises(RuntimeError, match="on a TrainLoop of .* before it is entered: call it inside `with"):
            call()
    with loop:
        for step in loop.steps(2):
            loop.on_step_end(step)
    for call in (lambda: loop.step_begin(3), lambda: loop.save(3)):
        with pytest.raises(RuntimeError, match=r"loop\.(step_begin|save)\(3\) on .* after its `with` block ended"):
            call()
    assert layout.committed_steps(open_storage(tmp_path)) == [1, 2]


def test_a_wrong_type_to_steps_or_on_step_end_names_the_argument(tmp_path):
    """loop.steps("10") failed 'can only concatenate str (not "int") to str' (range's), steps(True) trained one
    step, and on_step_end(s, [("loss", 1.0)]) "'list' object has no attribute 'get'": none named the argument. Each
    is refused naming it; a refused metrics leaves the step open, so the loop goes on."""
    with TrainLoop(str(tmp_path), {"w": torch.zeros(1)}, every_steps=2, rng=False) as loop:
        for total in ("10", 10.0, True, None):
            with pytest.raises(TypeError, match=r"loop\.steps\(total\): total must be an int"):
                next(loop.steps(total))
        for step in loop.steps(2):
            with pytest.raises(TypeError, match=rf"on_step_end\({step}, metrics\): metrics must map a name"):
                loop.on_step_end(step, [("loss", 1.0)])
            loop.on_step_end(step, {"loss": 1.0})
    assert layout.committed_steps(open_storage(tmp_path)) == [2]


def test_a_step_number_that_is_not_an_int_is_refused_at_its_begin(tmp_path):
    """Steps from np.arange passed step_begin (the tracker takes a numpy integer) and skipped its check that step
    numbers go up; four steps trained, then the save of step 5 failed "step must be a non-negative int below 2**63,
    got np.int64(5)" (the interval's compute lost). A step that is not an int is refused at its begin."""
    with TrainLoop(str(tmp_path), {"w": torch.zeros(1)}, every_steps=5, rng=False) as loop:
        for step in (np.int64(1), torch.tensor(1), 1.0, True):
            with pytest.raises(TypeError, match=r"step_begin\(.*\): step must be an int, got \w+; pass int\(step\)"):
                loop.step_begin(step)
        for step in np.arange(1, 6):
            loop.step_begin(int(step))
            loop.on_step_end(int(step))
    assert layout.committed_steps(open_storage(tmp_path)) == [5]


def test_a_loop_entered_outside_the_main_thread_is_refused_before_its_ledger_begins(tmp_path):
    """Entered in another thread, the loop failed "signal only works in main thread of the main interpreter" after
    its ledger began: the job's report counted a failed attempt that trained nothing, and the message did not say
    what to do. It is refused before the root is touched, naming signals=[]; with that the loop runs there."""
    import threading

    outcome: list[BaseException | list[int]] = []

    def train(**kw) -> None:
        try:
            with TrainLoop(str(tmp_path), {"w": torch.zeros(1)}, every_steps=2, rng=False, **kw) as loop:
                for step in loop.steps(2):
                    loop.on_step_end(step)
            outcome.append(loop.manager.steps())
        except BaseException as e:
            outcome.append(e)

    for kw in ({}, {"signals": []}):
        worker = threading.Thread(target=train, kwargs=kw)
        worker.start()
        worker.join()
    refused, trained = outcome
    assert isinstance(refused, RuntimeError) and "pass signals=[]" in str(refused) and trained == [2]
    a = attribute_root(str(tmp_path))
    assert [at.status for at in a.attempts] == ["ok"] and a.failures == 0


def test_a_save_named_by_another_step_than_the_states_is_refused(tmp_path):
    """loop.save(3) after step 2 ended (an off-by-one) wrote step 2's state as step 3, and step 3's own save was
    then skipped as done: the restart resumed at step 3 with step 2's weights, in silence. A save of a step other
    than the last ended one (or the one open) is refused; saving the open step or the ended one still works."""
    w = torch.zeros(1)
    with TrainLoop(str(tmp_path), {"w": w}, every_steps=100, rng=False) as loop:
        for step in loop.steps(4):
            w += 1
            if step == 2:
                with pytest.raises(ValueError, match=r"loop\.save\(3\): the state is that of step 1, step 2 open"):
                    loop.save(3)
                assert loop.save(2)  # the open step, after its update
            loop.on_step_end(step)
            if step == 3:
                with pytest.raises(ValueError, match=r"loop\.save\(1\): the state is that of step 3;"):
                    loop.save(1)
                assert loop.save(3)
    again = torch.zeros(1)
    with TrainLoop(str(tmp_path), {"w": again}, every_steps=100, rng=False) as loop:
        assert loop.start_step == 4 and again.item() == 4.0
    assert layout.committed_steps(open_storage(tmp_path)) == [2, 3, 4]
