"""The goodput ledger on object-store roots: batched uploads, a bounded object count, reads through ckpt's storage."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ettr import CATEGORIES, FakeClock, GoodputTracker, LedgerError, attribute_root
from ettr.clock import to_us
from ettr.ledger import LEDGER_DIR, SEGMENT_BYTES, UPLOAD_INTERVAL_S, open_url_store, read_ledgers

REPO = Path(__file__).resolve().parents[1]


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


def _one_step_per_rank(root: str, ranks: int) -> str:
    """An attempt of one step on each rank, rank r's taking 1 + r seconds."""
    clock = FakeClock(1000.0)
    for rank in range(ranks):
        tr = GoodputTracker(root, attempt_id="a1", rank=rank, job_id="job", clock=clock).start()
        tr.step_begin(1)
        clock.advance(1.0 + rank)
        tr.step_end(1)
        tr.end()
    return root


def test_each_rank_lists_and_reads_only_its_own_prefix():
    """A restarting tracker (and `ettr report --rank`) pages through its rank's objects only, not 1,000 ranks'."""
    root = _one_step_per_rank("memory://ettr-ranks", 3)
    store = open_url_store(root)
    assert store.list_dirs(LEDGER_DIR) == ["rank0", "rank1", "rank2"]
    assert [l.rank for l in read_ledgers(root, rank=1)] == [1]
    assert attribute_root(root).micros["productive"] == to_us(1.0)  # the lowest rank by default
    assert attribute_root(root, rank=2).micros["productive"] == to_us(3.0)


def test_a_local_copy_of_an_object_store_root_reads_as_the_store(tmp_path):
    """`aws s3 sync s3://bucket/run ./run` keeps the per-rank prefixes as folders: `ettr report ./run` reads the
    same attempts from them (it used to list only the flat folder a local root writes, and found no ledgers)."""
    root = _one_step_per_rank("memory://ettr-copied", 2)
    store = open_url_store(root)
    for key in store.list_files(LEDGER_DIR):
        (tmp_path / LEDGER_DIR / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / LEDGER_DIR / key).write_bytes(store.read(f"{LEDGER_DIR}/{key}"))
    assert [(l.attempt, l.rank, l.records) for l in read_ledgers(str(tmp_path))] == [
        (l.attempt, l.rank, l.records) for l in read_ledgers(root)
    ]
    assert [l.rank for l in read_ledgers(str(tmp_path), rank=1)] == [1]
    assert attribute_root(str(tmp_path), rank=1).micros == attribute_root(root, rank=1).micros


def test_a_ledger_copied_in_twice_is_an_error_naming_both_files(tmp_path):
    """A local ledger and a synced copy of the same attempt (ettr/ledger-a1-rank0.jsonl beside
    ettr/rank0/ledger-a1-rank0.000000.jsonl) were read as one ledger of both files' records: every save, commit and
    restore counted twice (2 saves of 1, the background write doubled, T_write halved), in silence."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a1", rank=0, clock=clock).start()
    with tr.span("checkpoint_save", step=1):
        clock.advance(1.0)
    tr.checkpoint_committed(1, 2.0)
    tr.end()
    flat = tmp_path / LEDGER_DIR / "ledger-a1-rank0.jsonl"
    (tmp_path / LEDGER_DIR / "rank0").mkdir()
    copy = tmp_path / LEDGER_DIR / "rank0" / "ledger-a1-rank0.000000.jsonl"
    copy.write_bytes(flat.read_bytes())
    with pytest.raises(LedgerError, match=f"attempt a1, rank 0 is there twice .*: {flat}, {copy}; keep one"):
        attribute_root(str(tmp_path))
    copy.unlink()
    assert attribute_root(str(tmp_path)).saves == 1


# One attempt on a fake clock from START s: a 0.5 s restore of RESTORED (none: a fresh start), three steps of 0.1 s,
# a 0.2 s save committed at once, three more steps; then it ends cleanly, or waits to be SIGKILLed.
CHILD = r"""
import sys, time
from ettr import FakeClock, GoodputTracker
root, attempt, start, upload, then, restored = sys.argv[1:7]
clock = FakeClock(float(start))
tracker = GoodputTracker(
    root, attempt_id=attempt, rank=0, job_id="job", clock=clock, flush_interval=0, upload_interval=float(upload)
).start()
with tracker.span("checkpoint_restore"):
    clock.advance(0.5)
step = 0 if restored == "none" else int(restored)
tracker.checkpoint_restored(None if restored == "none" else step)
for i in range(6):
    step += 1
    tracker.step_begin(step)
    clock.advance(0.1)
    tracker.step_end(step)
    if i == 2:
        with tracker.span("checkpoint_save"):
            clock.advance(0.2)
        tracker.checkpoint_committed(step, 0.5)
if then == "end":
    tracker.end()
    sys.exit()
print("hanging", flush=True)
time.sleep(600)
"""

# Killed after step 6 (committed 3): steps 4-6 lost; the restart 10 s after the first began resumes from 3.
KILLED_AND_RESUMED = {
    "checkpoint_restore": 1.0,
    "productive": 0.9,
    "checkpoint_save": 0.4,
    "lost": 0.3,
    "downtime": 8.7,
}


def killed_and_resumed(tmp_path, root: str, upload_interval: float) -> dict[str, int]:
    """Attempt 1 SIGKILLed after its sixth step, attempt 2 resumes from step 3 and ends: micros per category."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def attempt(name, start, then, restored):
        return subprocess.Popen(
            [sys.executable, str(script), root, name, str(start), str(upload_interval), then, restored],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    first = attempt("a1", 1000.0, "hang", "none")
    assert first.stdout.readline() == "hanging\n"
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL
    assert attempt("a2", 1010.0, "end", "3").wait(timeout=120) == 0
    return attribute_root(root).micros


def test_a_killed_and_resumed_run_on_s3_reports_what_a_local_root_reports(tmp_path, s3_bucket):
    """With every record uploaded (upload_interval=0) an s3:// root attributes exactly like a local one."""
    want = {c: to_us(KILLED_AND_RESUMED.get(c, 0.0)) for c in CATEGORIES}
    assert killed_and_resumed(tmp_path, str(tmp_path / "local"), 0.0) == want
    assert killed_and_resumed(tmp_path, f"s3://{s3_bucket}/run", 0.0) == want


def test_a_kill_on_s3_turns_the_unuploaded_steps_into_downtime(tmp_path, s3_bucket):
    """With the default upload interval the steps after the last commit were still in memory at the kill: 0.3 s
    moves from lost to downtime, every other category and the total stay as on a local root."""
    got = killed_and_resumed(tmp_path, f"s3://{s3_bucket}/run", UPLOAD_INTERVAL_S)
    want = {**KILLED_AND_RESUMED, "lost": 0.0, "downtime": 9.0}
    assert got == {c: to_us(want.get(c, 0.0)) for c in CATEGORIES}


def test_ettr_report_on_s3_takes_the_ckpt_cli_options(tmp_path, s3_bucket, s3_server, monkeypatch):
    """`python -m ettr report s3://...` with --endpoint (no AWS_ENDPOINT_URL) reports the ledger; an unreachable
    endpoint is one line naming the root, exit status 2, within the --timeout."""
    root, clock = f"s3://{s3_bucket}/run", FakeClock(1000.0)
    tr = GoodputTracker(root, attempt_id="a1", rank=0, job_id="job", clock=clock).start()
    tr.step_begin(1)
    clock.advance(2.0)
    tr.step_end(1)
    tr.end()
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def report(*options):
        cmd = [sys.executable, "-m", "ettr", "report", root, "--json", *options]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)

    out = report("--endpoint", s3_server.endpoint)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["seconds"]["productive"] == 2.0
    out = report("--endpoint", "http://127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 2 and out.stderr.startswith(f"error: cannot read the ledgers in {root}/ettr: "), out.stderr


def test_train_loop_gives_its_tracker_the_managers_storage_options(s3_bucket, s3_server, monkeypatch):
    """TrainLoop(root, storage_options=...) without AWS_ENDPOINT_URL: checkpoints and the ledger reach the same
    store (one configuration per root), and the report reads it with the same options."""
    import torch

    from integrations import TrainLoop

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    root, options = f"s3://{s3_bucket}/loop", {"endpoint": s3_server.endpoint, "timeout": 10}
    with TrainLoop(root, {"model": torch.nn.Linear(2, 2)}, every_steps=2, rng=False, storage_options=options) as loop:
        for step in loop.steps(4):
            loop.on_step_end(step)
    assert loop.manager.steps() == [2, 4]
    a = attribute_root(root, storage_options=options)
    assert a.committed_steps == (2, 4) and a.attempts[0].status == "ok"


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_record_after_end_is_refused_not_lost(tmp_path, where):
    """A commit reported after end() names the closed ledger instead of vanishing (or landing in a stray file)."""
    root = str(tmp_path) if where == "local" else "memory://ettr-closed"
    tr = GoodputTracker(root, attempt_id="a1", rank=0, job_id="job", clock=FakeClock(1000.0)).start()
    tr.end()
    with pytest.raises(ValueError, match=r"ledger-a1-rank0: the ledger is closed"):
        tr.checkpoint_committed(1, 0.5)
    (ledger,) = read_ledgers(root)
    kinds = [r["k"] for r in ledger.records]
    assert "end" in kinds and "commit" not in kinds
