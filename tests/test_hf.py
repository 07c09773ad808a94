"""Transformers: CkptTrainer.train on a tiny local GPT-2 is SIGKILLed, resumed with resume_from_checkpoint=True,
and ends bitwise equal to an uninterrupted run; checkpoint-N folders follow HF's rotation and load with
from_pretrained; goodput is reported. A fresh train() into another run's output dir is refused before anything is
touched, a restart of the same run resumes, load_best_model_at_end works, a stock Trainer's folder resumes."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))

from transformers import TrainerCallback  # noqa: E402

from ettr import attribute_root  # noqa: E402
from ettr.replay import bits_value  # noqa: E402
from kill_resume import (  # noqa: E402
    assert_replayed,
    assert_reported,
    assert_same_bits,
    finish,
    hung,
    losses,
    start,
    straight_killed_resumed,
)

CHILD = Path(__file__).parent / "procs" / "hf_train.py"
STEPS, KILL_AT = 16, 10  # the child saves every 4 steps (save_total_limit=2): the resume is from step 8


def test_sigkill_resume_without_launcher_ids_is_bitwise_and_reported(tmp_path):
    """The children run with no CKPT_RUN_ID, SLURM_JOB_ID or TORCHELASTIC_RUN_ID: the restart resumes through
    train(resume_from_checkpoint=True) alone (a run of its own, which takes the root over)."""
    runs = straight_killed_resumed(CHILD, tmp_path, STEPS, KILL_AT, ckpt_root="ckpt")
    assert runs.killed_run.source == runs.resumed_run.source == "generated", (runs.killed_run, runs.resumed_run)
    assert runs.killed_run.id != runs.resumed_run.id

    # 10 batches per epoch: the resume skips 8 batches of epoch 0, then crosses into epoch 1, all bit-exact
    reference = losses(runs.straight)
    assert losses(runs.killed) == {s: reference[s] for s in range(1, KILL_AT + 1)}
    assert losses(runs.resumed) == {s: reference[s] for s in range(9, STEPS + 1)}
    assert_same_bits(runs.straight_npz, runs.resumed_npz)

    # HF's names and rotation are kept; the manager's steps follow the folders; no pickled files are written
    job = tmp_path / "job"
    assert sorted(p.name for p in job.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-16"]
    assert sorted(p.name for p in (job / "ckpt").glob("step_*")) == ["step_00000012", "step_00000016"]
    assert sorted(p.name for p in (job / "checkpoint-16").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "trainer_state.json",
    ]
    assert json.loads((job / "checkpoint-16" / "trainer_state.json").read_text())["global_step"] == 16
    assert not list(job.rglob("*.pth")) and not list(job.rglob("*.bin")) and not list(job.rglob("*.pt"))
    # the folder is HF-native: from_pretrained loads the final weights of the resumed run
    from transformers import GPT2LMHeadModel

    final = np.load(runs.resumed_npz)
    loaded = GPT2LMHeadModel.from_pretrained(job / "checkpoint-16").state_dict()
    assert sorted(loaded) == sorted(final.files)
    assert all(loaded[k].numpy().tobytes() == final[k].tobytes() for k in final.files)

    assert_reported(job / "ckpt", restored=8, lost_steps=KILL_AT - 8)
    # HangAt runs before the goodput callback: step 10 never ended in the killed attempt; step 9 is the one replayed
    assert_replayed(job / "ckpt", runs.resumed, restored=8, killed_at=KILL_AT - 1)


def test_a_loss_that_differs_after_the_resume_is_reported_at_its_step(tmp_path):
    """Killed after step 10 (9 ended), resumed from 8 with step 9's loss nudged: step 9 diverges, no batch hash."""
    job = tmp_path / "job"
    killed = start(CHILD, job, tmp_path / "unused.npz", STEPS, hang_at=KILL_AT)
    assert hung(finish(killed))
    resumed = start(CHILD, job, tmp_path / "resumed.npz", STEPS, env={"PERTURB_STEP": "9"})
    assert ["done"] in finish(resumed) and resumed.returncode == 0
    r = attribute_root(str(job / "ckpt")).replay
    assert (r.replayed, r.equal, r.diverged, r.first_divergence.step) == (1, 0, 1, 9)
    d = r.first_divergence
    assert d.first.batch is None and d.text() == (
        f"loss 0x{d.first.loss} ({bits_value(d.first.loss)!r}) vs 0x{d.again.loss} ({bits_value(d.again.loss)!r})"
    )


def test_checkpoint_step_names(tmp_path):
    from integrations.hf import checkpoint_step

    assert checkpoint_step(tmp_path / "checkpoint-12") == 12
    with pytest.raises(ValueError, match="not a checkpoint-N folder"):
        checkpoint_step(tmp_path / "step_12")


class StepLog(TrainerCallback):
    """The optimizer steps a train() call ran."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def _trainer(out: Path, steps: int, stock: bool = False, args: dict | None = None, cls: type | None = None, **options):
    """A tiny GPT-2 (1 layer, dropout) trainer saving every 2 steps, keeping 2 folders (a CkptTrainer, or `cls`)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from integrations.hf import CkptTrainer

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": x, "labels": x} for x in ids]
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8))
    targs = TrainingArguments(
        **{
            **dict(
                output_dir=str(out),
                max_steps=steps,
                per_device_train_batch_size=4,
                save_steps=2,
                save_total_limit=2,
                learning_rate=1e-3,
                use_cpu=True,
                report_to=[],
                disable_tqdm=True,
                dataloader_num_workers=0,
                logging_steps=1,
                seed=0,
            ),
            **(args or {}),
        }
    )
    log = StepLog()
    if stock:
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[log], **options)
    else:
        trainer = (cls or CkptTrainer)(model=model, args=targs, train_dataset=data, callbacks=[log], **options)
    trainer.step_log = log
    return trainer


def test_a_save_decision_asks_for_saves_besides_save_steps(tmp_path):
    import ckpt

    out = tmp_path / "out"
    trainer = _trainer(out, 7, args={"save_strategy": "no"}, save_decision=ckpt.EveryNSteps(3))
    trainer.train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [3, 6]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _weights(model) -> dict[str, bytes]:
    return {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}


@pytest.fixture
def no_launcher_ids(monkeypatch):
    from ckpt.run import ENV_IDS

    for var in ENV_IDS + ("TORCHELASTIC_RESTART_COUNT",):
        monkeypatch.delenv(var, raising=False)


def test_fresh_train_into_a_used_output_dir_fails_before_touching_it(tmp_path, no_launcher_ids):
    import ckpt
    from ettr import attribute_root

    out = tmp_path / "out"
    _trainer(out, 4).train()
    before = _tree(out)
    with pytest.raises(
        ckpt.RunMismatchError,
        match=r"committed steps \[2, 4\].*resume_from_checkpoint=True.*"
        r"overwrite=True",
    ):
        _trainer(out, 6).train()
    assert _tree(out) == before, "no folder rotated, no step deleted, no ledger of the refused attempt"

    resumed = _trainer(out, 6)
    resumed.train(resume_from_checkpoint=True)  # the explicit resume takes the run over
    assert resumed.step_log.steps == [5, 6]
    assert len(attribute_root(str(out / "ckpt")).attempts) == 2

    # overwrite=True never deletes the run of a live writer of the root (here another manager of this process)
    before = _tree(out)
    with ckpt.CheckpointManager(out / "ckpt") as live:
        live.hold_lease()
        with pytest.raises(ckpt.LeaseHeldError, match=f"pid {os.getpid()}"):
            _trainer(out, 2, overwrite=True).train()
    unleased = lambda tree: {k: v for k, v in tree.items() if k != "ckpt/_LEASE"}  # noqa: E731 - the live one's
    assert unleased(_tree(out)) == unleased(before), "no step, folder or ledger of the live writer's run deleted"
    with pytest.warns(UserWarning, match=r"overwrite=True: deleted the earlier run .*steps \[4, 6\]"):
        _trainer(out, 2, overwrite=True).train()  # starts over: the old run is gone, its goodput history too
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [2]
    assert len(attribute_root(str(out / "ckpt")).attempts) == 1


def test_a_restart_of_the_same_run_resumes_silently(tmp_path, no_launcher_ids, monkeypatch):
    import ckpt

    out = tmp_path / "out"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-1")  # torchrun's first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _trainer(out, 4).train()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarts the same command
    again = _trainer(out, 6)
    again.train()
    assert again.step_log.steps == [5, 6]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-2")  # another torchrun job into the same directory
    with pytest.raises(ckpt.RunMismatchError, match="run 'rdzv-1'.*run 'rdzv-2'"):
        _trainer(out, 8).train()


def test_checkpoint_folders_load_with_from_pretrained(tmp_path):
    from transformers import GPT2LMHeadModel

    import ckpt

    out = tmp_path / "out"
    _trainer(out, 4).train()
    manager = ckpt.CheckpointManager(out / "ckpt")
    for step in (2, 4):
        saved = {"model": None}
        manager.restore(saved, step=step, keys=["model"], track=False)
        loaded = GPT2LMHeadModel.from_pretrained(out / f"checkpoint-{step}").state_dict()
        assert sorted(loaded) == sorted(saved["model"])
        assert all(torch.equal(loaded[k], saved["model"][k]) for k in loaded), step
    assert not list(out.glob(".checkpoint-*")), "no temporary folder left"

    bare = tmp_path / "bare"
    _trainer(bare, 2, folder_files=False).train()
    assert sorted(p.name for p in (bare / "checkpoint-2").iterdir()) == ["trainer_state.json"]


def test_an_object_store_root_is_reached_with_the_managers_storage_options(
    tmp_path, s3_bucket, s3_server, monkeypatch, no_launcher_ids
):
    """manager_options={"storage_options": {"endpoint": ...}} without AWS_ENDPOINT_URL: the goodput ledger, the
    folder files' read-back and overwrite=True's deletion of the old ledgers went to the provider's default endpoint
    (train() failed at its start: "Could not resolve host: BUCKET.s3.us-east-1.amazonaws.com")."""
    from transformers import GPT2LMHeadModel

    import ckpt
    from ettr import attribute_root

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    out, root, options = tmp_path / "out", f"s3://{s3_bucket}/hf", {"endpoint": s3_server.endpoint, "timeout": 10}
    mine = {"ckpt_root": root, "manager_options": {"storage_options": options}}
    _trainer(out, 4, **mine).train()
    GPT2LMHeadModel.from_pretrained(out / "checkpoint-4")  # its files were read back from the store
    assert attribute_root(root, storage_options=options).committed_steps == (2, 4)

    with pytest.warns(UserWarning, match=r"overwrite=True: deleted the earlier run .*steps \[2, 4\]"):
        _trainer(out, 2, overwrite=True, **mine).train()
    assert ckpt.CheckpointManager(root, storage_options=options).steps() == [2]
    assert len(attribute_root(root, storage_options=options).attempts) == 1, "the old run's ledger was deleted"


def test_the_end_of_train_waiting_for_the_last_checkpoint_is_checkpoint_time(tmp_path):
    """train() ends by waiting for the last commit and its folder files: the ledger has that wait in a
    checkpoint_save span (ending after the last commit record), not in 'other'."""
    from ettr.ledger import read_ledgers

    out = tmp_path / "out"
    _trainer(out, 4).train()
    (ledger,) = read_ledgers(str(out / "ckpt"))
    commits = [r for r in ledger.records if r["k"] == "commit"]
    saves = [r for r in ledger.records if r["k"] == "span" and r["c"] == "checkpoint_save"]
    last_step_end = max(r["e"] for r in ledger.records if r["k"] == "step")
    assert [c["s"] for c in commits] == [2, 4]
    assert saves[-1]["b"] >= last_step_end and saves[-1]["e"] >= commits[-1]["t"], (saves[-1], commits[-1])
    assert saves[-1]["a"] == {"part": "previous_wait"}  # a wait for the last save, not a save of its own
    from ettr import attribute_root

    assert attribute_root(str(out / "ckpt")).saves == 2


def test_load_best_model_at_end(tmp_path):
    import ckpt

    out = tmp_path / "out"
    # eval loss rises here (the eval data differ): the best is the first evaluation (step 2), not the last step
    trainer = _trainer(
        out,
        6,
        args={
            "eval_strategy": "steps",
            "eval_steps": 2,
            "load_best_model_at_end": True,
            "metric_for_best_model": "eval_loss",
            "greater_is_better": False,
            "save_total_limit": 1,
            "learning_rate": 1e-2,
        },
        eval_dataset=[{"input_ids": x, "labels": x} for x in torch.arange(32).reshape(4, 8)],
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")
    best, last = {"model": None}, {"model": None}
    manager = ckpt.CheckpointManager(out / "ckpt")
    manager.restore(best, step=2, keys=["model"], track=False)
    manager.restore(last, step=6, keys=["model"], track=False)
    model = trainer.model.state_dict()
    assert all(torch.equal(model[k], best["model"][k]) for k in model)
    assert not all(torch.equal(model[k], last["model"][k]) for k in model)
    # HF keeps only the best folder at the end (save_total_limit=1); the root keeps it and its newest step
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert manager.steps() == [2, 6]


def test_resume_from_a_stock_trainer_checkpoint(tmp_path, no_launcher_ids):
    import shutil

    import ckpt

    out = tmp_path / "out"
    _trainer(out, 4, stock=True).train()  # the stock Trainer: model.safetensors, optimizer.pt, rng_state.pth...
    assert (out / "checkpoint-4" / "rng_state.pth").exists()
    shutil.copytree(out, tmp_path / "copy")
    shutil.copytree(out, tmp_path / "bare")
    before = _tree(out)
    with pytest.raises(ckpt.RunMismatchError, match=r"checkpoint folders \['checkpoint-2', 'checkpoint-4'\]"):
        _trainer(out, 6).train()  # a fresh start would rotate the stock run's folders away
    assert _tree(out) == before

    ours = _trainer(out, 6)
    ours.train(resume_from_checkpoint=True)  # the root is empty: the newest stock folder, read by HF's own code
    stock = _trainer(tmp_path / "copy", 6, stock=True)
    stock.train(resume_from_checkpoint=str(tmp_path / "copy" / "checkpoint-4"))
    assert ours.step_log.steps == stock.step_log.steps == [5, 6]
    assert _weights(ours.model) == _weights(stock.model)
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [6]  # from here on the root holds the run
    # a bare folder name is the trainer's own folder, a stock one too (it was looked up in the working directory:
    # FileNotFoundError, while a bare name of a committed step was found in output_dir)
    bare = _trainer(tmp_path / "bare", 6)
    bare.train(resume_from_checkpoint="checkpoint-4")
    assert bare.step_log.steps == [5, 6] and _weights(bare.model) == _weights(stock.model)


def test_resume_from_a_folder_whose_step_never_committed_falls_back_with_a_warning(tmp_path):
    """Killed while step 6 was written: HF had made checkpoint-6 (its trainer_state.json), the root never committed
    step 6. Resuming from that folder warns and resumes from step 4, the newest committed step before it."""
    import shutil

    out = tmp_path / "out"
    _trainer(out, 4).train()
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-6")
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    (out / "checkpoint-6" / "trainer_state.json").write_text(json.dumps({**state, "global_step": 6}))
    resumed = _trainer(out, 8)
    with pytest.warns(RuntimeWarning, match=r"checkpoint step 6 was never committed in .*resuming from step 4 instead"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert resumed.step_log.steps == [5, 6, 7, 8]
    assert json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8


def test_a_roll_back_to_an_older_stock_trainer_folder_is_refused_before_training(tmp_path, no_launcher_ids):
    """Switched from the stock Trainer at its checkpoint-4, the root then committed steps 6 and 8; a resume named the
    stock checkpoint-4 trained steps 5 and 6 and failed at the save of step 6 ("already committed"), its compute
    spent. It is refused before training, naming the steps and the way back (every committed step is newer: `ckpt
    rollback --to 4` would refuse, so deleting the root), after which the stock folder resumes."""
    import shutil

    import ckpt

    out, limit = tmp_path / "out", {"save_total_limit": None}
    _trainer(out, 4, stock=True, args=limit).train()
    _trainer(out, 8, args=limit).train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [6, 8]
    again = _trainer(out, 8, args=limit)
    with pytest.raises(
        ckpt.StepExistsError,
        match=rf"from step 4, but steps \[6, 8\] .* after step 4: to roll back, delete or move the root {re.escape(str(out / 'ckpt'))};",
    ):
        again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert again.step_log.steps == [] and ckpt.CheckpointManager(out / "ckpt").steps() == [6, 8]
    shutil.rmtree(out / "ckpt")
    again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert again.step_log.steps == [5, 6, 7, 8] and ckpt.CheckpointManager(out / "ckpt").steps() == [6, 8]


def test_a_roll_back_to_an_older_step_is_refused_before_training_until_the_newer_steps_are_removed(tmp_path):
    """resume_from_checkpoint=checkpoint-2 while steps 4 and 6 are committed trained steps 3 and 4 and then failed
    with StepExistsError: it is refused before anything is written, naming the steps and `ckpt rollback`, which
    removes them; the resume then trains from step 3 and saves steps 4 and 6 again, in the very trainer that saved them
    before the roll-back. A checkpoint-N path of another output_dir is refused too (it resumed this root's step N,
    whatever that folder held)."""
    import subprocess

    import ckpt

    out = tmp_path / "out"
    first = _trainer(out, 6, args={"save_total_limit": None})
    first.train()
    steps = lambda: {k: v for k, v in _tree(out / "ckpt").items() if k.startswith("step_")}  # noqa: E731
    before = steps()
    again = _trainer(out, 6, args={"save_total_limit": None})
    with pytest.raises(
        ckpt.StepExistsError,
        match=r"from step 2, but steps \[4, 6\] .* ckpt rollback .* --to 2; .*newest step: train\(resume_from_checkpoint=True\)$",
    ):
        again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert again.step_log.steps == [] and steps() == before
    with pytest.raises(ValueError, match=r"elsewhere/checkpoint-6 is not a folder of this trainer's output_dir"):
        again.train(resume_from_checkpoint=str(tmp_path / "elsewhere" / "checkpoint-6"))
    cli = [sys.executable, "-m", "ckpt", "rollback", str(out / "ckpt"), "--to", "2"]
    res = subprocess.run(cli, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.stdout.splitlines() == ["removed committed step 6", "removed committed step 4"], res
    # the trainer that saved steps 4 and 6 before the roll-back saves them again (it skipped them as done)
    first.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert first.step_log.steps == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [2, 4, 6]


def test_a_trainer_with_a_local_tier_writes_its_folders_and_names_the_tier_in_a_roll_back(tmp_path):
    """With manager_options local=..., the first save that was not persisted failed ("step 2 is not committed in
    .../ckpt"): the folder files were read back from the durable root only. A roll back refused names the local
    tier, and `ckpt rollback --local` then lets the resume train on."""
    import subprocess

    import ckpt

    out, local = tmp_path / "out", tmp_path / "local"
    options = dict(run_id="r1", manager_options=dict(local=str(local), keep_local=1, persist_every=2))
    _trainer(out, 6, args={"save_total_limit": None}, **options).train()
    assert (out / "checkpoint-6" / "model.safetensors").is_file()  # step 6: committed to the local tier only
    again = _trainer(out, 6, args={"save_total_limit": None}, **options)
    with pytest.raises(ckpt.StepExistsError, match=rf"ckpt rollback {out / 'ckpt'} --to 4 --local {local};"):
        again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    cli = [sys.executable, "-m", "ckpt", "rollback", str(out / "ckpt"), "--to", "4", "--local", str(local)]
    res = subprocess.run(cli, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0 and "removed committed step 6 from the local tier" in res.stdout, res
    rolled = _trainer(out, 6, args={"save_total_limit": None}, **options)
    rolled.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert rolled.step_log.steps == [5, 6]


class _StopAt(TrainerCallback):
    """Ends train() after step `at` (its checkpoint saved), as a job stopped there would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


@pytest.mark.parametrize("rng", [True, False])
def test_resume_is_bitwise_only_with_the_rng_restored(tmp_path, rng):
    """The docs' claim and its negative control: stopped after step 2 (mid-epoch) and resumed to 6, every step's loss
    equals a straight run's; without the RNG restore (dropout) the first resumed step already differs, while the
    steps before the resume match."""
    from integrations.hf import CkptTrainer

    class LossLog(CkptTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses[self.state.global_step + 1] = loss.item().hex()
            return loss

    class WithoutRngRestore(LossLog):
        def _load_rng_state(self, checkpoint):
            """The control: HF's own RNG seeding and batch skipping only."""

    runs = {}
    for name, cls, callbacks, resume in (
        ("straight", LossLog, [], None),
        ("first", LossLog, [_StopAt(2)], None),
        ("resumed", LossLog if rng else WithoutRngRestore, [], True),
    ):
        trainer = _trainer(tmp_path / ("straight" if name == "straight" else "job"), 6, cls=cls)
        for callback in callbacks:
            trainer.add_callback(callback)
        trainer.losses = {}
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = trainer
    reference = runs["straight"].losses
    assert sorted(reference) == list(range(1, 7)) and runs["first"].losses == {1: reference[1], 2: reference[2]}
    resumed = runs["resumed"].losses
    assert runs["resumed"].step_log.steps == [3, 4, 5, 6]
    if rng:
        assert resumed == {s: reference[s] for s in range(3, 7)}
        assert _weights(runs["resumed"].model) == _weights(runs["straight"].model)
    else:
        assert sorted(resumed) == [3, 4, 5, 6] and resumed[3] != reference[3]
        assert _weights(runs["resumed"].model) != _weights(runs["straight"].model)


@pytest.fixture
def failing_commits(monkeypatch):
    """fail(n): from now on the n-th commit (manifest write) of each CkptTrainer's train() fails, as if the process
    had died after HF made that save's checkpoint-N folder (its trainer_state.json) and before the step committed;
    fail(None): none fails any more."""
    import integrations.hf
    from ckpt import CheckpointManager, layout
    from ckpt.storage import open_storage
    from fault_storage import FaultStorage

    def fail(n: int | None) -> None:
        def manager(root, **options):
            manifest = lambda path: path.endswith(layout.MANIFEST)  # noqa: E731
            return CheckpointManager(FaultStorage(open_storage(str(root)), fail_path=manifest, fail_write=n), **options)

        monkeypatch.setattr(integrations.hf, "CheckpointManager", CheckpointManager if n is None else manager)

    return fail


def test_a_train_whose_first_save_never_committed_restarts_fresh(tmp_path, failing_commits):
    """The first save (step 2) never commits, leaving checkpoint-2 with only its trainer_state.json. A resume from
    that folder, and resume_from_checkpoint=True, start fresh with a warning instead of failing on every restart,
    and the end equals a straight run."""
    import ckpt

    out = tmp_path / "out"
    failing_commits(1)
    with pytest.raises(ckpt.CheckpointWriteError, match="injected fault"):
        _trainer(out, 2).train()
    assert sorted(p.name for p in (out / "checkpoint-2").iterdir()) == ["trainer_state.json"]
    assert ckpt.CheckpointManager(out / "ckpt").steps() == []

    again = _trainer(out, 2)  # its own first save never commits either
    with (
        pytest.warns(RuntimeWarning, match=r"checkpoint-2 names step 2 of .*never committed.*train\(\) starts fresh"),
        pytest.raises(ckpt.CheckpointWriteError, match="injected fault"),
    ):
        again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert again.step_log.steps == [1, 2] and ckpt.CheckpointManager(out / "ckpt").steps() == []

    failing_commits(None)
    straight = _trainer(tmp_path / "straight", 4)
    straight.train()
    with pytest.warns(RuntimeWarning, match=r"\['checkpoint-2'\], whose steps never committed.*starts fresh"):
        resumed = _trainer(out, 4)
        resumed.train(resume_from_checkpoint=True)
    assert resumed.step_log.steps == [1, 2, 3, 4]
    assert _weights(resumed.model) == _weights(straight.model)
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [2, 4]


def test_resume_true_passes_over_a_folder_whose_step_never_committed(tmp_path, failing_commits):
    """Step 2 committed, step 4's save never did (checkpoint-4 holds only trainer_state.json): True resumes step 2,
    the newest committed step. A folder that holds weights while the root has no step is not passed over."""
    import ckpt

    out = tmp_path / "out"
    failing_commits(2)
    with pytest.raises(ckpt.CheckpointWriteError, match="injected fault"):
        _trainer(out, 4).train()  # its last save is the one that fails: no later save races the error
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [2]
    assert sorted(p.name for p in (out / "checkpoint-4").iterdir()) == ["trainer_state.json"]
    failing_commits(None)
    resumed = _trainer(out, 6)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.step_log.steps == [3, 4, 5, 6]

    import shutil

    other = tmp_path / "other"
    shutil.copytree(out / "checkpoint-6", other / "checkpoint-6")  # weights and trainer_state.json, but no root
    with pytest.raises(ValueError, match=r"checkpoint-6 holds model weights but no step of .* is committed"):
        _trainer(other, 8).train(resume_from_checkpoint=True)


def test_resume_true_passes_over_a_folder_whose_step_never_committed_to_a_stock_folder(
    tmp_path, no_launcher_ids, failing_commits
):
    """Switched from the stock Trainer: resumed from its checkpoint-4, the first save of our own (step 6) never
    committed. True resumes the stock folder again, with a warning, rather than starting fresh over it."""
    import ckpt

    out = tmp_path / "out"
    _trainer(out, 4, stock=True).train()
    failing_commits(1)
    with pytest.raises(ckpt.CheckpointWriteError, match="injected fault"):
        _trainer(out, 6).train(resume_from_checkpoint=True)
    assert sorted(p.name for p in (out / "checkpoint-6").iterdir()) == ["trainer_state.json"]
    failing_commits(None)
    resumed = _trainer(out, 6)
    with pytest.warns(
        RuntimeWarning, match=r"\['checkpoint-6'\] hold no training state.*stock Trainer's .*checkpoint-4"
    ):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.step_log.steps == [5, 6] and ckpt.CheckpointManager(out / "ckpt").steps() == [6]


@pytest.mark.parametrize(
    "option, message",
    [
        ({"overwrite": "yes"}, "overwrite must be True or False, got 'yes'"),
        ({"folder_files": "no"}, "folder_files must be True or False, got 'no'"),
        ({"tracker": "x"}, "tracker must be an ettr.GoodputTracker, got 'x'"),
        ({"save_decision": "x"}, r"decision must be a ckpt.SaveDecision .* got 'x'"),
        ({"ckpt_root": 123}, "ckpt_root must be a path or URL, got 123"),
        ({"ckpt_root": ""}, "ckpt_root must be a path or URL, got ''"),
        (
            {"manager_options": "snapshot"},
            "manager_options must be a dict of CheckpointManager keywords .* got 'snapshot'",
        ),
        ({"manager_options": {"keep_lst": 3}}, r"unknown CheckpointManager option\(s\) \['keep_lst'\]"),
        ({"manager_options": {"keep_last": -1}}, "keep_last must be a positive int, got -1"),
        ({"manager_options": {"keep_last": 1}}, r"manager_options \['keep_last'\]: .* save_total_limit"),
    ],
)
def test_bad_arguments_are_refused_when_the_trainer_is_built(tmp_path, option, message):
    """They used to fail at train() (AttributeError: 'str' object has no attribute 'saved'; an empty ckpt_root), or
    not at all, or with a TypeError naming no argument (ckpt_root=123, manager_options='snapshot')."""
    with pytest.raises((TypeError, ValueError), match=message):
        _trainer(tmp_path / "out", 2, **option)


def test_a_resume_into_a_model_of_another_shape_changes_no_weight(tmp_path):
    """torch's load_state_dict copies every tensor that fits before it raises: the model was left half resumed."""
    out = tmp_path / "out"
    _trainer(out, 2).train()
    trainer = _trainer(out, 4)
    trainer.model.transformer.wpe = torch.nn.Embedding(16, 16)  # the checkpoint has 8 positions
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"nothing was loaded.*transformer.wpe.weight.*\[8, 16\].*\[16, 16\]"):
        trainer.train(resume_from_checkpoint=True)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def _freeze_wte(trainer) -> None:
    trainer.model.transformer.wte.weight.requires_grad_(False)


def _own_optimizer(trainer) -> None:
    """An optimizer as ``Trainer(optimizers=...)`` sets it: all parameters in one group, not HF's two."""
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)


@pytest.mark.parametrize(
    "change, mine",
    [(_freeze_wte, r"\[5, 10\]"), (_own_optimizer, r"\[16\]")],
    ids=["frozen-parameter", "own-optimizer"],
)
def test_a_resume_into_an_optimizer_of_other_parameter_groups_changes_no_weight(tmp_path, change, mine):
    """A parameter frozen since the save (HF's default optimizer: decay/no-decay groups of the trainable parameters),
    or an optimizer passed to the trainer, of other groups than the saved state's. torch refused it with "loaded
    state dict contains a parameter group that doesn't match", naming neither the step nor the sizes; then the
    refusal named both but came after HF had loaded the weights (it loads them before it builds the optimizer): a
    failed resume left the model resumed. The groups are known when the weights are loaded: refused before."""
    out = tmp_path / "out"
    _trainer(out, 2).train()
    trainer = _trainer(out, 4)
    change(trainer)
    before = _weights(trainer.model)
    with pytest.raises(
        ValueError,
        match=r"step 2 of .*ckpt: its optimizer state holds \[6, 10\] parameters per group, this trainer's "
        rf"optimizer {mine} \(a parameter frozen, unfrozen or added since the save\?\)\. Nothing was loaded",
    ):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.step_log.steps == []
    assert _weights(trainer.model) == before


def test_optimizer_groups_built_by_a_subclass_are_refused_once_built(tmp_path):
    """A subclass's create_optimizer builds groups that cannot be told before HF calls it, after it loaded the
    weights: refused then, naming the step and both sizes, and saying the weights were loaded."""
    from integrations.hf import CkptTrainer

    class OneGroup(CkptTrainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            return self.optimizer

    out = tmp_path / "out"
    _trainer(out, 2).train()
    trainer = _trainer(out, 4, cls=OneGroup)
    with pytest.raises(
        ValueError,
        match=r"step 2 of .*ckpt: its optimizer state holds \[6, 10\] parameters per group, this trainer's "
        r"optimizer \[16\] .*\. The model's weights were loaded already",
    ):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.step_log.steps == []


def test_a_resume_rotates_no_save_away_for_a_folder_whose_step_never_committed(tmp_path, failing_commits):
    """Step 2 committed, step 4's save never did: the dead attempt left checkpoint-4 (its trainer_state.json alone),
    older than the resume. The resumed step-4 save writes into that folder, whose time HF's rotation (by mtime,
    save_total_limit=1) took for the oldest: it deleted the save just made and train() died reading its
    trainer_state.json. The resume removes such folders first (no state, no committed step), so the run ends."""
    import ckpt

    out = tmp_path / "out"
    failing_commits(2)
    with pytest.raises(ckpt.CheckpointWriteError, match="injected fault"):
        _trainer(out, 4, args={"save_total_limit": 1}).train()
    stale = out / "checkpoint-4"
    assert sorted(p.name for p in stale.iterdir()) == ["trainer_state.json"]
    past = stale.stat().st_mtime - 60  # the attempt that died was a minute ago
    os.utime(stale, (past, past))
    failing_commits(None)
    resumed = _trainer(out, 6, args={"save_total_limit": 1})
    resumed.train(resume_from_checkpoint=True)
    assert resumed.step_log.steps == [3, 4, 5, 6]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [6]


def test_a_restart_removes_the_folder_files_a_killed_attempt_left_half_written(tmp_path):
    """SIGKILLed while the background thread wrote step 4's folder files (model.safetensors was in its temporary
    folder .checkpoint-4.* beside the checkpoint folders): each kill left a copy of the weights there for good. The
    restart removes such temporary folders, and ends with every folder complete: checkpoint-4, the step it resumes,
    held only trainer_state.json for good (from_pretrained failed on it) until its files were written from that
    step."""
    job = tmp_path / "job"
    lines = finish(start(CHILD, job, tmp_path / "killed.npz", 8, env={"HANG_IN_FILES": "4"}))
    assert hung(lines)
    left = list(job.glob(".checkpoint-4.*"))
    assert left and (left[0] / "model.safetensors").is_file()
    lines = finish(start(CHILD, job, tmp_path / "resumed.npz", 8))
    assert lines[-1] == ["done"], lines
    assert sorted(p.name for p in job.iterdir() if p.name != "ckpt") == ["checkpoint-4", "checkpoint-8"]
    for folder in ("checkpoint-4", "checkpoint-8"):
        assert sorted(p.name for p in (job / folder).iterdir()) == [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "trainer_state.json",
        ], folder


def test_a_second_trainer_on_a_live_output_dir_fails_before_it_trains_or_touches_a_folder(tmp_path):
    """A job's process is alive (it saved steps 4 and 8 and trains on); a second process runs the same command
    (train(resume_from_checkpoint=True), a duplicate submit). It resumed step 8, trained 4 steps, and its step-12
    save made checkpoint-12 and rotated the live job's checkpoint-4 away before the root's lease refused it. It now
    takes the lease at the start of train(): refused there, it trains nothing and leaves every folder as it was."""
    import signal

    job = tmp_path / "job"
    live = start(CHILD, job, tmp_path / "live.npz", 16, hang_at=10)
    for line in live.stdout:
        if line.startswith("hanging"):
            break
    try:
        before = _tree(job)
        assert sorted(p.name for p in job.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
        second = start(CHILD, job, tmp_path / "second.npz", 16)
        lines = finish(second)
        assert second.returncode != 0 and not losses(lines), lines
        # the live job's folder files were whole before it hung (a snapshot taken while its thread moved them in
        # found files in a temporary folder that were gone after): nothing it had is changed
        after = _tree(job)
        assert sorted(p.name for p in job.iterdir() if p.name != "ckpt") == ["checkpoint-4", "checkpoint-8"]
        assert all(after.get(k) == v for k, v in before.items() if not k.startswith("ckpt")), (before, after)
    finally:
        os.kill(live.pid, signal.SIGKILL)
        live.wait()


def test_a_resume_of_a_step_saved_with_save_only_model_says_the_optimizer_and_schedule_start_over(tmp_path):
    """save_only_model=True: the step holds no optimizer or LR scheduler. A resume of it went on in silence with a
    fresh optimizer and the LR schedule back at step 0 (the run no longer the one that never stopped: at the end
    the LR was 3.3e-4 where a straight run's is 0). It still resumes, with a warning naming the step and both."""
    out = tmp_path / "out"
    args = {"save_only_model": True}
    first = _trainer(out, 6, args=args)
    first.add_callback(_StopAt(2))
    first.train()
    resumed = _trainer(out, 6, args=args)
    with pytest.warns(RuntimeWarning, match=r"step 2 of .*ckpt holds no optimizer or LR scheduler state.*save_only"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.step_log.steps == [3, 4, 5, 6]


def test_a_resume_of_the_last_step_mid_epoch_trains_no_step_past_max_steps(tmp_path):
    """max_steps=6 (4 batches an epoch: step 6 is mid-epoch), saved at 3 and 6, then the same command again (a
    requeue of a run that had finished, or a kill after its last save committed). HF's loop, resuming mid-epoch,
    trained step 7 before it checked max_steps (the stock Trainer does too): checkpoint-7 written, step 7 committed,
    the weights no longer the finished run's. It trains nothing now, and saves nothing."""
    import ckpt

    out = tmp_path / "out"
    args = {"save_steps": 3}
    finished = _trainer(out, 6, args=args)
    finished.train()
    again = _trainer(out, 6, args=args)
    again.train(resume_from_checkpoint=True)
    assert again.step_log.steps == [] and again.state.global_step == 6
    assert _weights(again.model) == _weights(finished.model)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert ckpt.CheckpointManager(out / "ckpt").steps() == [3, 6]
