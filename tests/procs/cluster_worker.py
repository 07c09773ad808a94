"""One rank of the cluster tests, started by torchrun inside a node of `tests/cluster.py`.

The plain loop (`integrations.TrainLoop`) trains the demo's model (`examples/lm_demo`) on the demo's corpus with two
tiers: the local tier on the node's tmpfs (``--local`` with ``{rank}``), the peer replica on the same local rank of
the other node (``replica_offset`` = LOCAL_WORLD_SIZE), the durable root a host directory. Data parallel: the sampler
gives each rank its slice of the global batch and one all-reduce over gloo averages the gradients, flattened in
parameter order. Not DDP: DDP lays its buckets out again after the first iteration of each process, so a resumed
process's first step sums the gradients in another order than the uninterrupted run's, and the weights differ in
their last bits.
Prints ``rank R resumed S tier T``, ``rank R step S loss HEX`` (the loss's exact bits) and at the end rank 0
writes ROOT/final.json with the weights' SHA-256.
"""

import argparse
import gc
import hashlib
import json
import logging
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckpt import RandomWindowSampler, TokenWindowDataset, make_loader
from examples.lm_demo.model import TinyCausalLM
from examples.lm_demo.worker import DemoTracker, weights_sha256
from integrations import TrainLoop


def say(line: str) -> None:
    """One line in one write: the node's ranks share its log file (opened for appending), lines never interleave."""
    os.write(1, f"{line}\n".encode())


def average_gradients(model: torch.nn.Module) -> None:
    """Every rank's gradients averaged, in one all-reduce of them flattened in parameter order (the same order and
    the same summation in every attempt)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--local-tier", dest="local", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--persist-every", type=int, default=3)
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args()
    logging.basicConfig(format="%(message)s", stream=sys.stdout)
    logging.getLogger("ckpt").setLevel(logging.INFO)  # "replicated step N: ... in S s", read by the harness
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank, per_node = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    context, batch = 16, 8
    dataset = TokenWindowDataset(args.corpus, np.uint8, context + 1, 0)
    sampler = RandomWindowSampler(
        dataset.n_tokens, context + 1, context // 2, batch, 0, fingerprint=dataset.fingerprint()
    )
    model = TinyCausalLM(context, 16, 1)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tracker = DemoTracker(args.root, flush_interval=0.2)
    with TrainLoop(
        args.root,
        {"model": model, "optim": optim},
        sampler=sampler,
        every_steps=args.every,
        tracker=tracker,
        local=args.local,
        persist_every=args.persist_every,
        keep_local=2,
        replica_offset=per_node,
        collective_timeout=args.timeout,
    ) as loop:
        say(f"rank {rank} resumed {loop.start_step} tier {tracker.restored_tier}")
        batches = sampler.track(make_loader(dataset, sampler, num_workers=0))
        for step, b in zip(loop.steps(args.steps), batches):
            tokens = b["tokens"]
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(model)
            optim.step()
            loop.on_step_end(step, {"loss": loss.item()})
            say(f"rank {rank} step {step} loss {loss.item().hex()}")
    if rank == 0:
        final = {"steps": loop.step, "sha256": weights_sha256(model)}
        Path(args.root, "final.json").write_text(json.dumps(final))
    say(f"rank {rank} done {hashlib.sha256(weights_sha256(model).encode()).hexdigest()[:8]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.freeze()
    sys.exit(0)
