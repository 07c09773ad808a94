"""Child process: a save that runs out of space, and what the manager does next; prints its observations as JSON.

Usage: full_disk.py ROOT [--file-size-limit BYTES]
With --file-size-limit the process lowers its own RLIMIT_FSIZE (no privileges needed) and ignores SIGXFSZ, so a
write past the limit fails with EFBIG; without it, ROOT is expected to be a small filesystem (ENOSPC).
Step 1 (40 KB) fits, step 2 (4 MB) does not, step 3 (40 KB) is saved after the failure was reported.
"""

import gc
import json
import os
import resource
import signal
import sys

import torch

import ckpt
from ckpt import catalog
from ckpt.storage import open_storage


def main(root: str, limit: int | None) -> None:
    if limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    g = torch.Generator().manual_seed(0)
    small = {"w": torch.randn(100, 100, generator=g)}
    big = {"w": torch.randn(100, 100, generator=g), "huge": torch.randn(1000, 1000, generator=g)}
    seen: dict = {}
    with ckpt.CheckpointManager(root) as m:
        m.save(1, small).wait()
        m.save(2, big)  # returns after the snapshot; the write fails in the background
        try:
            m.save(3, small)
            seen["next_call"] = "no error"
        except ckpt.CheckpointWriteError as e:
            seen["next_call"] = f"{type(e).__name__}: {e}"
        seen["leftovers"] = sorted(os.listdir(root))
        seen["steps_after_failure"] = m.steps()
        target = {"w": torch.zeros(100, 100)}
        seen["restored"] = m.restore(target)
        seen["restored_bitwise"] = torch.equal(target["w"], small["w"])
        m.save(3, small).wait()  # the loop goes on: the error was reported once
        seen["steps_at_end"] = m.steps()
    seen["problems"] = [str(p) for s in (1, 3) for p in catalog.verify(open_storage(root), s)]
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--file-size-limit" else None)
    gc.freeze()  # the child ends here: no final collections over torch's objects (~0.8 s)
