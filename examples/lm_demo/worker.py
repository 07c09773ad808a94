"""The training worker torchrun starts (and restarts): resume, train, checkpoint, maybe get killed by chaos."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ckpt import RandomWindowSampler, TokenWindowDataset, make_loader
from ettr import GoodputTracker
from integrations import TrainLoop

from .chaos import Chaos
from .config import add_tier_args, add_training_args
from .model import TinyCausalLM


def weights_sha256(model: torch.nn.Module) -> str:
    """Hash of every parameter and buffer's name, dtype, shape and bytes, in state_dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


class DemoTracker(GoodputTracker):
    """A GoodputTracker that also keeps the tier the restore read, for the progress line."""

    restored_tier: str | None = None

    def checkpoint_restored(self, step: int | None, *, tier: str | None = None) -> None:
        self.restored_tier = tier
        super().checkpoint_restored(step, tier=tier)


def retuned(loop: TrainLoop) -> str:
    """The save schedule in force: the interval, and with two tiers every how many saves one is persisted."""
    current = getattr(loop.decision, "current", loop.decision)
    interval = f"every {current.seconds:.1f} s" if hasattr(current, "seconds") else repr(current)
    k = loop.manager.persist_every
    return interval if k is None else f"{interval}, persist every {k} save{'s' if k > 1 else ''}"


def train(args: argparse.Namespace) -> None:
    """One attempt: restore the newest checkpoint under ROOT, train to --steps, write final.json with the weights' hash."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tag = f"[{args.name} attempt {attempt + 1}]"
    dataset = TokenWindowDataset(args.corpus, np.uint8, args.context + 1, args.seed)
    sampler = RandomWindowSampler(
        dataset.n_tokens, args.context + 1, args.context // 2, args.batch, args.seed, fingerprint=dataset.fingerprint()
    )
    model = TinyCausalLM(args.context, args.d_model, args.layers)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    tiers = {}
    if args.local is not None:
        tiers = {"local": str(args.local), "persist_every": args.persist_every}
        if args.node_loss and attempt == args.node_loss:  # after the node-loss kill: a new node, no local tier
            shutil.rmtree(args.local, ignore_errors=True)
            print(f"{tag} on a new node: the local tier {args.local} is gone", flush=True)
    tracker = DemoTracker(args.root, flush_interval=1.0)  # a SIGKILL loses at most 1 s of the ledger
    with TrainLoop(
        args.root,
        {"model": model, "optim": optim},
        sampler=sampler,
        every_steps=args.every,
        advise=args.advise,
        tracker=tracker,
        **tiers,
    ) as loop:
        tier = f" ({tracker.restored_tier} tier)" if tracker.restored_tier else ""
        print(
            f"{tag} resumed from step {loop.start_step}{tier}" if loop.start_step else f"{tag} fresh start", flush=True
        )
        chaos = Chaos.for_attempt(args.chaos, args.seed, attempt, loop.start_step, args.steps, args.node_loss)
        replaying = loop.start_step > 0  # until the steps the earlier attempts trained after it are trained again
        batches = sampler.track(make_loader(dataset, sampler, num_workers=args.workers, tracker=tracker))
        schedule = retuned(loop)
        if args.advise:
            print(f"{tag} schedule {schedule}", flush=True)
        for step, batch in zip(loop.steps(args.steps), batches):
            tokens = batch["tokens"]
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()  # waits for the last save's copy of the parameters, if it is still being made
            saved = loop.on_step_end(step, {"loss": loss.item()})
            if args.advise and saved and retuned(loop) != schedule:  # the interval (and K) refitted from the ledger
                schedule = retuned(loop)
                print(f"{tag} step {step}: schedule retuned to {schedule}", flush=True)
            if step % args.log_every == 0 or step == args.steps:
                print(
                    f"{tag} step {step:>5}/{args.steps}  loss {loss.item():.4f}  ETTR so far {loop.ettr():.3f}"
                    f"  last checkpoint {loop.last_saved}",
                    flush=True,
                )
            if replaying and tracker.replay().through is None:  # each step trained again compared with its first pass
                replaying = False
                said = tracker.replay().text()
                print(f"{tag} {said}" if said else f"{tag} no step trained twice", flush=True)
            if chaos is not None:
                chaos.after_step(step, saved, settle=loop.manager.wait)
    final = {"steps": loop.step, "sha256": weights_sha256(model)}
    Path(args.root, "final.json").write_text(json.dumps(final))
    print(f"{tag} done: {loop.step} steps, weights sha256 {final['sha256'][:16]}...", flush=True)


def main() -> None:
    """Parse the worker's flags (the driver passes them) and train."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, help="checkpoint root of this run")
    parser.add_argument("--corpus", required=True, help="token file (uint8 bytes)")
    parser.add_argument("--name", default="run", help="label of progress lines")
    parser.add_argument("--chaos", type=int, default=0, help="SIGKILL the first this many attempts")
    add_training_args(parser)
    add_tier_args(parser, "--local-tier")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
    gc.freeze()  # the attempt ends here: skip the interpreter's final collections over torch's objects (~0.8 s)
