"""Chaos for the demo worker: SIGKILL its own process at a seeded random point, different in every attempt."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Callable


class Chaos:
    """Kills this attempt once: mid-step at `kill_step`, or (mode "write") during the first checkpoint write at or after it.

    The kill comes from a thread after a random delay of a few milliseconds, so it lands wherever the main
    thread and the checkpoint writer happen to be, never at a polite boundary.
    """

    def __init__(self, seed: int, attempt: int, start: int, total: int, lose_node: bool = False) -> None:
        rnd = random.Random(f"{seed}/{attempt}")
        self.lose_node = lose_node  # the node dies too: the next attempt finds no local tier (the worker wipes it)
        self.mode = "write" if attempt % 2 == 0 else "step"
        self.kill_step = rnd.randint(start + 1, max(start + 1, (start + total) // 2))
        self.delay_s = rnd.uniform(0.0, 0.005)
        self._armed = False

    @classmethod
    def for_attempt(
        cls, kills: int, seed: int, attempt: int, start: int, total: int, node_loss: int = 0
    ) -> Chaos | None:
        """A Chaos for the first `kills` attempts, None after (the last attempt finishes); the `node_loss`-th kill
        (1-based, 0: none) also loses the node."""
        return cls(seed, attempt, start, total, attempt + 1 == node_loss) if attempt < kills else None

    def after_step(self, step: int, saved: bool, settle: Callable[[], None] | None = None) -> None:
        """Call after each `on_step_end`; arms the killer when this attempt's point is reached. Before a node loss,
        `settle()` (the manager's `wait`) lets the persist in flight land, as it would long before a real node loss."""
        if self._armed or step < self.kill_step or (self.mode == "write" and not saved):
            return
        self._armed = True
        where = f"during the background write of step {step}" if self.mode == "write" else f"in step {step + 1}"
        if self.lose_node and settle is not None:
            settle()
            where += " and the node is lost"
        print(f"chaos: SIGKILL {where} (after {self.delay_s * 1e3:.1f} ms)", flush=True)
        threading.Thread(target=self._kill, daemon=True).start()

    def _kill(self) -> None:
        time.sleep(self.delay_s)
        os.kill(os.getpid(), signal.SIGKILL)
