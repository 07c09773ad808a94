"""The goodput ledger on object-store roots: batched uploads, a bounded object count, reads through ckpt's storage."""

from __future__ import annotations

import math

from ettr import FakeClock, GoodputTracker, attribute_root
from ettr.clock import to_us
from ettr.ledger import LEDGER_DIR, SEGMENT_BYTES, UPLOAD_INTERVAL_S, open_url_store, read_ledgers


def test_six_hours_of_one_step_a_second_make_two_objects_and_one_upload_a_minute():
    """21,600 steps and the default 1 s flush: one object per flush would be 21,600 objects; batching makes one
    PUT per upload interval (each carrying one heartbeat) into 1 MiB segments."""
    root, hours = "memory://ettr-bounded", 6
    clock = FakeClock(1000.0)
    tr = GoodputTracker(root, attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    for step in range(1, hours * 3600 + 1):
        tr.step_begin(step)
        clock.advance(1.0)
        tr.step_end(step)
    tr.end()

    keys = open_url_store(root).list_files(f"{LEDGER_DIR}/rank0")
    (ledger,) = read_ledgers(root)
    size = sum(len(open_url_store(root).read(f"{LEDGER_DIR}/rank0/{k}")) for k in keys)
    assert len(keys) == math.ceil(size / SEGMENT_BYTES) == 2
    uploads = sum(r["k"] == "alive" for r in ledger.records)  # every PUT carries one heartbeat
    assert uploads == hours * 3600 / UPLOAD_INTERVAL_S + 2  # + the start's and the end's
    assert sum(r["k"] == "step" for r in ledger.records) == hours * 3600
    assert attribute_root(root).micros["productive"] == to_us(hours * 3600)


def test_each_rank_lists_and_reads_only_its_own_prefix():
    """A restarting tracker (and `ettr report --rank`) pages through its rank's objects only, not 1,000 ranks'."""
    root, clock = "memory://ettr-ranks", FakeClock(1000.0)
    for rank in (0, 1, 2):
        tr = GoodputTracker(root, attempt_id="a1", rank=rank, job_id="job", clock=clock).start()
        tr.step_begin(1)
        clock.advance(1.0 + rank)
        tr.step_end(1)
        tr.end()
    store = open_url_store(root)
    assert store.list_dirs(LEDGER_DIR) == ["rank0", "rank1", "rank2"]
    assert [l.rank for l in read_ledgers(root, rank=1)] == [1]
    assert attribute_root(root).micros["productive"] == to_us(1.0)  # the lowest rank by default
    assert attribute_root(root, rank=2).micros["productive"] == to_us(3.0)
