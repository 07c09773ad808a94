"""Child process: saves and restores whose host memory cannot be allocated (an address-space limit, as ``ulimit -v``
sets on some clusters), and what the manager does next; prints its observations as JSON.

Usage: address_limit.py ROOT
The process lowers its own RLIMIT_AS (no privileges needed) to what it uses plus a margin, after a first save and a
first restore started the threads they need (each thread's stack and malloc arena take address space too).
"""

import json
import resource
import sys

import torch

import ckpt

MiB = 1 << 20


def _limit(headroom: int) -> None:
    """Allow this process `headroom` bytes of address space more than it maps now (None: no limit)."""
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.RLIM_INFINITY))


def _unlimit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _error(call) -> str | None:
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e} (cause {type(e.__cause__).__name__})"
    return None


def main(root: str) -> None:
    w = {"w": torch.arange(16 * MiB, dtype=torch.int32)}  # 64 MiB
    big = {"w": torch.empty(512 * MiB, dtype=torch.uint8)}  # address space only: never touched
    seen: dict = {}
    with ckpt.CheckpointManager(root) as m:
        m.save(1, w).wait()
        _limit(128 * MiB)
        seen["big_save"] = _error(lambda: m.save(2, big).wait())
        seen["next_save"] = _error(lambda: m.save(3, w).wait())
        _unlimit()
        seen["steps"] = m.steps()
    into = {"w": torch.zeros(16 * MiB, dtype=torch.int32)}
    with ckpt.CheckpointManager(root, max_staging_bytes=16 * MiB) as m:  # a restore's scratch past the cap: temporary
        m.restore(into, step=1)  # starts the reader threads
        into["w"].zero_()
        _limit(32 * MiB)
        seen["restore"] = _error(lambda: m.restore(into))
        seen["untouched"] = bool((into["w"] == 0).all())
        _unlimit()
        seen["steps_after_restore"] = m.steps()
        seen["restored"] = m.restore(into)
        seen["bitwise"] = torch.equal(into["w"], w["w"])
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])
