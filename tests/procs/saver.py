"""Child process for the crash-consistency tests: saves a changing state in a loop until killed.

Appends "committed N" to a log file after each save is durable, or "refused: ..." when another writer holds the
root. Runs as a script or, to skip the interpreter and torch start-up on every one of many kills, forked from a
preloaded forkserver.
"""

import gc
import sys

import torch

import ckpt


def state_for(step: int, writer: int = 0) -> dict:
    """A state whose every byte is a function of the step and the writer, so any restore can be checked exactly."""
    g = torch.Generator().manual_seed(step + 1_000_003 * writer)
    return {
        "model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1024, generator=g).to(torch.bfloat16)},
        "opt": {"m": torch.randn(256, 2048, generator=g), "count": torch.tensor(step, dtype=torch.int64)},
        "zeros": torch.zeros(64, 64),
        "step": step,
        "writer": writer,
    }


def main(root: str, start: int, log_path: str, writer: int = 0) -> None:
    log = open(log_path, "a", buffering=1)
    with ckpt.CheckpointManager(root, keep_last=3, chunk_bytes=1 << 20) as m:
        step, prev = start, None
        while True:
            try:
                h = m.save(step, state_for(step, writer))
            except ckpt.LeaseHeldError as e:
                log.write(f"refused: {e}\n")
                return
            if prev is not None:
                prev.wait()
                log.write(f"committed {prev.step}\n")
            prev, step = h, step + 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    gc.freeze()  # the child ends here: no final collections over torch's objects (~0.8 s)
