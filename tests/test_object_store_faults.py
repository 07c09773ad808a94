"""Faults of an object-store root against a real S3 server (SeaweedFS): the server killed in the middle of a save,
and the saving process SIGKILLed in the middle of an upload."""

import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckpt
from ckpt import catalog, cli, layout, lease
from ckpt.storage import open_storage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
from saver import state_for  # noqa: E402

TIMEOUT = {"timeout": 3}  # seconds a request may take, retries included: faults surface within a few of them
HANG_S = 60.0  # far above what the timeout allows: a hang fails the test instead of stalling the suite


def _assert_state(got: dict, step: int) -> None:
    want = state_for(step)
    for part in ("model", "opt"):
        for k, v in want[part].items():
            assert got[part][k].dtype == v.dtype and torch.equal(got[part][k], v), (step, part, k)
    assert got["step"] == step


def test_server_killed_mid_save_fails_the_save_in_bounded_time_and_the_store_recovers(s3_server, s3_bucket):
    root = f"s3://{s3_bucket}/killed"
    m = ckpt.CheckpointManager(root, chunk_bytes=256 << 10, storage_options=TIMEOUT)
    watcher = open_storage(root)
    try:
        m.save(1, state_for(1)).wait()
        failed, step = None, 2
        while failed is None and step < 6:  # the kill must land inside a save: retry if a save won the race
            handle = m.save(step, state_for(step))
            marker = layout.in_progress_path(step)
            while not handle.done() and watcher.read(marker) is None:  # its arrays are being uploaded now
                time.sleep(0.005)
            s3_server.kill()
            t0 = time.monotonic()
            try:
                handle.wait()
            except ckpt.CheckpointWriteError as e:
                failed = e
            assert time.monotonic() - t0 < HANG_S, "a dead store must fail the save within its timeout, not hang"
            if failed is None:  # committed before the kill: bring the server back and try the next step
                s3_server.start()
                step += 1
        assert failed is not None and failed.step == step, "no save was in flight when the server died"
        # the error names the object by its URL (tensorstore names the key inside the bucket only), the endpoint,
        # and that it cannot be reached, after the prefix a training loop matches
        message = str(failed)
        assert message.startswith(f"saving step {step} failed: StorageError: "), message
        assert f"{root}/step_{step:08d}/" in message and s3_server.endpoint in message, message
        assert "the endpoint cannot be reached" in message, message
        assert isinstance(failed.__cause__, ckpt.StorageError) and failed.__cause__.url == root + "/"
        with pytest.raises(ckpt.CheckpointError):  # while the store is down, a restore fails: it never skips
            m.restore(state_for(0))  # ... the newest step as "damaged" (nothing is quarantined)
        s3_server.start()

        target = state_for(0)
        assert m.restore(target) == step - 1  # the previous step, bitwise; the failed one is invisible
        _assert_state(target, step - 1)
        m.save(step, state_for(step)).wait()  # the next save, even of the failed step's number, works
        assert m.steps() == list(range(1, step + 1))
    finally:
        if s3_server.proc is None:
            s3_server.start()
        m.close()
    storage = open_storage(root)
    assert not list(catalog.verify(storage, step))
    assert not catalog.quarantined(storage)


def test_server_killed_mid_persist_names_the_object_it_could_not_write_and_gc_cleans_once_it_is_back(
    s3_server, s3_bucket, tmp_path, caplog
):
    """A persist to an object-store root whose server dies under it: the failure was the cleanup's ("read
    .../manifest.json failed", raised over the persist's own error); it names the object its own request failed on,
    the local step stays, and `ckpt gc` removes the durable leftovers once the server is back."""
    root = f"s3://{s3_bucket}/persist-killed"
    local = str(tmp_path / "local")
    m = ckpt.CheckpointManager(root, local=local, persist_every=1, chunk_bytes=256 << 10, storage_options=TIMEOUT)
    watcher = open_storage(root)
    try:
        m.save(1, state_for(1)).wait()
        m.wait()
        failed, step = None, 2
        while failed is None and step < 6:  # the kill must land inside a persist: retry if a persist won the race
            m.save(step, state_for(step)).wait()  # committed locally; the persist runs behind it
            while watcher.read(layout.in_progress_path(step)) is None and not layout.is_committed(watcher, step):
                time.sleep(0.005)
            s3_server.kill()
            try:
                m.wait()
            except ckpt.CheckpointWriteError as e:
                failed = e
            if failed is None:
                s3_server.start()
                step += 1
        assert failed is not None, "every persist won the race against the kill"
        message = str(failed)
        assert f"saving step {step} failed" in message and f"persisting to {root}/" in message, message
        # the persist's own request (a pack's open reads its zarr.json, a chunk's write), not the cleanup's read of the
        # manifest, which was raised over it
        named = re.search(rf"(read|write) {re.escape(root)}/step_{step:08d}/(\S+) failed", message)
        assert named and (named[2], named[1]) != ("manifest.json", "read"), message
        assert "the endpoint cannot be reached" in message and s3_server.endpoint in message, message
        assert "what it wrote stays for `ckpt gc`" in caplog.text  # the cleanup could not reach the store either
        s3_server.start()
        # the local step stays; a kill that cut the manifest's PUT itself may still have committed the durable one
        late = named[2] == "manifest.json"
        tiers = [s.tiers for s in m.steps() if int(s) == step]
        assert tiers == [("local",)] or (late and tiers == [("local", "durable")]), (tiers, message)
    finally:
        if s3_server.proc is None:
            s3_server.start()
        m.close()
    assert cli.main(["gc", root]) == 0
    committed = layout.committed_steps(watcher)
    assert layout.step_dirs(watcher) == committed and committed[: step - 1] == list(range(1, step)), committed


def _wait_until_the_lease_expires(storage) -> None:
    deadline = time.monotonic() + HANG_S
    while lease.live_holder(storage) is not None:
        assert time.monotonic() < deadline, f"the dead writer's lease never expired: {lease.live_holder(storage)}"
        time.sleep(0.2)


CHILD = """
import sys
sys.path.insert(0, {procs!r})
import torch
import ckpt
from saver import state_for
with ckpt.CheckpointManager({root!r}, keep_last=2, chunk_bytes=256 << 10, lease_ttl={ttl}) as m:
    step = (m.latest_step() or 0) + 1  # a saver after one killed between saves goes on from its last step
    while True:  # 16 MB more per step: an upload lasts long enough to be killed in the middle
        m.save(step, dict(state_for(step), pad=torch.full((4 << 20,), float(step))))
        step += 1
"""


def test_sigkill_mid_upload_commits_nothing_partial_and_gc_cleans_once_the_lease_expires(s3_bucket):
    root, ttl = f"s3://{s3_bucket}/sigkill", 4.0  # renewed every 1 s: holds on a busy machine
    code = CHILD.format(procs=os.path.join(os.path.dirname(__file__), "procs"), root=root, ttl=ttl)
    storage = open_storage(root)
    for _ in range(3):  # a save may still win the race against the kill: then kill the next saver
        child = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
        try:
            deadline = time.monotonic() + HANG_S
            while True:  # kill once a step is committed and the next one is under way
                assert child.poll() is None, "the saver died on its own"
                steps = layout.step_dirs(storage)
                assert time.monotonic() < deadline, (
                    "the saver never got a step committed and another under way; last seen: "
                    f"{[(s, layout.is_committed(storage, s)) for s in steps]}, lease {lease.live_holder(storage)}"
                )
                if (
                    len(steps) >= 2
                    and layout.is_committed(storage, steps[-2])
                    and not layout.is_committed(storage, steps[-1])
                ):
                    break
                time.sleep(0.01)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        if [e for e in catalog.entries(storage) if not e.committed]:
            break
        _wait_until_the_lease_expires(storage)  # the next saver waits for the dead one's lease anyway
    partial = [e.step for e in catalog.entries(storage) if not e.committed]
    assert partial, "three kills all landed between saves"

    holder = lease.live_holder(storage)
    if holder is not None:  # the dead writer's lease still runs: its leftovers look like a live save's
        assert catalog.collect_garbage(storage) == []
    _wait_until_the_lease_expires(storage)
    committed = layout.committed_steps(storage)
    removed = catalog.collect_garbage(storage)
    assert removed and not set(removed) & set(committed)
    assert layout.step_dirs(storage) == committed  # nothing uncommitted left

    for s in committed:
        assert not list(catalog.verify(storage, s)), s
    with ckpt.CheckpointManager(root) as m:  # a new writer takes the root over and resumes from the newest step
        target = dict(state_for(0), pad=torch.zeros(4 << 20))
        assert m.restore(target) == committed[-1]
        _assert_state(target, committed[-1])
        assert torch.equal(target["pad"], torch.full((4 << 20,), float(committed[-1])))
        m.save(committed[-1] + 1, state_for(committed[-1] + 1)).wait()


def test_a_throttled_gateway_slows_saves_and_restores_without_failing_them():
    """SeaweedFS's upload limits hold requests in a queue (slow answers; it never answers 503 SlowDown, so a
    throttling error cannot be produced here): saves and restores wait for it, each request within the timeout."""
    from seaweed import SeaweedServer

    server = SeaweedServer(extra_args=("-s3.concurrentFileUploadLimit=1", "-s3.concurrentUploadLimitMB=1"))
    server.start()
    try:
        server.make_bucket("throttled")
        options = {"endpoint": server.endpoint, **TIMEOUT}
        options |= {
            "access_key_id": server.env()["AWS_ACCESS_KEY_ID"],
            "secret_access_key": server.env()["AWS_SECRET_ACCESS_KEY"],
        }
        with ckpt.CheckpointManager("s3://throttled/run", chunk_bytes=256 << 10, storage_options=options) as m:
            for step in (1, 2):
                m.save(step, state_for(step))
            m.wait()
            target = state_for(0)
            assert m.restore(target) == 2
            _assert_state(target, 2)
    finally:
        server.close()


def test_a_frozen_server_fails_reads_within_the_timeout_and_is_usable_once_it_resumes(s3_server, s3_bucket):
    """A server that accepts connections and never answers (SIGSTOP: a hung process, a half-dead network path)."""
    root = f"s3://{s3_bucket}/frozen"
    with ckpt.CheckpointManager(root, storage_options=TIMEOUT) as m:
        m.save(1, state_for(1)).wait()
        os.killpg(s3_server.proc.pid, signal.SIGSTOP)
        try:
            for call in (lambda: m.restore(state_for(0)), lambda: ckpt.load(root, storage_options=TIMEOUT)):
                t0 = time.monotonic()
                with pytest.raises(ckpt.StorageError, match="no answer within 3 s"):
                    call()
                assert time.monotonic() - t0 < HANG_S
        finally:
            os.killpg(s3_server.proc.pid, signal.SIGCONT)
        target = state_for(0)
        assert m.restore(target) == 1
        _assert_state(target, 1)


FROZEN_SAVER = """
import json, os, signal, sys, time
sys.path.insert(0, {procs!r})
import ckpt
from ckpt import layout
from ckpt.storage import open_storage
from saver import state_for
m = ckpt.CheckpointManager({root!r}, chunk_bytes=256 << 10, storage_options={options!r})
watcher = open_storage({root!r}, {options!r})
m.save(1, state_for(1)).wait()
for step in range(2, 6):  # the stop must land inside a save: the next step if a save won the race
    handle = m.save(step, state_for(step))
    while not handle.done() and watcher.read(layout.in_progress_path(step)) is None:  # its uploads are under way
        time.sleep(0.005)
    os.killpg({pgid}, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        handle.wait()
    except ckpt.CheckpointWriteError as e:
        print(json.dumps({{"step": step, "seconds": time.monotonic() - t0, "error": str(e)}}), flush=True)
        break
    os.killpg({pgid}, signal.SIGCONT)
else:
    print(json.dumps({{"step": None}}), flush=True)
sys.stdin.readline()  # the server runs again: give the root's lease back
m.close()
"""


def test_a_server_frozen_mid_save_fails_the_save_within_tens_of_seconds_of_a_short_timeout(s3_server, s3_bucket):
    """A store that stops answering in the middle of a save (SIGSTOP), `timeout=3`: its chunk writes are tensorstore's,
    cut by curl's stall limit (the first root's timeout) after 3 attempts each: ~30 s, where a fixed 30 s stall and 8
    attempts took ~300 s. In a child process: tensorstore takes its curl settings from the process's first root."""
    root = f"s3://{s3_bucket}/frozen-save"
    procs = os.path.join(os.path.dirname(__file__), "procs")
    code = FROZEN_SAVER.format(procs=procs, root=root, options=TIMEOUT, pgid=s3_server.proc.pid)
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=os.environ.copy(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        # the saves' outcome, once the frozen save failed (or every save won the race); a hang fails the test
        ready, _, _ = select.select([child.stdout], [], [], 4 * HANG_S)
        line = child.stdout.readline() if ready else ""
    finally:
        os.killpg(s3_server.proc.pid, signal.SIGCONT)
        try:
            child.communicate("\n", timeout=HANG_S)
        finally:
            child.kill()
    assert line, f"the frozen save did not fail within {4 * HANG_S:g} s"
    assert child.returncode == 0, line
    got = json.loads(line)
    assert got["step"] is not None, "every save won the race against the stop"
    assert got["seconds"] < 120, got  # ~30 s; tensorstore's own retries with a 30 s stall: ~300 s
    assert f"saving step {got['step']} failed" in got["error"]
    assert f"frozen-save/step_{got['step']:08d}/" in got["error"], got["error"]  # the object that could not be written
    with ckpt.CheckpointManager(root, storage_options=TIMEOUT) as m:  # nothing partial is visible; the store works
        assert m.steps() == list(range(1, got["step"]))


def test_a_step_whose_manifest_is_written_is_committed_even_if_its_marker_cannot_be_removed(s3_bucket, caplog):
    """The manifest PUT is the commit: a store that fails right after it (the marker's DELETE) must not make the
    save report a failure for a step that every reader already sees as committed."""
    m = ckpt.CheckpointManager(f"s3://{s3_bucket}/marker", storage_options=TIMEOUT)
    delete_file = m.storage.delete_file

    def store_gone_after_the_manifest(path: str) -> None:
        if path.endswith(layout.IN_PROGRESS):
            raise OSError("the store went away after the manifest PUT")
        delete_file(path)

    m.storage.delete_file = store_gone_after_the_manifest  # fault injection on the real store
    try:
        m.save(1, state_for(1)).wait()  # no CheckpointWriteError: step 1 is committed
        assert m.steps() == [1]
        assert "is committed, but its _IN_PROGRESS marker could not be removed" in caplog.text
        target = state_for(0)
        assert m.restore(target) == 1
        _assert_state(target, 1)
    finally:
        m.close()
