"""Lightning: Trainer.fit through CkptCheckpointIO + GoodputCallback is SIGKILLed, resumed from "last", and ends
bitwise equal to an uninterrupted fit; the goodput report shows the failure, the lost steps and the restore."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))

from ckpt import KeepLast, ShuffledSampler, explain, layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from ettr import attribute_root, read_ledgers  # noqa: E402
from integrations.lightning import CkptCheckpointIO, DecisionCheckpoint, GoodputCallback, saveable  # noqa: E402
from kill_resume import (  # noqa: E402
    assert_replayed,
    assert_reported,
    assert_same_bits,
    finish,
    losses,
    run_straight,
    start,
    straight_killed_resumed,
)


def committed_steps(root) -> list[int]:
    return layout.committed_steps(open_storage(str(root)))


CHILD = Path(__file__).parent / "procs" / "lightning_train.py"
STEPS, KILL_AT = 16, 10  # the child saves every 4 steps: the resume is from step 8


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[list[list[str]], Path]:
    """One uninterrupted fit to STEPS (its lines and weights file): the reference of both resume tests below, which
    would each run the same child to the same step in the same environment."""
    tmp = tmp_path_factory.mktemp("straight")
    return run_straight(CHILD, tmp / "straight", tmp / "straight.npz", STEPS), tmp / "straight.npz"


def test_sigkill_resume_without_launcher_ids_is_bitwise_and_reported(tmp_path, straight):
    """The children run with no CKPT_RUN_ID, SLURM_JOB_ID or TORCHELASTIC_RUN_ID: the restart resumes through
    fit(ckpt_path="last") alone (a run of its own, which takes the root over)."""
    runs = straight_killed_resumed(CHILD, tmp_path, STEPS, KILL_AT, ckpt_root="", straight=straight)
    assert runs.killed_run.source == runs.resumed_run.source == "generated", (runs.killed_run, runs.resumed_run)
    assert runs.killed_run.id != runs.resumed_run.id

    # the resumed attempt re-ran steps 9.. from the step-8 checkpoint with the same losses, to the same bits
    reference = losses(runs.straight)
    assert losses(runs.killed) == {s: reference[s] for s in range(1, KILL_AT + 1)}
    assert losses(runs.resumed) == {s: reference[s] for s in range(9, STEPS + 1)}
    assert_same_bits(runs.straight_npz, runs.resumed_npz)

    # pointers removed by ModelCheckpoint took their steps along; only the newest survives
    assert sorted(p.name for p in (tmp_path / "job" / "pointers").iterdir()) == ["epoch=0-step=16.ckpt", "last.ckpt"]
    assert [p.name for p in (tmp_path / "job").glob("step_*")] == ["step_00000016"]

    assert_reported(tmp_path / "job", restored=8, lost_steps=KILL_AT - 8)
    assert_replayed(tmp_path / "job", runs.resumed, restored=8, killed_at=KILL_AT)
    # each step record carries the hash of the batch the ShuffledSampler drew for it (steps from 1)
    order = ShuffledSampler(64, 8, seed=1, rank=0, world_size=1)
    records = [r for ledger in read_ledgers(str(tmp_path / "job")) for r in ledger.records if r["k"] == "step"]
    assert len(records) == KILL_AT + STEPS - 8 and all(r["h"] == order.batch_hash(r["s"]) for r in records)


def test_a_loss_that_differs_after_the_resume_is_reported_at_its_step(tmp_path):
    """Killed after step 10, resumed from 8 with step 10's loss nudged: step 9 equal, 10 diverges, batch equal."""
    job = tmp_path / "job"
    killed = start(CHILD, job, tmp_path / "unused.npz", STEPS, hang_at=KILL_AT)
    assert ["hanging"] in finish(killed)
    resumed = start(CHILD, job, tmp_path / "resumed.npz", STEPS, env={"PERTURB_STEP": str(KILL_AT)})
    assert ["done"] in finish(resumed) and resumed.returncode == 0
    r = attribute_root(str(job)).replay
    assert (r.replayed, r.equal, r.diverged, r.first_divergence.step) == (2, 1, 1, KILL_AT)
    assert (
        r.first_divergence.text().endswith(", batch equal")
        and r.first_divergence.first.loss != r.first_divergence.again.loss
    )
    assert r.first_divergence.explain == f"python -m ckpt explain {job} --step {KILL_AT}"


def pointers(root: Path) -> dict[str, int]:
    """Pointer file name -> the step it names, in ROOT/pointers."""
    return {p.name: json.loads(p.read_text())["step"] for p in sorted((root / "pointers").iterdir())}


def test_copied_run_resumes_twice_bitwise_without_duplicate_or_stale_pointers(tmp_path, straight):
    """Killed at 6 (checkpoint 4), resumed and killed at 10 (checkpoint 8), copied, resumed from the copy to 16."""
    job, copy = tmp_path / "job", tmp_path / "copy"
    (straight_lines, straight_npz), first = straight, start(CHILD, job, tmp_path / "x.npz", STEPS, 6)
    reference, _ = losses(straight_lines), finish(first)
    assert (
        pointers(job) == {"epoch=0-step=4.ckpt": 4, "last.ckpt": 4}
        and layout.committed_steps(open_storage(job))[-1] == 4
    )
    finish(start(CHILD, job, tmp_path / "x.npz", STEPS, 10))  # resumes from 4: its dict predates last.ckpt
    assert (
        pointers(job) == {"epoch=0-step=8.ckpt": 8, "last.ckpt": 8}
        and layout.committed_steps(open_storage(job))[-1] == 8
    )

    shutil.copytree(job, copy)
    before = sorted((p.relative_to(job), p.stat().st_mtime_ns) for p in job.rglob("*"))
    lines = finish(start(CHILD, copy, tmp_path / "resumed.npz", STEPS))
    assert ["done"] in lines, lines[-5:]
    assert losses(lines) == {s: reference[s] for s in range(9, STEPS + 1)}
    assert_same_bits(straight_npz, tmp_path / "resumed.npz")
    assert sorted((p.relative_to(job), p.stat().st_mtime_ns) for p in job.rglob("*")) == before  # original untouched
    assert pointers(copy) == {f"epoch=0-step={STEPS}.ckpt": STEPS, "last.ckpt": STEPS}  # no -v1, last is newest
    assert layout.committed_steps(open_storage(copy)) == [STEPS]

    # one step numbering: the checkpoint named step=16 explains each step's batch as the fit logged it
    io = CkptCheckpointIO(copy)
    saved = io.load_checkpoint(copy / "pointers" / "last.ckpt")
    io.teardown()
    (sampler,) = [state["samplers"]["train"] for state in saved["callbacks"].values() if "samplers" in state]
    batches = {int(w[1]): [int(i) for i in w[2].split(",")] for w in lines if w[0] == "batch"}
    assert sampler["step"] == STEPS and all(explain(sampler, s).indices == batches[s] for s in range(9, STEPS + 1))


def test_saveable_drops_what_needs_pickle():
    class Opaque:
        pass

    clean, dropped = saveable(
        {
            "state_dict": {"w": torch.ones(2)},
            "hyper_parameters": {
                "lr": 0.1,
                "path": Path("/x"),
                "act": Opaque(),
                "sizes": (1, 2),
                "objs": [1, Opaque()],
                3: "int key",
                (1, 2): "tuple key",
            },
        }
    )
    assert dropped == ["hyper_parameters.act", "hyper_parameters.objs", "hyper_parameters.(1, 2)"]
    assert clean["hyper_parameters"] == {"lr": 0.1, "path": "/x", "sizes": (1, 2), 3: "int key"}


def test_pointer_of_a_step_that_never_committed_falls_back(tmp_path):
    io = CkptCheckpointIO(tmp_path / "root")
    io.save_checkpoint({"global_step": 4, "w": torch.arange(3.0)}, tmp_path / "p" / "a.ckpt")
    io.teardown()
    (tmp_path / "p" / "b.ckpt").write_text(
        (tmp_path / "p" / "a.ckpt").read_text().replace('"step": 4', '"step": 8')
    )  # as if killed mid-write
    with pytest.warns(RuntimeWarning, match="step 8 was never committed"):
        loaded = io.load_checkpoint(tmp_path / "p" / "b.ckpt")
    assert loaded["global_step"] == 4 and torch.equal(loaded["w"], torch.arange(3.0))
    (tmp_path / "p" / "c.ckpt").write_bytes(b"\x80\x02not json")
    with pytest.raises(ValueError, match="not a checkpoint written by CkptCheckpointIO"):
        io.load_checkpoint(tmp_path / "p" / "c.ckpt")
    io.teardown()


def test_a_spawn_launchers_weights_handoff_is_a_file_of_its_own_not_a_step(tmp_path):
    """`strategy="ddp_spawn"` hands rank 0's trained weights to the main process through save_checkpoint,
    load_checkpoint and remove_checkpoint of a plain state dict (no global_step): that failed with KeyError
    'global_step' at the end of every such fit. Now it is a safetensors file there, which no step of the root names."""
    io = CkptCheckpointIO(tmp_path / "root")
    weights = {"net.weight": torch.randn(2, 3), "net.bias": torch.randn(2).to(torch.bfloat16), "n": torch.tensor(7)}
    handoff = tmp_path / ".temp.ckpt"
    io.save_checkpoint(weights, handoff)
    got = CkptCheckpointIO(tmp_path / "root").load_checkpoint(handoff)  # the main process's copy of the plugin
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    assert got["net.bias"].dtype == torch.bfloat16 and got["n"].shape == ()
    io.remove_checkpoint(handoff)
    assert not handoff.exists() and io.manager.steps() == []
    with pytest.raises(TypeError, match=r"holds tensors only; \['lr'\] are not"):
        io.save_checkpoint({"w": torch.zeros(1), "lr": 0.1}, handoff)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".temp")] == []  # nor its temporary file
    io.teardown()


def test_a_first_save_older_than_the_roots_newest_step_is_refused_and_the_plugin_pickles_after_it(tmp_path):
    """Under ddp_spawn a user's trainer.save_checkpoint after fit runs in the main process, whose trainer is at step 0:
    it committed step 0 after the fit's step 12 (and re-claimed the root for a new run id), and the plugin, its
    manager now open, no longer pickled, so the next validate/test/fit failed to launch. A process's first save older
    than the root's newest step is refused, and the plugin pickles without its manager."""
    import pickle

    root, folder = tmp_path / "root", tmp_path / "p"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 12, "w": torch.arange(3.0)}, folder / "last.ckpt")
    io.teardown()
    main = CkptCheckpointIO(root)  # the spawn parent's plugin
    with pytest.raises(ValueError, match=r"saving step 0 into .*, whose newest committed step is 12.*ckpt rollback"):
        main.save_checkpoint({"global_step": 0, "w": torch.zeros(3)}, folder / "manual.ckpt")
    assert main.manager.steps() == [12] and not (folder / "manual.ckpt").exists()
    copy = pickle.loads(pickle.dumps(main))  # what ddp_spawn does with the trainer for its next launch
    assert torch.equal(copy.load_checkpoint(folder / "last.ckpt")["w"], torch.arange(3.0))
    copy.save_checkpoint({"global_step": 14, "w": torch.ones(3)}, folder / "last.ckpt")
    copy.teardown()
    main.teardown()
    assert CkptCheckpointIO(root).manager.steps() == [14]  # last.ckpt names 14 now: 12 went


def test_pointers_are_relative_and_the_next_writer_drops_those_of_steps_that_never_committed(tmp_path):
    root, folder = tmp_path / "root", tmp_path / "root" / "p"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 4, "w": torch.arange(3.0)}, folder / "a.ckpt")
    io.teardown()
    assert json.loads((folder / "a.ckpt").read_text())["root"] == ".."
    for name in ("b.ckpt", "last.ckpt"):  # as if killed while step 8 was written
        (folder / name).write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": "..", "step": 8}))
    (folder / "old.ckpt").write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": str(root), "step": 4}))

    io = CkptCheckpointIO(root)  # the restarted writer
    assert io.load_checkpoint(folder / "old.ckpt")["global_step"] == 4  # absolute roots of older pointers still load
    with pytest.warns(RuntimeWarning, match="step 8 was never committed"):
        assert io.load_checkpoint(folder / "last.ckpt")["global_step"] == 4
    with pytest.warns(RuntimeWarning, match="not committed") as removed:
        io.save_checkpoint({"global_step": 5, "w": torch.zeros(3)}, folder / "c.ckpt")
    io.teardown()
    assert sorted(str(w.message).split(":")[0] for w in removed) == [
        f"removing {folder / n}" for n in ("b.ckpt", "last.ckpt")
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["a.ckpt", "c.ckpt", "old.ckpt"]


def _fit(
    root: Path,
    steps: int,
    ckpt_path: str | None = None,
    without: str | None = None,
    strategy: object = "auto",
    accelerator: str = "cpu",
    callbacks: tuple = (),
    io: CkptCheckpointIO | None = None,
    accumulate: int = 1,
    val_every: int | None = None,
    then: int | None = None,
    **io_options,
) -> dict[str, torch.Tensor]:
    """A tiny fit through CkptCheckpointIO + GoodputCallback (the child's model and data); returns its final weights.
    `callbacks` replace the ModelCheckpoint saving every 4 steps; `io` the CkptCheckpointIO(root, **io_options);
    `val_every` validates every that many steps (and in the sanity check) on a plain DataLoader, whose iterations
    draw from the global RNG; `then` fits the same Trainer again, its max_steps raised to `then` (no ckpt_path).
    Negative controls: `without="rng"` leaves the RNG
    state out of the checkpoint, `without="sampler"` leaves the sampler where it is on a resume instead of loading
    its saved position."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckpt import ShuffledSampler, make_loader
    from integrations.lightning import GoodputCallback
    from lightning_train import Net, Points

    torch.manual_seed(0)
    sampler = ShuffledSampler(64, 8, seed=1)
    no_validation = {"num_sanity_val_steps": 0, "limit_val_batches": 0}
    validation = {"val_check_interval": val_every, "check_val_every_n_epoch": None} if val_every else no_validation
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **validation,
        accumulate_grad_batches=accumulate,
        strategy=strategy,
        plugins=[io or CkptCheckpointIO(root, **io_options)],
        callbacks=[
            (_forgets_samplers() if without == "sampler" else GoodputCallback)(
                samplers={"train": sampler}, rng=without != "rng"
            ),
            *(callbacks or [ModelCheckpoint(dirpath=root / "pointers", every_n_train_steps=4, save_last=True)]),
        ],
    )
    model = Net()
    val = torch.utils.data.DataLoader(Points(), batch_size=16) if val_every else None
    trainer.fit(model, make_loader(Points(), sampler), val, ckpt_path=ckpt_path)
    if then is not None:
        trainer.fit_loop.epoch_loop.max_steps = steps = then
        trainer.fit(model, make_loader(Points(), sampler), val)
    assert trainer.global_step == steps
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_an_object_store_root_takes_its_goodput_ledger_with_the_ios_storage_options(
    tmp_path, s3_bucket, s3_server, monkeypatch
):
    """CkptCheckpointIO("s3://...", storage_options={"endpoint": ...}) without AWS_ENDPOINT_URL: the checkpoints went
    to the endpoint given, but GoodputCallback's ledger beside them was made without the options, so the fit failed
    at its start resolving the provider's default host. Now the ledger goes where the checkpoints go."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import ckpt
    from ettr import attribute_root

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    root, options = f"s3://{s3_bucket}/pl", {"endpoint": s3_server.endpoint, "timeout": 10}
    pointers = ModelCheckpoint(dirpath=tmp_path / "pointers", every_n_train_steps=4)
    _fit(tmp_path, 8, io=CkptCheckpointIO(root, storage_options=options), callbacks=(pointers,))
    assert ckpt.CheckpointManager(root, storage_options=options).steps() == [8]  # ModelCheckpoint keeps its last
    assert attribute_root(root, storage_options=options).committed_steps == (4, 8)


def test_a_goodput_callback_given_a_root_keeps_its_ledger_there(tmp_path):
    """GoodputCallback(root=...) is the ledger's root (its docstring: default, the CkptCheckpointIO's root), but the
    IO's root took precedence over it: the ledger went beside the checkpoints, and the root given stayed empty."""
    from lightning.pytorch import Trainer

    from ckpt import ShuffledSampler, make_loader
    from ettr import attribute_root
    from integrations.lightning import GoodputCallback
    from lightning_train import Net, Points

    ledgers, root = tmp_path / "ledgers", tmp_path / "ckpt"
    sampler = ShuffledSampler(64, 8, seed=1)
    trainer = Trainer(
        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path,
        plugins=[CkptCheckpointIO(root)], callbacks=[GoodputCallback(str(ledgers), samplers={"train": sampler})],
    )  # fmt: skip
    trainer.fit(Net(), make_loader(Points(), sampler))
    assert [a.steps for a in attribute_root(str(ledgers)).attempts] == [2] and not (root / "ettr").exists()


def test_decision_checkpoint_saves_on_the_decision_and_on_a_preemption_signal(tmp_path):
    import signal

    from lightning.pytorch import Callback

    import ckpt
    from integrations.lightning import DecisionCheckpoint

    class SignalDuringStep5(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)

    with ckpt.Preemption([signal.SIGUSR1]) as preemption:
        decision = ckpt.AnyOf(ckpt.EveryNSteps(3), preemption)
        checkpoint = DecisionCheckpoint(decision, dirpath=tmp_path / "pointers", every_n_epochs=0, save_top_k=-1)
        _fit(tmp_path, 7, callbacks=(SignalDuringStep5(), checkpoint))
    assert preemption.signum == signal.SIGUSR1
    # every 3 steps (3), the signal's step (5), and 3 steps after that would be 8: past the end
    assert pointers(tmp_path) == {"epoch=0-step=3.ckpt": 3, "epoch=0-step=5.ckpt": 5}
    assert committed_steps(str(tmp_path)) == [3, 5]


def test_accumulated_micro_batches_are_one_goodput_step_per_optimizer_step(tmp_path):
    """accumulate_grad_batches=3: one step record per optimizer step, numbered as the checkpoints count them, timing
    all its micro-batches, with their losses summed and their batch hashes joined by '+'."""
    _fit(tmp_path, 4, accumulate=3)
    steps = [r for ledger in read_ledgers(str(tmp_path)) for r in ledger.records if r["k"] == "step"]
    assert [r["s"] for r in steps] == [1, 2, 3, 4]
    sampler = ShuffledSampler(64, 8, seed=1)
    hashes = [sampler.batch_hash(k) for k in range(1, 13)]
    assert [r["h"] for r in steps] == ["+".join(hashes[k : k + 3]) for k in (0, 3, 6, 9)]
    assert all(len(r["l"]) == 16 for r in steps)  # the bits of the micro-batches' summed loss
    attempt = attribute_root(str(tmp_path)).attempts[0]
    assert attempt.steps == 4 and (attempt.first_step, attempt.last_step) == (1, 4)


def _forgets_samplers():
    from integrations.lightning import GoodputCallback

    class ForgetsSamplers(GoodputCallback):
        """A GoodputCallback that restores the RNG but loads each sampler's own current position, not the saved one."""

        def load_state_dict(self, state_dict):
            super().load_state_dict({**state_dict, "samplers": {n: s.state_dict() for n, s in self.samplers.items()}})

    return ForgetsSamplers


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def no_launcher_ids(monkeypatch):
    from ckpt.run import ENV_IDS

    for var in ENV_IDS:
        monkeypatch.delenv(var, raising=False)


def test_fit_without_ckpt_path_into_another_runs_root_fails_before_touching_it(tmp_path, no_launcher_ids):
    import ckpt

    root = tmp_path / "run"
    _fit(root, 8)
    before = _tree(root)
    with pytest.raises(ckpt.RunMismatchError, match=r'committed steps \[8\].*ckpt_path="last".*new root'):
        _fit(root, 12)
    assert _tree(root) == before, "nothing written (no ledger of the refused attempt either) or deleted"
    # a folder without last.ckpt (a process killed between its pointers): "last" would find nothing, so the refusal
    # names a pointer of the newest step instead
    last = (root / "pointers" / "last.ckpt").read_bytes()
    (root / "pointers" / "last.ckpt").unlink()
    named = str(root / "pointers" / "epoch=0-step=8.ckpt")
    with pytest.raises(
        ckpt.RunMismatchError, match=re.escape(f"To resume that run: trainer.fit(model, ..., ckpt_path={named!r})")
    ):
        _fit(root, 12)
    # killed while step 12 was written (save_last=False, save_top_k=1): its pointer names it, none names step 8;
    # that pointer is the way back (its load falls back to 8), where "last" would find nothing again
    (root / "pointers" / "epoch=0-step=8.ckpt").rename(root / "pointers" / "epoch=0-step=12.ckpt")
    (root / "pointers" / "epoch=0-step=12.ckpt").write_text(
        json.dumps({"format": "ckpt-lightning-pointer/1", "root": "..", "step": 12})
    )
    named = str(root / "pointers" / "epoch=0-step=12.ckpt")
    with pytest.raises(
        ckpt.RunMismatchError, match=re.escape(f"To resume that run: trainer.fit(model, ..., ckpt_path={named!r})")
    ):
        _fit(root, 12)
    (root / "pointers" / "epoch=0-step=12.ckpt").unlink()
    with pytest.raises(ckpt.RunMismatchError, match=r"no pointer file names step 8 any more: restart with the run id"):
        _fit(root, 12)
    (root / "pointers" / "last.ckpt").write_bytes(last)
    _fit(root, 12, ckpt_path="last")  # the explicit resume takes the run over


def test_a_restart_of_the_same_run_resumes_without_ckpt_path(tmp_path, no_launcher_ids):
    from ettr import attribute_root

    straight = _fit(tmp_path / "straight", 12)
    _fit(tmp_path / "job", 8, run_id="job-1")  # as if torchrun or a requeue restarted it with the same id
    resumed = _fit(tmp_path / "job", 12, run_id="job-1")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [a.restored_step for a in attribute_root(str(tmp_path / "job")).attempts] == [None, 8]


def test_restarts_of_the_same_run_without_ckpt_path_keep_one_last_ckpt_and_no_old_step(tmp_path, no_launcher_ids):
    """A restart that resumes silently restored ModelCheckpoint from the step alone, without last.ckpt's own entries
    (its last_model_path): each restart wrote last-v1.ckpt, last-v2.ckpt... and every older last*.ckpt pinned its
    step for good. It loads through the newest last*.ckpt naming the step, as fit(ckpt_path="last") does."""
    straight = _fit(tmp_path / "straight", 12)
    job = tmp_path / "job"
    for steps in (4, 8, 12):  # as if torchrun or a requeue restarted it with the same id
        resumed = _fit(job, steps, run_id="job-1")
    assert sorted(p.name for p in (job / "pointers").iterdir()) == ["epoch=0-step=12.ckpt", "last.ckpt"]
    assert committed_steps(job) == [12]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def _losses(printed: str) -> dict[int, str]:
    """Step -> loss (float hex) from the "loss STEP HEX" lines Net prints."""
    return {int(w[1]): w[2] for w in (line.split() for line in printed.splitlines()) if len(w) == 3 and w[0] == "loss"}


@pytest.mark.parametrize("without", [None, "rng", "sampler"])
def test_resume_is_bitwise_only_with_the_rng_and_sampler_restored(tmp_path, capsys, without):
    """The docs' claim and its negative controls: a fit stopped at 8 and resumed from "last" to 12 equals a straight
    fit to 12 step by step; without the RNG state (dropout, input noise) or the sampler position in the checkpoint it
    differs from the very first resumed step, while everything before the resume still matches."""
    straight = _fit(tmp_path / "straight", 12)
    reference = _losses(capsys.readouterr().out)
    _fit(tmp_path / "job", 8, without=without)
    before = _losses(capsys.readouterr().out)
    resumed = _fit(tmp_path / "job", 12, ckpt_path="last", without=without)
    after = _losses(capsys.readouterr().out)
    assert sorted(reference) == list(range(1, 13)) and before == {s: reference[s] for s in range(1, 9)}
    same_weights = all(torch.equal(straight[k], resumed[k]) for k in straight)
    if without is None:
        assert after == {s: reference[s] for s in range(9, 13)} and same_weights
    else:
        assert sorted(after) == list(range(9, 13)) and after[9] != reference[9] and not same_weights


def test_a_validation_at_the_saved_step_does_not_shift_the_resumed_rng(tmp_path, capsys):
    """Step 8 is saved, then validated (its DataLoader draws a base seed from the global RNG); the resume from 8 does
    not validate again, so validations must leave training's RNG as they found it: a fit trains as without them."""
    straight = _fit(tmp_path / "straight", 12, val_every=4)
    reference = _losses(capsys.readouterr().out)
    unvalidated = _fit(tmp_path / "unvalidated", 12)
    assert _losses(capsys.readouterr().out) == reference
    assert all(torch.equal(straight[k], unvalidated[k]) for k in straight)
    _fit(tmp_path / "job", 8, val_every=4)
    capsys.readouterr()
    resumed = _fit(tmp_path / "job", 12, ckpt_path="last", val_every=4)
    assert _losses(capsys.readouterr().out) == {s: reference[s] for s in range(9, 13)}
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_callback_that_draws_between_the_snapshot_and_the_save_does_not_shift_the_resumed_rng(tmp_path, capsys):
    """A callback after GoodputCallback draws in on_train_batch_end, after the batch-end snapshot and before
    ModelCheckpoint's save: a validation gave back the snapshot, not the state the save holds and a resume starts
    from, so the resumed steps 9-12 differed (the snapshot is the saved state once a save takes it)."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    class DrawsAtBatchEnd(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.rand(1)  # a callback that samples something to log

    def callbacks(root):
        return (DrawsAtBatchEnd(), ModelCheckpoint(dirpath=root / "pointers", every_n_train_steps=4, save_last=True))

    _fit(tmp_path / "straight", 12, val_every=4, callbacks=callbacks(tmp_path / "straight"))
    reference = _losses(capsys.readouterr().out)
    _fit(tmp_path / "job", 8, val_every=4, callbacks=callbacks(tmp_path / "job"))
    capsys.readouterr()
    _fit(tmp_path / "job", 12, ckpt_path="last", val_every=4, callbacks=callbacks(tmp_path / "job"))
    assert _losses(capsys.readouterr().out) == {s: reference[s] for s in range(9, 13)}


def test_remove_checkpoint_deletes_a_step_once_no_pointer_names_it_and_a_newer_step_is_committed(tmp_path):
    """ModelCheckpoint removes pointers; the step goes only when nothing in the folder names it any more and it is
    not the newest committed step (a resume needs that one): until then the deletion is deferred."""
    root, folder = tmp_path / "root", tmp_path / "root" / "pointers"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, folder / "a.ckpt")
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, folder / "last.ckpt")  # the same step, twice named
    io.wait()
    io.remove_checkpoint(folder / "a.ckpt")
    io.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and committed_steps(str(root)) == [4]
    io.save_checkpoint({"global_step": 8, "w": torch.ones(3)}, folder / "b.ckpt")
    io.wait()
    io.remove_checkpoint(folder / "b.ckpt")  # step 8 is the newest committed step: kept, its deletion deferred
    io.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and committed_steps(str(root)) == [4, 8]
    io.save_checkpoint({"global_step": 12, "w": torch.full((3,), 2.0)}, folder / "last.ckpt")  # 4 is named no more
    io.teardown()  # drains the save of 12: now 8 is covered too
    assert committed_steps(str(root)) == [12]
    loaded = CkptCheckpointIO(root).load_checkpoint(folder / "last.ckpt")
    assert loaded["global_step"] == 12 and torch.equal(loaded["w"], torch.full((3,), 2.0))


def test_a_step_another_folders_pointer_names_is_kept_in_this_process_and_the_next(tmp_path):
    """Two ModelCheckpoints in two folders (every N steps, and a top-k) may save the same step: one removing its
    pointer must not delete the step the other still names (before, only the removing pointer's folder was
    looked at, and the other's pointer was left naming a deleted step), in this process or a later one."""
    root = tmp_path / "root"
    a, b = root / "every", root / "best"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, a / "step=4.ckpt")
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, b / "best.ckpt")  # the same step, another folder
    io.save_checkpoint({"global_step": 8, "w": torch.ones(3)}, a / "step=8.ckpt")
    io.remove_checkpoint(a / "step=4.ckpt")
    io.teardown()
    assert committed_steps(str(root)) == [4, 8]
    # the next attempt has not written into `best` yet: the root's record of its pointer folders names it
    later = CkptCheckpointIO(root)
    later.save_checkpoint({"global_step": 12, "w": torch.full((3,), 2.0)}, a / "step=12.ckpt")
    later.remove_checkpoint(a / "step=8.ckpt")
    later.teardown()  # drains the save of 12, which covers 8
    assert committed_steps(str(root)) == [4, 12]
    loaded = CkptCheckpointIO(root).load_checkpoint(b / "best.ckpt")
    assert loaded["global_step"] == 4 and torch.equal(loaded["w"], torch.zeros(3))
    later.remove_checkpoint(b / "best.ckpt")  # named by nothing now
    later.teardown()
    assert committed_steps(str(root)) == [12]


def test_top_k_rotation_deletes_each_step_at_its_pointers_removal_not_at_the_fits_end(tmp_path):
    """A long fit with save_top_k keeps its disk use bounded: the step a removal leaves unnamed (and a newer
    committed step covers) is deleted by that removal, also where the plugin keeps track of its own pointers."""
    root, folder = tmp_path / "root", tmp_path / "root" / "pointers"
    io = CkptCheckpointIO(root)
    for step in (4, 8, 12):
        io.save_checkpoint({"global_step": step, "w": torch.zeros(3)}, folder / f"step={step}.ckpt")
        io.wait()
        if step > 4:
            io.remove_checkpoint(folder / f"step={step - 4}.ckpt")
            io.wait()  # the deletion is written in the background too
            assert committed_steps(root) == [step]
    io.teardown()


def test_a_pointer_another_process_copies_or_rewrites_in_place_keeps_the_step_it_names(tmp_path):
    """The plugin reads a pointer file again only where the folder's listing shows it new or changed since it was
    read: a pointer another process (a user keeping a checkpoint) copies into the folder, then rewrites in place to
    name another step (same size, same file), still keeps the step it names at each removal."""
    root, folder = tmp_path / "root", tmp_path / "root" / "pointers"
    io = CkptCheckpointIO(root)
    for step in (4, 8, 12):
        io.save_checkpoint({"global_step": step, "w": torch.full((3,), float(step))}, folder / f"step={step}.ckpt")
    io.wait()
    keep = folder / "keep.ckpt"
    shutil.copyfile(folder / "step=4.ckpt", keep)
    long_ago = time.time() - 3600  # written long before it is read: what the plugin read of it stands until it changes
    os.utime(keep, (long_ago, long_ago))
    io.remove_checkpoint(folder / "step=4.ckpt")
    assert committed_steps(root) == [4, 8, 12]
    shutil.copyfile(folder / "step=8.ckpt", keep)  # in place: now it keeps 8, and 4 is named by nothing
    io.remove_checkpoint(folder / "step=8.ckpt")
    io.teardown()
    assert committed_steps(root) == [8, 12]
    loaded = CkptCheckpointIO(root).load_checkpoint(keep)
    assert loaded["global_step"] == 8 and torch.equal(loaded["w"], torch.full((3,), 8.0))


def test_a_step_whose_other_pointer_another_process_removed_is_deleted_by_the_teardown(tmp_path):
    """A save that frees no step of its own reads no pointer (the plugin knows what it wrote and removed itself), so
    it does not see a pointer another process removed; the fit's teardown lists the folders again and deletes the
    step that nothing names any more."""
    root = tmp_path / "root"
    every, best = root / "every", root / "best"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, every / "step=4.ckpt")
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, best / "best.ckpt")
    io.save_checkpoint({"global_step": 8, "w": torch.ones(3)}, every / "step=8.ckpt")
    io.remove_checkpoint(every / "step=4.ckpt")  # best.ckpt names 4 still
    io.wait()
    assert committed_steps(root) == [4, 8]
    (best / "best.ckpt").unlink()  # by a user, say
    io.save_checkpoint({"global_step": 12, "w": torch.full((3,), 2.0)}, every / "step=12.ckpt")
    io.teardown()
    assert committed_steps(root) == [8, 12]


def test_a_damaged_record_of_a_pointer_folder_stops_deletions_and_is_named(tmp_path):
    root = tmp_path / "root"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(3)}, root / "p" / "a.ckpt")
    io.teardown()
    (entry,) = (root / "lightning-folders").iterdir()
    entry.write_text('{"format": "ckpt-lightning-folder/1", "folder": "elsewhere"}')  # not the folder it is named by
    later = CkptCheckpointIO(root)
    with pytest.warns(RuntimeWarning, match=f"{entry.name} is a damaged ckpt-lightning-folder/1 entry"):
        later.save_checkpoint({"global_step": 8, "w": torch.ones(3)}, root / "q" / "b.ckpt")  # reads the records
    later.remove_checkpoint(root / "p" / "a.ckpt")  # step 4 may be named in the folder it no longer knows: kept
    later.teardown()
    assert committed_steps(str(root)) == [4, 8]
    entry.unlink()  # as the warning says
    again = CkptCheckpointIO(root)
    again.save_checkpoint({"global_step": 12, "w": torch.ones(3)}, root / "p" / "c.ckpt")  # finishes p's removals
    again.teardown()
    assert committed_steps(str(root)) == [8, 12]


def test_a_full_save_of_a_step_saved_weights_only_first_is_refused_and_the_other_order_resumes(tmp_path):
    """A step is saved once: a weights-only ModelCheckpoint saving it first made the full one's pointer (last.ckpt)
    name a checkpoint without optimizer state, and the resume failed in Lightning with a KeyError. Now the full save
    fails at once, naming the cure: the full ModelCheckpoint first (Lightning keeps their order)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def weights_only(root):
        return ModelCheckpoint(dirpath=root / "w", every_n_train_steps=2, save_weights_only=True)

    def full(root):
        return ModelCheckpoint(dirpath=root / "full", every_n_train_steps=4, save_last=True)

    root = tmp_path / "wrong"
    with pytest.raises(ValueError, match=r"step 4 was saved without \['callbacks', 'lr_schedulers', 'optimizer_"):
        _fit(root, 4, callbacks=(weights_only(root), full(root)))
    root = tmp_path / "right"
    _fit(root, 4, callbacks=(full(root), weights_only(root)))
    _fit(root, 6, ckpt_path=str(root / "full" / "last.ckpt"))  # trains on from step 4's full state to step 6


def test_save_last_link_survives_the_dangling_link_of_a_top_k_removal_and_resumes_through_it(tmp_path):
    """With ``save_last="link"`` ModelCheckpoint removes the previous top-k file before it links ``last.ckpt`` to the
    new one: the removal found the dangling link among the pointers and the fit failed (FileNotFoundError)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    root = tmp_path / "root"
    link = lambda: ModelCheckpoint(dirpath=root / "p", every_n_train_steps=2, save_top_k=1, save_last="link")  # noqa: E731
    _fit(root, 6, callbacks=(link(),))
    assert os.readlink(root / "p" / "last.ckpt") == "epoch=0-step=6.ckpt" and committed_steps(root) == [6]
    _fit(root, 8, ckpt_path="last", callbacks=(link(),))
    assert os.readlink(root / "p" / "last.ckpt") == "epoch=0-step=8.ckpt" and committed_steps(root) == [8]


@pytest.fixture
def own_process_group():
    """Lightning's distributed strategies initialize a process group (and its environment) in this process and leave
    it when setup fails: tear both down so that later tests' managers are not distributed."""
    environ = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def test_model_parallel_strategy_is_refused_before_anything_is_written(tmp_path, own_process_group):
    """ModelParallelStrategy saves through torch.distributed.checkpoint, never CheckpointIO: refused at setup."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    with pytest.raises(RuntimeError, match="ModelParallelStrategy bypasses CheckpointIO"):
        _fit(tmp_path / "root", 2, strategy=ModelParallelStrategy())
    assert not list((tmp_path / "root").glob("step_*")) and not (tmp_path / "root" / "ettr").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDPStrategy needs a GPU")
def test_fsdp_strategy_is_refused_before_anything_is_written(tmp_path, own_process_group):
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(RuntimeError, match="FSDPStrategy bypasses CheckpointIO"):
        _fit(tmp_path / "root", 2, strategy=FSDPStrategy(), accelerator="cuda")
    assert not list((tmp_path / "root").glob("step_*")) and not (tmp_path / "root" / "ettr").exists()


def test_saveable_keeps_exactly_what_a_save_stores():
    """The same `encodable` check as the library: a long double (no exact form) is dropped instead of failing the
    save, and a torch.Size stays a Size."""
    import numpy as np

    clean, dropped = saveable({"hp": {"eps": np.longdouble(1e-8), "shape": torch.Size([2, 3]), "n": np.int64(4)}})
    assert dropped == ["hp.eps"] and type(clean["hp"]["shape"]) is torch.Size and clean["hp"]["n"] == 4


@pytest.mark.parametrize("how", ["ckpt_path=last", "same run", "load_checkpoint", "save"])
def test_a_start_load_or_save_removes_temporary_pointer_files_left_by_a_killed_writer(tmp_path, no_launcher_ids, how):
    """A SIGKILL inside the pointer write (`_write_pointer`: write NAME.ckpt.tmp-PID, then rename) leaves the
    temporary file; the next start (a resume from "last", a restart of the same run), load or save removes it once it
    is older than any live write (STALE_TMP_S), and nothing else in the folder."""
    from integrations.lightning import STALE_TMP_S

    root = tmp_path / "job"
    _fit(root, 8, run_id="job-1")
    folder = root / "pointers"
    stale = folder / "epoch=0-step=15.ckpt.tmp-2334"
    stale.write_text('{"format": "ckpt-lightning-pointer/1", "root": "..", "st')  # cut short by the kill
    killed_at = time.time() - STALE_TMP_S - 60
    os.utime(stale, (killed_at, killed_at))
    live = folder / "last.ckpt.tmp-99999"  # as young as a live writer's (another process's): kept
    live.write_text("{}")
    other = folder / "notes.txt.tmp-1"  # not a pointer's temporary file: kept
    other.write_text("mine")
    os.utime(other, (killed_at, killed_at))
    if how == "load_checkpoint":
        io = CkptCheckpointIO(root)
        assert io.load_checkpoint(folder / "last.ckpt")["global_step"] == 8
        io.teardown()
    elif how == "save":
        io = CkptCheckpointIO(root)
        io.save_checkpoint({"global_step": 9, "w": torch.zeros(2)}, folder / "manual.ckpt")
        io.teardown()
    else:
        _fit(root, 12, ckpt_path="last" if how == "ckpt_path=last" else None, run_id="job-1")
    assert not stale.exists() and live.exists() and other.read_text() == "mine"
    assert "last.ckpt" in {p.name for p in folder.iterdir()}


def test_a_temporary_pointer_file_too_young_for_one_save_is_removed_by_a_later_one(tmp_path):
    """A writer killed inside its pointer write just before this process started leaves a temporary file younger than
    STALE_TMP_S at the first saves: a later save removes it once it is older (saves stop looking once none is left)."""
    from integrations.lightning import STALE_TMP_S

    root, folder = tmp_path / "root", tmp_path / "root" / "pointers"
    folder.mkdir(parents=True)
    left = folder / "last.ckpt.tmp-2334"
    left.write_text('{"format": "ckpt-lightning-pointer/1", "root": "..", "st')  # cut short by the kill
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 4, "w": torch.zeros(2)}, folder / "step=4.ckpt")
    assert left.exists()  # it may be a live writer's still
    killed_at = time.time() - STALE_TMP_S - 60
    os.utime(left, (killed_at, killed_at))  # as if the fit had run on for longer than that
    io.save_checkpoint({"global_step": 8, "w": torch.ones(2)}, folder / "step=8.ckpt")
    io.teardown()
    assert sorted(p.name for p in folder.iterdir()) == ["step=4.ckpt", "step=8.ckpt"]


class _FaultyRoot(CkptCheckpointIO):
    """A CkptCheckpointIO whose root is a `FaultStorage`: the first write `fail_path` accepts raises (the predicate
    may also hold a write back while it waits)."""

    def __init__(self, root, fail_path):
        super().__init__(root)
        self.fail_path = fail_path

    @property
    def manager(self):
        from ckpt import CheckpointManager
        from fault_storage import FaultStorage

        if self._manager is None:
            storage = FaultStorage(open_storage(self.root), fail_path=self.fail_path)
            self._manager = CheckpointManager(storage, tracker=self.tracker)
        return self._manager


def _commit_fails(root):
    """A CkptCheckpointIO whose root fails its first commit (a step's manifest write): that save never commits, as
    when the process dies between writing a step's pointers and committing the step (the fits using it save once)."""
    return _FaultyRoot(root, lambda path: path.endswith(layout.MANIFEST))


def test_a_step_deleted_while_a_failed_fit_tears_down_is_in_the_ledger(tmp_path):
    """Step 8 commits only once step 9 has failed (a write still going on), so step 4, named by no pointer since the
    save of 8, is deleted while the failed fit tears its IO down: the failed attempt's ledger records that deletion,
    and the report retains exactly the step left on disk."""
    import threading

    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    failed = threading.Event()

    class FailsAtStep9(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 8:
                failed.set()
                raise RuntimeError("step 9 failed")

    held = layout.manifest_path(8)  # its write waits for the failure (and fails if that never comes)
    io = _FaultyRoot(tmp_path, lambda path: path == held and not failed.wait(60))
    every4 = ModelCheckpoint(dirpath=tmp_path / "pointers", every_n_train_steps=4, save_last=True)
    with pytest.raises(RuntimeError, match="step 9 failed"):
        _fit(tmp_path, 12, io=io, callbacks=(FailsAtStep9(), every4))
    assert committed_steps(tmp_path) == [8]
    report = attribute_root(str(tmp_path))
    assert (report.committed_steps, report.deleted_steps, report.retained_steps) == ((4, 8), (4,), (8,))


def test_a_fit_whose_first_save_never_committed_restarts_fresh_from_last(tmp_path, no_launcher_ids):
    """The first attempt's only save (step 4) never commits, after ModelCheckpoint wrote last.ckpt and
    epoch=0-step=4.ckpt naming it. Every fit(ckpt_path="last") then starts fresh with a warning (the docs' Run
    identity table: no committed step is a fresh start), also after a restart whose own first save never commits
    again; the end equals a straight fit, and the dangling pointers are gone. A load that is not a fit's start (here
    the IO alone, which cannot tell) refuses instead, deleting nothing."""
    from ckpt import CheckpointWriteError

    root = tmp_path / "job"
    fresh = r"last.ckpt names step 4 of .*never committed.*no step of the root is.*the fit starts fresh"
    with pytest.raises(CheckpointWriteError, match="injected fault"):
        _fit(root, 6, io=_commit_fails(root))
    assert pointers(root) == {"epoch=0-step=4.ckpt": 4, "last.ckpt": 4} and committed_steps(root) == []
    with pytest.warns(RuntimeWarning, match=fresh), pytest.raises(CheckpointWriteError, match="injected fault"):
        _fit(root, 6, ckpt_path="last", io=_commit_fails(root))
    assert pointers(root) == {"epoch=0-step=4.ckpt": 4, "last.ckpt": 4} and committed_steps(root) == []

    before = _tree(root)
    io = CkptCheckpointIO(root)
    with pytest.raises(FileNotFoundError, match=r"names step 4 of .*never committed.*no checkpoint to load"):
        io.load_checkpoint(root / "pointers" / "last.ckpt")
    io.teardown()
    assert _tree(root) == before, "a load that refuses deletes nothing"

    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    class LoadedFrom(Callback):
        def on_train_start(self, trainer, pl_module):
            self.path = trainer.ckpt_path

    straight, loaded_from = _fit(tmp_path / "straight", 8), LoadedFrom()
    every4 = ModelCheckpoint(dirpath=root / "pointers", every_n_train_steps=4, save_last=True)
    with pytest.warns(RuntimeWarning, match=fresh):
        resumed = _fit(root, 8, ckpt_path="last", callbacks=(every4, loaded_from))
    assert loaded_from.path is None, "trainer.ckpt_path: no checkpoint was loaded"
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert pointers(root) == {"epoch=0-step=8.ckpt": 8, "last.ckpt": 8}  # no -v1 names beside stale pointers
    assert committed_steps(root) == [8]
    assert [a.restored_step for a in attribute_root(str(root)).attempts] == [None, None, None]


def test_a_pointer_to_a_step_that_never_committed_never_skips_a_newer_committed_step(tmp_path):
    """Step 4 never committed, step 8 is: no fallback (nothing earlier) and no fresh start (it would pass over 8),
    even for a fit's load."""
    root, folder = tmp_path / "root", tmp_path / "root" / "p"
    io = CkptCheckpointIO(root)
    io.save_checkpoint({"global_step": 8, "w": torch.arange(3.0)}, folder / "a.ckpt")
    io.teardown()
    (folder / "b.ckpt").write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": "..", "step": 4}))
    io = CkptCheckpointIO(root)
    io.before_load = lambda: pytest.fail("a resume that loads nothing must not start")  # as GoodputCallback's fit
    with pytest.raises(FileNotFoundError, match=r"step 4 is not committed .* no earlier step is \(committed: \[8\]\)"):
        io.load_checkpoint(folder / "b.ckpt")
    io.teardown()


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda root: CkptCheckpointIO(root, keep_lst=3), r"unknown CheckpointManager option\(s\) \['keep_lst'\]"),
        (lambda root: CkptCheckpointIO(root, keep_last=-1), "keep_last must be a positive int, got -1"),
        (lambda root: CkptCheckpointIO(root, max_staging_bytes=100), "max_staging_bytes must be at least 4096"),
        (lambda root: CkptCheckpointIO(root, keep_last=2), r"options \['keep_last'\]: .* set save_top_k"),
        (lambda root: CkptCheckpointIO(root, retention=KeepLast(2)), r"options \['retention'\]: .* set save_top_k"),
        (lambda root: CkptCheckpointIO(root, tracker="x"), "tracker must be a CheckpointObserver"),
        (lambda root: GoodputCallback(root, samplers=[ShuffledSampler(64, 8, seed=1)]), "samplers must map a name"),
        (lambda root: GoodputCallback(root, samplers={"train": "x"}), r"samplers\['train'\] must be a ckpt sampler"),
        (lambda root: GoodputCallback(root, rng="yes"), "rng must be True, False or a ckpt.RNGState"),
        (lambda root: GoodputCallback(root, record_loss="no"), "record_loss must be True or False"),
        (lambda root: GoodputCallback(root, tracker=5), "tracker must be an ettr.GoodputTracker"),
        (lambda root: DecisionCheckpoint("x"), "decision must be a ckpt.SaveDecision"),
        (lambda root: CkptCheckpointIO(os.path.join(root, "file", "sub")), "file/sub cannot be created: .* directory"),
    ],
)
def test_bad_arguments_are_refused_at_construction(tmp_path, build, message):
    """They used to fail at the first save, hundreds of steps in, or hang: a list of samplers was iterated as
    name-sampler pairs, that is, the sampler's endless iteration; a root under a file was found by the first save.
    A retention of the manager's own (keep_last=2) deleted the step ModelCheckpoint(save_top_k=1)'s best pointer
    named: ckpt_path="best" failed with FileNotFoundError after the whole fit."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "file").write_text("x")
    with pytest.raises((TypeError, ValueError, OSError), match=message):
        build(str(tmp_path / "ck"))


def test_a_fit_rolled_back_to_an_older_pointer_is_refused_before_training_until_the_newer_steps_are_removed(tmp_path):
    """fit(ckpt_path=<the step-4 pointer>) while step 8 is committed trained steps 5 to 8 and then failed with
    StepExistsError: it is refused before training, naming `ckpt rollback`; once that removed step 8 the fit
    resumes from step 4 and ends where a straight fit does. A validate from the old pointer is no roll back."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckpt import StepExistsError, catalog

    root = tmp_path / "job"
    every4 = lambda: ModelCheckpoint(dirpath=root / "pointers", every_n_train_steps=4, save_top_k=-1)  # noqa: E731
    _fit(root, 8, callbacks=(every4(),))
    old = root / "pointers" / "epoch=0-step=4.ckpt"
    newest = re.escape(repr(str(root / "pointers" / "epoch=0-step=8.ckpt")))
    with pytest.raises(StepExistsError, match=rf"from step 4, but steps \[8\] .* ckpt rollback .* --to 4; .*{newest}"):
        _fit(root, 8, ckpt_path=old, callbacks=(every4(),))
    assert committed_steps(root) == [4, 8]
    io = CkptCheckpointIO(root)
    assert io.load_checkpoint(old)["global_step"] == 4  # not a fit's load: nothing is trained over
    io.teardown()
    assert [step for _, step in catalog.roll_back([open_storage(str(root))], 4)] == [8]
    resumed = _fit(root, 8, ckpt_path=old, callbacks=(every4(),))
    straight = _fit(tmp_path / "straight", 8)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert committed_steps(root) == [4, 8]


@pytest.mark.parametrize(
    "edit", [{"step": None}, {"step": "abc"}, {"root": 5}], ids=["no_step", "step_str", "root_int"]
)
def test_a_damaged_pointer_is_named_as_one(tmp_path, edit):
    """A pointer whose step or root was edited raised a bare KeyError: 'step' or int()'s message."""
    root = tmp_path / "job"
    _fit(root, 4)
    path = root / "pointers" / "last.ckpt"
    pointer = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in {**pointer, **edit}.items() if v is not None}))
    io = CkptCheckpointIO(root)
    with pytest.raises(ValueError, match=r"last.ckpt is a damaged .* pointer: 'step' must be a step number"):
        io.load_checkpoint(path)
    io.teardown()


def _resumed_with_a_repeated_save(root: Path):
    """Fit to step 4 and resume to 5 under accumulate_grad_batches=2, with a top-2 ModelCheckpoint (of ``root/p``,
    by step, every 2 steps, with last.ckpt): the resume's first micro-batch saves the restored step 4 again, as
    ``epoch=0-step=4-v1.ckpt``. Returns the factory of that ModelCheckpoint, for the fits that follow."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def top2() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=root / "p", every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True
        )

    _fit(root, 4, callbacks=(top2(),), accumulate=2)
    _fit(root, 5, ckpt_path="last", callbacks=(top2(),), accumulate=2)
    return top2


def test_a_resume_from_last_keeps_the_top_k_a_repeated_save_of_its_step_changed(tmp_path):
    """With accumulate_grad_batches=2 a resumed fit's first micro-batch saves the restored step again, as stock
    Lightning does (``epoch=0-step=4-v1.ckpt``); ``last.ckpt`` then names that step with ModelCheckpoint's new top-k.
    The pointer kept only the callbacks' str entries, so the next resume from it lost ``best_k_models``: the -v1
    pointer was never removed and pinned its step for good. Stock Lightning ends with the two newest alone."""
    root = tmp_path / "root"
    top2 = _resumed_with_a_repeated_save(root)
    assert sorted(p.name for p in (root / "p").iterdir()) == [
        "epoch=0-step=4-v1.ckpt",
        "epoch=0-step=4.ckpt",
        "last.ckpt",
    ]
    last = top2()
    _fit(root, 8, ckpt_path="last", callbacks=(last,), accumulate=2)
    assert sorted(os.path.basename(p) for p in last.best_k_models) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    assert sorted(p.name for p in (root / "p").iterdir()) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert committed_steps(root) == [6, 8]
    scores = CkptCheckpointIO(root).load_checkpoint(root / "p" / "last.ckpt")["callbacks"]
    (state,) = [s for k, s in scores.items() if k.startswith("ModelCheckpoint")]
    assert all(isinstance(v, torch.Tensor) for v in state["best_k_models"].values())


def test_a_second_fit_of_one_trainer_goes_on_bitwise_without_ckpt_path(tmp_path, no_launcher_ids):
    """A second ``trainer.fit`` of the same Trainer (max_steps raised, no ckpt_path) was refused with
    RunMismatchError: the plugin's manager, reopened after the first fit's teardown, generated a new run id, so the
    root's steps looked like another run's. The process keeps its run: the fit goes on, bitwise as one fit."""
    expected = _fit(tmp_path / "straight", 8)
    root = tmp_path / "root"
    resumed = _fit(root, 4, then=8)
    assert committed_steps(root) == [8]
    assert all(torch.equal(v, expected[k]) for k, v in resumed.items())


def test_a_fit_into_a_root_another_fit_is_writing_fails_before_training_and_claims_nothing(tmp_path, capsys):
    """A second fit(ckpt_path="last") of a live root resumed, claimed the root for its own run (the live writer's
    restarts were then refused as another run) and trained until its first save met the writer's lease. It takes the
    lease at its start now: LeaseHeldError naming the live writer, no step trained, the root's run record as it was."""
    import signal

    from ckpt import LeaseHeldError
    from kill_resume import run_of

    root = tmp_path / "root"
    live = start(CHILD, root, tmp_path / "live.npz", STEPS, hang_at=8)  # saves 4 and 8, then holds the root
    try:
        for line in live.stdout:  # the event: its saves are durable and it goes on holding the lease
            if line.startswith("hanging"):
                break
        run, pointers = run_of(root), {p.name: p.read_bytes() for p in (root / "pointers").iterdir()}
        capsys.readouterr()
        with pytest.raises(LeaseHeldError, match=f"being written by .*pid {live.pid}"):
            _fit(root, STEPS, ckpt_path=str(root / "pointers" / "last.ckpt"))
        assert _losses(capsys.readouterr().out) == {}, "no step trained"
        assert run_of(root) == run and {p.name: p.read_bytes() for p in (root / "pointers").iterdir()} == pointers
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()


def test_a_fallback_from_a_step_that_never_committed_keeps_the_top_k_its_step_last_recorded(tmp_path):
    """last.ckpt naming a step its process never committed falls back to the step before, and restored that step's
    callbacks as its first save stored them: a top-k file written later at that step (a resume's -v1 save of it) was
    forgotten and pinned its step for good. The fallback takes them from the newest pointer naming the step."""
    root = tmp_path / "root"
    top2 = _resumed_with_a_repeated_save(root)
    (root / "p" / "last.ckpt").write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": "..", "step": 6}))
    last = top2()  # as if the process had died while writing step 6, right after its last.ckpt
    with pytest.warns(RuntimeWarning, match="step 6 was never committed"):
        _fit(root, 8, ckpt_path="last", callbacks=(last,), accumulate=2)
    assert sorted(os.path.basename(p) for p in last.best_k_models) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    assert sorted(p.name for p in (root / "p").iterdir()) == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert committed_steps(root) == [6, 8]


def test_a_pointers_tensor_field_names_a_dtype_of_torch_or_stays_as_it_is():
    """A pointer holds a callback's 0-dim tensors (ModelCheckpoint's scores) as {"tensor", "dtype"}; the dtype is a
    name looked up in torch. An edited pointer naming another attribute of torch (``"load"``) failed the load with a
    TypeError from torch.tensor; only a torch.dtype is taken, anything else stays the plain value it is."""
    from integrations.lightning import _value

    assert _value({"tensor": 1.5, "dtype": "float64"}).dtype == torch.float64
    for name in ("load", "__class__", "nope"):
        assert _value({"best": {"tensor": 1.5, "dtype": name}}) == {"best": {"tensor": 1.5, "dtype": name}}


class _Killed(Exception):
    """Stands for a SIGKILL at a chosen point of a save (the files are left as the kill would leave them)."""


class _KilledAtLast(CkptCheckpointIO):
    """A CkptCheckpointIO whose process dies as ModelCheckpoint asks it for last.ckpt, before anything is written."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if os.path.basename(path) == "last.ckpt":
            raise _Killed(path)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_a_kill_before_a_resumed_fits_first_last_ckpt_leaves_a_last_ckpt_that_resumes(tmp_path, no_launcher_ids):
    """A resume through a last.ckpt naming a step that never committed: its first save (the top-k pointer, before
    last.ckpt) removed that last.ckpt, and a kill before the new one was written left none. fit(ckpt_path="last")
    then found nothing and was refused as a fresh start into another run's root (RunMismatchError). The stale
    last.ckpt stays until the new one replaces it (atomically, by its rename), so the same command resumes."""
    straight = _fit(tmp_path / "straight", 16)
    root, folder = tmp_path / "root", tmp_path / "root" / "pointers"
    _fit(root, 8)
    for name in ("epoch=0-step=12.ckpt", "last.ckpt"):  # as if killed while step 12 was written (save_top_k=1)
        (folder / name).write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": "..", "step": 12}))
    (folder / "epoch=0-step=8.ckpt").unlink()
    with pytest.warns(RuntimeWarning, match="step 12 was never committed"), pytest.raises(_Killed):
        _fit(root, 16, ckpt_path="last", io=_KilledAtLast(root))  # dies at step 12's last.ckpt
    assert [p.name for p in folder.glob("last*.ckpt")] == ["last.ckpt"]
    resumed = _fit(root, 16, ckpt_path="last")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert [a.restored_step for a in attribute_root(str(root)).attempts] == [None, 8, 12]


def test_a_top_k_removal_of_a_step_still_being_persisted_from_the_local_tier_defers_its_deletion(tmp_path, monkeypatch):
    """With local= the durable root gets each step after it committed locally; ModelCheckpoint removes the previous
    top-k pointer as soon as the next step is saved, while that step may still be on its way to the root (a slow
    store, the case a local tier is for). The deletion raised the manager's ValueError ("still being persisted") out
    of remove_checkpoint, and the fit died. The step is deleted later, once its persist is done."""
    import threading

    from ckpt.persist import PersistJob

    entered, release, run = threading.Event(), threading.Event(), PersistJob.run

    def held(job):  # the persist of step 1 waits here until the test lets it go
        if job.step == 1:
            entered.set()
            assert release.wait(60)
        return run(job)

    monkeypatch.setattr(PersistJob, "run", held)
    root, folder = tmp_path / "root", tmp_path / "root" / "p"
    io = CkptCheckpointIO(root, local=tmp_path / "local")
    io.save_checkpoint({"global_step": 1, "w": torch.zeros(3)}, folder / "epoch=0-step=1.ckpt")
    assert entered.wait(60)  # step 1 committed locally, its persist under way
    io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, folder / "epoch=0-step=2.ckpt")
    deadline = time.monotonic() + 60
    while 2 not in io.manager.steps():  # step 2 committed locally
        assert time.monotonic() < deadline
        time.sleep(0.01)
    io.remove_checkpoint(folder / "epoch=0-step=1.ckpt")  # save_top_k=1 at step 2
    assert [int(s) for s in io.manager.steps()] == [1, 2]
    release.set()
    io.teardown()
    assert committed_steps(root) == [2] and [p.name for p in folder.iterdir()] == ["epoch=0-step=2.ckpt"]


def test_a_fallback_to_the_roots_first_step_keeps_one_last_ckpt_and_pins_no_step(tmp_path, no_launcher_ids):
    """Killed while the second save (step 8) was written, after the first (step 4) committed: the fallback restores
    ModelCheckpoint without a last_model_path (step 4's dict was stored before its last.ckpt), so it writes
    last-v1.ckpt if last.ckpt is there at its first save. That stale last.ckpt, which it does not write over, goes at
    the first save: otherwise the next resume, through last-v1.ckpt, kept that file (Lightning keeps the checkpoint it
    resumed from) and with it a step for good."""
    root, folder = tmp_path / "root", tmp_path / "root" / "pointers"
    _fit(root, 4)
    for name in ("epoch=0-step=8.ckpt", "last.ckpt"):
        (folder / name).write_text(json.dumps({"format": "ckpt-lightning-pointer/1", "root": "..", "step": 8}))
    (folder / "epoch=0-step=4.ckpt").unlink()
    with pytest.warns(RuntimeWarning, match="step 8 was never committed"):
        _fit(root, 8, ckpt_path="last")
    _fit(root, 12, ckpt_path="last")
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=12.ckpt", "last.ckpt"]
    assert committed_steps(root) == [12]
