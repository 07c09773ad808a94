"""Transformers with ckpt + ettr: a tiny local GPT-2 whose training fails at step 10, a restarted process that
resumes from step 8, a checkpoint folder loaded with from_pretrained, and the goodput report.

Both attempts run the same command, `trainer.train()`, under one run id (CKPT_RUN_ID here; SLURM_JOB_ID or
TORCHELASTIC_RUN_ID under a scheduler), so the restart resumes by itself; another run would be refused.

Run: python examples/hf_example.py [OUTPUT_DIR] [--ranks N]   (offline, nothing downloaded, seconds on a CPU; a
process per attempt, or with --ranks N each attempt is N CPU ranks under torchrun: HF's DDP, gloo; without
OUTPUT_DIR the run goes to a temp dir, removed at the end; a second run into one OUTPUT_DIR is refused)
"""

import argparse
import os
import subprocess
import sys
import tempfile
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

import ettr  # noqa: E402
from integrations.hf import CkptTrainer  # noqa: E402


class FailAt(TrainerCallback):
    """Simulates a crash (a bad node, an OOM) after some step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"simulated failure after step {self.step}")


def train(output_dir: str, max_steps: int, fail_at: int | None) -> None:
    """One process attempt: train up to `max_steps`; a restart of the same run resumes from its newest step."""
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_steps=4,
        save_total_limit=2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        logging_steps=4,
    )
    trainer = CkptTrainer(
        model=model,
        args=args,
        train_dataset=data,  # ckpt root: OUTPUT_DIR/ckpt
        callbacks=[FailAt(fail_at)] if fail_at else [],
    )
    trainer.train()


def run(output_dir: str, ranks: int) -> None:
    """Two attempts of one job into `output_dir` (the first fails after step 10, the restart finishes), each a process
    or `ranks` ranks under torchrun; then from_pretrained on the last checkpoint folder and the report."""
    job = {**os.environ, "CKPT_RUN_ID": f"hf-example-{uuid.uuid4().hex[:8]}"}  # what a scheduler's job id does
    launch = [sys.executable]
    if ranks > 1:  # torchrun's logs to /dev/null: by default it leaves an empty temp folder per run in /tmp
        launch += [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            f"--log-dir={os.devnull}",
        ]
    for fail_at in (10, 0):
        done = subprocess.run([*launch, __file__, "--attempt", output_dir, str(fail_at)], capture_output=True, env=job)
        if done.returncode and b"simulated failure after step" not in done.stderr:  # any other failure is real
            sys.exit(f"attempt failed (exit status {done.returncode}):\n{done.stderr.decode()[-4000:]}")
    print(sorted(d for d in os.listdir(output_dir) if d.startswith("checkpoint-")))
    final = GPT2LMHeadModel.from_pretrained(os.path.join(output_dir, "checkpoint-16"))  # HF-native folders
    print(f"checkpoint-16 loads with from_pretrained: {type(final).__name__}")
    print(ettr.report_text(ettr.attribute_root(os.path.join(output_dir, "ckpt"))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--attempt"]:
        train(sys.argv[2], 16, int(sys.argv[3]) or None)
        sys.exit()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "output_dir", nargs="?", default=None, help="where the run goes (default: a temp dir, removed after)"
    )
    p.add_argument("--ranks", type=int, default=1, help="processes per attempt (torchrun, DDP on CPU); default 1")
    cli = p.parse_args()
    if cli.output_dir is not None:
        run(cli.output_dir, cli.ranks)
    else:
        with tempfile.TemporaryDirectory(prefix="hf-example-") as output_dir:
            run(output_dir, cli.ranks)
