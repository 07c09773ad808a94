"""A writer of the stale-writer tests: saves one step of a state filled with one value, and can stop itself
(SIGSTOP) inside that save until the test lets it go on (SIGCONT).

    python stale_writer.py ROOT STEP VALUE LEASE_TTL PAUSE LOG
PAUSE: "commit" (just after the commit's lease check, before the manifest is written), "write" (the step begun, no
array written yet) or "none". The log gets "paused ...", "resumed ...", then "committed STEP" or "failed STEP: ...".
A writer refused the root's lease (a live holder) tries again until it gets it (within 120 s).
"""

import signal
import sys
import threading
import time
import traceback

import torch

import ckpt
from ckpt import save, storage
from ckpt.errors import LeaseHeldError

root, step, value, ttl, pause, log_path = sys.argv[1:7]
step, value, ttl = int(step), float(value), float(ttl)
log = open(log_path, "a", buffering=1)


def state(v: float) -> dict:
    """An array of its own (3 MiB: chunk files) and a packed one."""
    return {"big": torch.full((768, 1024), v), "small": torch.full((16,), v)}


def stop(where: str) -> None:
    log.write(f"paused {where}\n")
    # to this thread: it stops before its next instruction (sent to the process, another thread may take it, and this
    # one runs on for a moment: long enough to write the manifest's temp file)
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    log.write(f"resumed {where}\n")


if pause == "commit":
    for cls in (storage.LocalStorage, storage.KvStorage):
        name = "create" if hasattr(cls, "create") else "write_atomic"  # how the manifest is written (older: replaced)

        def write(self, path, data, *args, _real=getattr(cls, name), **kw):
            if path.endswith("manifest.json"):
                stop("commit")  # commit_step has just checked the lease
            return _real(self, path, data, *args, **kw)

        setattr(cls, name, write)
elif pause == "write":
    real_begin = save.begin_step

    def begin_step(*args, **kw):
        real_begin(*args, **kw)
        stop("write")

    save.begin_step = begin_step

with ckpt.CheckpointManager(root, lease_ttl=ttl) as m:
    deadline = time.monotonic() + 120
    while True:
        try:
            handle = m.save(step, state(value))
            break
        except LeaseHeldError:
            assert time.monotonic() < deadline, "the root's lease was never free"
            time.sleep(0.05)
    try:
        handle.wait()
        log.write(f"committed {step}\n")
    except ckpt.CheckpointWriteError as e:
        where = "".join(traceback.format_exception(e.__cause__)).replace("\n", " | ")
        log.write(f"failed {step}: {e} (at: {where})\n")
