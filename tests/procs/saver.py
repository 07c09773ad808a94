"""Child process for the crash-consistency test: saves a changing state in a loop until killed.

Appends "committed N" to a log file after each save is durable. Runs as a script or, to skip the
interpreter and torch start-up on every one of many kills, forked from a preloaded forkserver.
"""

import sys

import torch

import ckpt


def state_for(step: int) -> dict:
    """A state whose every byte is a function of the step, so any restore can be checked exactly."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g).to(torch.bfloat16)},
        "opt": {"m": torch.randn(256, 2048, generator=g), "count": torch.tensor(step, dtype=torch.int64)},
        "zeros": torch.zeros(64, 64),
        "step": step,
    }


def main(root: str, start: int, log_path: str) -> None:
    log = open(log_path, "a", buffering=1)
    with ckpt.CheckpointManager(root, keep_last=3, chunk_bytes=1 << 20) as m:
        step, prev = start, None
        while True:
            h = m.save(step, state_for(step))
            if prev is not None:
                prev.wait()
                log.write(f"committed {prev.step}\n")
            prev, step = h, step + 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
