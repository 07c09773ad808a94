"""Child process: a tiny GPT-2 trained by CkptTrainer, resumed from the manager's newest step when there is one.

Usage: hf_train.py OUTPUT_DIR OUT.npz MAX_STEPS [HANG_AT]
Prints "loss STEP HEX RANK" per step; with HANG_AT it drains the saves after that step, writes the weights, prints
"hanging PID" and sleeps (the test SIGKILLs it). Otherwise it writes the final weights and prints "done". Weights go
to OUT.npz (OUT.rankR.npz under torchrun, where rank 1 alone also asks for a save at step 6). With PERTURB_STEP in the environment, that step's loss is nudged (a divergence for the replay check
to find). With HANG_IN_FILES=N it hangs writing the folder files of step N
(the test SIGKILLs it). Under torchrun (2 CPU ranks, gloo) the Trainer runs DDP.
"""

import gc
import os
import sys
import time
from concurrent import futures

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

from ckpt import layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from integrations.hf import CkptTrainer  # noqa: E402


class LossPrinter(CkptTrainer):
    """Prints every micro-batch loss exactly (float hex) under the step it belongs to."""

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        if self.state.global_step + 1 == int(os.environ.get("PERTURB_STEP", "0")):
            loss = loss * (1 + 2**-10) if torch.is_tensor(loss) else (loss[0] * (1 + 2**-10), *loss[1:])
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        say(f"loss {self.state.global_step + 1} {loss.item().hex()} {self.args.process_index}")
        return loss


def say(line: str) -> None:
    """One write(2) of the whole line: ranks share the pipe, and a print may split a line into two writes."""
    os.write(1, (line + "\n").encode())


def write_weights(trainer: CkptTrainer, out: str) -> None:
    if "WORLD_SIZE" in os.environ:
        out = out.replace(".npz", f".rank{trainer.args.process_index}.npz")
    np.savez(out, **{k: v.detach().numpy() for k, v in trainer.model.state_dict().items()})


class HangAt(TrainerCallback):
    """After step `at` (its optimizer step, before its save): make the saves durable, their checkpoint-N folders
    whole and the ledger current, write the weights, then wait to be killed."""

    def __init__(self, at: int, out: str) -> None:
        self.at, self.out, self.trainer = at, out, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.trainer.ckpt_manager.wait()
            if self.trainer._files is not None:  # and the folder files of those saves, moving in on their thread
                futures.wait(list(self.trainer._files._pending.values()))
            self.trainer._goodput.tracker.flush()
            write_weights(self.trainer, self.out)
            say(f"hanging {os.getpid()}")
            time.sleep(600)


class HangInFiles:
    """A processing_class whose save_pretrained hangs (after the weights were written) in the folder files of step
    `step`, on their background thread, in the temporary folder beside checkpoint-N: the test SIGKILLs the child."""

    def __init__(self, step: int) -> None:
        self.step = step

    def save_pretrained(self, folder: str) -> None:
        if os.path.basename(folder).startswith(f".checkpoint-{self.step}."):
            say(f"hanging {os.getpid()}")
            time.sleep(600)


class HoldAfter(TrainerCallback):
    """Beside `HangInFiles`: the training thread waits at the start of the step after `step` until the test kills the
    child, so no later step commits while the folder files of `step` hang (a kill landing after the next save would
    otherwise leave a finished run, and the restart another outcome)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            time.sleep(600)


class RankSeed(TrainerCallback):
    """Under DDP, a fresh start reseeds each rank's torch RNG apart (HF seeds every rank alike), so that a resume
    that gave a rank another rank's RNG streams changes that rank's dropout, and its losses."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            torch.manual_seed(1000 + args.process_index)


class Rank1AtStep6:
    """A `ckpt.SaveDecision` that asks for a save at step 6 on rank 1 alone (as a timer or a signal seen by one rank
    would): every rank must save it, or rank 1's collective save would wait for the others."""

    def should_save(self, step: int, now: float) -> bool:
        return step == 6 and os.environ.get("RANK") == "1"

    def saved(self, step: int, now: float) -> None:
        pass


def main(output_dir: str, out: str, max_steps: int, hang_at: int | None) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (40, 16), generator=g)]
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        warmup_steps=2,
        save_steps=4,
        save_total_limit=2,
        logging_steps=1,
        seed=0,
        use_cpu=True,
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    callbacks = [HangAt(hang_at, out)] if hang_at is not None else []
    ddp = "WORLD_SIZE" in os.environ
    if ddp:
        callbacks.append(RankSeed())
    decision = Rank1AtStep6() if ddp else None
    if ddp:  # folder files read back on one rank cannot come from a local tier: refused when the trainer is built
        try:
            LossPrinter(model=model, args=args, train_dataset=data, manager_options={"local": f"{output_dir}/nvme"})
        except ValueError as e:
            say(f"refused {str(e).split(':')[0]}")
    hang_in_files = int(os.environ.get("HANG_IN_FILES", "0"))
    if hang_in_files:
        callbacks.append(HoldAfter(hang_in_files))
    trainer = LossPrinter(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=callbacks,
        save_decision=decision,
        processing_class=HangInFiles(hang_in_files) if hang_in_files else None,
    )
    for cb in callbacks:
        cb.trainer = trainer
    root = trainer.ckpt_root
    trainer.train(resume_from_checkpoint=bool(os.path.isdir(root) and layout.committed_steps(open_storage(root))))
    write_weights(trainer, out)
    say("done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
    gc.freeze()  # the child ends here: no final collections over torch's objects (~0.8 s)
