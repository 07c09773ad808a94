"""Submitting work to a thread pool that keeps working at interpreter exit."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


def submit_or_run(pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Future:
    """`pool.submit(fn, *args)`, or, once the pool takes no new work, `fn` run here (its result in a done future).

    At interpreter exit (a job that never called ``close()``), Python stops the idle workers of every pool while a
    busy one (the writer) goes on: its fsyncs and retention's deletes then run on the writer thread, which the exit
    waits for, instead of failing the save or the retention.
    """
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
        return run_here(fn, *args)


def run_here(fn: Any, *args: Any) -> Future:
    """`fn(*args)` run on the calling thread, its result (or error) in a done future."""
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as e:
        done.set_exception(e)
    return done


class Inline:
    """A pool that runs each task on the calling thread (a reader that wants one thing in memory at a time)."""

    submit = staticmethod(run_here)
