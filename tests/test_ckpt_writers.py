"""One writer per root (the lease) and `ckpt gc` beside live saves: real processes on real files."""

import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import uuid

import pytest
import torch

import ckpt
from ckpt import catalog, cli, lease
from ckpt.errors import LeaseHeldError
from ckpt.storage import KvStorage, context, open_storage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import writer  # noqa: E402
from child_logs import wait_for  # noqa: E402


@pytest.fixture(scope="module")
def procs():
    """Children forked from a server with torch and ckpt loaded: each starts in milliseconds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckpt", "writer"])
    return ctx


pytestmark = pytest.mark.usefixtures("no_child_left")


def _start(ctx, target, *args):
    p = ctx.Process(target=target, args=args)
    p.start()
    return p


def _assert_steps_exact(root, steps):
    storage = open_storage(root)
    with ckpt.CheckpointManager(root) as m:
        assert m.steps() == steps
        for s in steps:
            assert not list(catalog.verify(storage, s))
            target = writer.state_for(0)
            assert m.restore(target, step=s) == s
            expected = writer.state_for(s)
            assert torch.equal(target["a"], expected["a"]) and torch.equal(target["b"], expected["b"]), s


def test_second_writer_fails_at_once_naming_the_holder_readers_work_and_a_killed_holder_frees_the_root(
    tmp_path, procs, capsys
):
    root = str(tmp_path / "ck")
    holder = _start(procs, writer.hold, root, str(tmp_path / "a"))
    wait_for(tmp_path / "a", "holding")

    second = _start(procs, writer.save_once, root, 2, str(tmp_path / "b"))
    second.join(120)
    refused = (tmp_path / "b").read_text()
    assert refused.startswith("refused:"), refused
    assert f"pid {holder.pid} on host {socket.gethostname()}" in refused and "since" in refused

    # readers never need the lease: restore, ls, inspect, verify, explain beside the live writer
    with ckpt.CheckpointManager(root) as m:
        target = writer.state_for(0)
        assert m.restore(target) == 1 and torch.equal(target["a"], writer.state_for(1)["a"])
    for argv in (["ls", root], ["inspect", root], ["verify", "-q", root], ["explain", root, "--step", "3"]):
        assert cli.main(argv) == 0, (argv, capsys.readouterr())
    assert "1  committed" in capsys.readouterr().out

    os.kill(holder.pid, signal.SIGKILL)  # the kernel drops the dead holder's lock: no manual step
    holder.join()
    third = _start(procs, writer.save_once, root, 2, str(tmp_path / "c"))
    third.join(120)
    assert (tmp_path / "c").read_text() == "ok\n"
    _assert_steps_exact(root, [1, 2])


def test_gc_in_a_loop_beside_a_live_saver_fails_no_save(tmp_path, procs):
    root = str(tmp_path / "ck")
    saves = 120
    saver = _start(procs, writer.save_loop, root, 0, saves, str(tmp_path / "saver"))
    wait_for(tmp_path / "saver", "committed 0")
    gc = _start(procs, writer.gc_loop, root, str(tmp_path / "stop"), str(tmp_path / "gc"))
    saver.join(600)
    (tmp_path / "stop").touch()
    gc.join(120)
    log = (tmp_path / "saver").read_text().splitlines()
    failed = [line for line in log if line.startswith("failed")]
    assert not failed, f"{len(failed)} of {saves} saves failed beside gc, e.g. {failed[:3]}"
    assert log[-1] == "done" and sum(line.startswith("committed") for line in log) == saves
    passes = int(wait_for(tmp_path / "gc", "gc passes").split()[-1])
    assert passes >= 5, f"gc ran only {passes} times beside the saver: the test exercised nothing"
    _assert_steps_exact(root, [saves - 2, saves - 1])


def _leftover(root, step, marker):
    d = os.path.join(root, f"step_{step:08d}", "arrays", "a", "c")
    os.makedirs(d)
    with open(os.path.join(d, "0"), "wb") as f:
        f.write(b"half a chunk")
    if marker is not None:
        with open(os.path.join(root, f"step_{step:08d}", "_IN_PROGRESS"), "w") as f:
            f.write(marker if isinstance(marker, str) else json.dumps(marker))


def test_gc_beside_a_live_writer_removes_dead_writers_leftovers_only(tmp_path, procs, capsys):
    root = str(tmp_path / "ck")
    holder = _start(procs, writer.hold, root, str(tmp_path / "a"))
    wait_for(tmp_path / "a", "holding")
    live_id = lease.live_holder(open_storage(root))["id"]
    mine = {"pid": holder.pid, "host": socket.gethostname(), "time": time.time(), "lease": live_id}
    _leftover(root, 7, mine)  # the live writer's save in flight
    _leftover(root, 5, dict(mine, lease="a-dead-writer", pid=1 << 22))
    _leftover(root, 6, None)  # a crash between mkdir and marker, or a half-deleted step
    _leftover(root, 8, '[1, "2"]')  # a crafted marker: a JSON list
    _leftover(root, 9, '{"pid": "12", "lease": 3}')  # wrongly typed fields
    try:
        assert cli.main(["ls", root]) == 0
        out = capsys.readouterr().out
        assert "7  in progress" in out and "5  incomplete" in out and "8  incomplete" in out
        assert cli.main(["gc", root, "--dry-run"]) == 0
        *would, kept = capsys.readouterr().out.splitlines()
        assert sorted(int(line.split()[-1]) for line in would) == [5, 6, 8, 9]
        assert kept.startswith(f"kept incomplete step 7: {root} is being written by a writer: pid {holder.pid}"), kept
        assert cli.main(["gc", root]) == 0
        assert f"kept incomplete step 7: {root} is being written by" in capsys.readouterr().out
        assert sorted(catalog.garbage(open_storage(root))) == []
        assert [e.step for e in catalog.entries(open_storage(root))] == [1, 7]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
    assert cli.main(["gc", root]) == 0  # no live writer now: everything uncommitted is a leftover
    assert "removed incomplete step 7" in capsys.readouterr().out
    assert [e.step for e in catalog.entries(open_storage(root))] == [1]


def test_object_store_lease_expires_after_its_holder_stops_and_a_paused_holder_learns_it_lost(tmp_path, procs):
    # tensorstore's file kvstore stands in for an object store: the same conditional writes, and real processes
    url = f"file://{tmp_path}/kv"
    # 8 s: renewed every 2 s, so a holder starved for up to 6 s on a busy machine still holds it at the first check
    child = _start(procs, writer.hold_kv, url, 8.0, str(tmp_path / "h"))
    wait_for(tmp_path / "h", "holding")
    storage = KvStorage(url, context())
    with pytest.raises(LeaseHeldError, match=f"pid {child.pid} on host {socket.gethostname()}"):
        lease.acquire(storage, ttl=8.0)
    os.kill(child.pid, signal.SIGSTOP)  # alive but silent: its heartbeat stops
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                mine = lease.acquire(storage, ttl=30.0)
                break
            except LeaseHeldError:
                assert time.monotonic() < deadline, "the expired lease was never taken over"
                time.sleep(0.1)
    finally:
        os.kill(child.pid, signal.SIGCONT)
    lost = wait_for(tmp_path / "h", "lost:")
    assert f"taken over by a writer: pid {os.getpid()}" in lost or "expired" in lost
    child.join(60)
    mine.check()  # the new holder keeps it: the old one's heartbeat could not overwrite it
    mine.release()
    assert lease.live_holder(storage) is None


def test_one_writer_per_object_store_root_in_one_process():
    root = f"memory://{uuid.uuid4().hex}/run"
    first, second = ckpt.CheckpointManager(root), ckpt.CheckpointManager(root)
    first.save(1, writer.state_for(1)).wait()
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
        second.save(2, writer.state_for(2))
    assert second.steps() == [1]  # reading needs no lease
    first.close()
    second.save(2, writer.state_for(2)).wait()
    second.close()
    assert ckpt.CheckpointManager(root).steps() == [1, 2]


def test_a_renewal_of_its_own_that_the_store_applied_late_keeps_the_lease():
    """A stalled store timed a heartbeat's renewal out, then applied it: the next renewal's condition failed on that
    newer generation, and the only writer of the root declared its lease taken over by itself, refusing every save
    until a new manager. It now recognises its own record and keeps the lease."""
    from ckpt import lease as lease_mod
    from ckpt.storage import open_storage

    root = f"memory://{uuid.uuid4().hex}/run"
    with ckpt.CheckpointManager(root, lease_ttl=2.0) as m:
        m.save(1, writer.state_for(1)).wait()
        storage = open_storage(root)
        record = json.loads(storage.read(lease_mod.LEASE))
        late = dict(record, expires=record["expires"] + 0.5)
        storage.write_atomic(lease_mod.LEASE, json.dumps(late).encode())  # its renewal, applied late: a new generation
        deadline = time.monotonic() + 60
        while json.loads(storage.read(lease_mod.LEASE))["expires"] <= late["expires"]:  # a heartbeat after it
            assert time.monotonic() < deadline, "the heartbeat stopped renewing the lease"
            time.sleep(0.05)
        m.save(2, writer.state_for(2)).wait()
        assert m.steps() == [1, 2]


def test_an_object_store_manager_dropped_without_close_frees_the_root_at_once():
    """As for a local root (test_exit_without_close): a manager rebound in a notebook releases the object-store
    lease when its last reference goes. Its heartbeat thread used to hold it alive, renewing it forever."""
    import gc

    root = f"memory://{uuid.uuid4().hex}/run"
    gc.collect()
    gc.disable()
    try:
        m = ckpt.CheckpointManager(root)
        m.save(1, writer.state_for(1)).wait()
        m = ckpt.CheckpointManager(root)
        m.save(2, writer.state_for(2)).wait()
        assert m.steps() == [1, 2]
        m.close()
    finally:
        gc.enable()
    assert not [t for t in threading.enumerate() if t.name == "ckpt-lease"], "no heartbeat outlives its lease"


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_ls_shows_quarantined_steps_and_gc_damaged_removes_only_them(tmp_path, capsys, kind):
    root = str(tmp_path / "ck") if kind == "local" else f"memory://{uuid.uuid4().hex}/run"
    with ckpt.CheckpointManager(root) as m:
        for s in (1, 2):
            m.save(s, writer.state_for(s)).wait()
    storage = open_storage(root)
    # the layout a restore leaves when it moves a damaged step aside (made by hand here)
    moved = "_quarantine/step_00000002-1700000000123"
    for f in storage.list_files("step_00000002"):
        storage.write_atomic(f"{moved}/{f}", storage.read(f"step_00000002/{f}"))
    storage.delete_tree("step_00000002")
    record = {"reason": "chunk digest mismatch (key=a)", "time": 1700000000.123, "host": "h", "pid": 7}
    storage.write_atomic(f"{moved}/_DAMAGED", json.dumps(record).encode())
    storage.write_atomic("_quarantine/step_00000003-1700000000999/_DAMAGED", b"[not an object")
    storage.write_atomic("step_00000005/_IN_PROGRESS", b'{"pid": 1, "lease": "gone"}')

    assert [(q.step, q.reason) for q in catalog.quarantined(storage)] == [
        (2, "chunk digest mismatch (key=a)"),
        (3, "no readable _DAMAGED record"),
    ]
    assert cli.main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "1  committed" in out and "5  incomplete" in out
    line = next(l for l in out.splitlines() if l.split()[:2] == ["2", "damaged"])
    assert moved in line and "chunk digest mismatch (key=a)" in line
    assert "3  damaged" in out
    assert ckpt.CheckpointManager(root).steps() == [1]

    assert cli.main(["gc", root, "--damaged", "--dry-run"]) == 0
    assert "would remove damaged step 2" in capsys.readouterr().out and len(catalog.quarantined(storage)) == 2
    assert cli.main(["gc", root, "--damaged"]) == 0
    out = capsys.readouterr().out
    assert "removed damaged step 2" in out and "removed damaged step 3" in out and "incomplete" not in out
    assert catalog.quarantined(storage) == [] and [e.step for e in catalog.entries(storage)] == [1, 5]
    assert cli.main(["gc", root]) == 0
    assert "removed incomplete step 5" in capsys.readouterr().out
    assert [e.step for e in catalog.entries(storage)] == [1]


FORKING_HOLDER = """
import os, sys, time
from ckpt import lease
from ckpt.storage import open_storage
held = lease.acquire(open_storage(sys.argv[1]))
pid = os.fork()
if pid == 0:  # a worker forked by the writer (a DataLoader worker) that outlives it
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)  # not the test's pipes: their end is when the writer is done
    os.dup2(null, 2)
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
os._exit(0)  # the writer dies holding the lease
"""


def test_a_forked_worker_that_outlives_its_writer_does_not_keep_the_roots_lease(tmp_path):
    import subprocess

    root = str(tmp_path / "ck")
    run = subprocess.run([sys.executable, "-c", FORKING_HOLDER, root], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    worker = int(run.stdout.split()[0])
    try:
        os.kill(worker, 0)  # still alive: it inherited every descriptor of the writer, the lease's among them
        mine = lease.acquire(open_storage(root), wait_for_gc=0)  # the kernel freed the dead writer's lock
        mine.release()
    finally:
        os.kill(worker, signal.SIGKILL)
