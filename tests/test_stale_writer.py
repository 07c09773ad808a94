"""A writer that lost the root never commits, and never damages the step its successor commits; a committed step is
never overwritten. Real processes: writer A stops itself (SIGSTOP) inside its save of step 10, writer B takes the
root over and commits step 10, then A goes on. On SeaweedFS B takes A's lease once it expires; on a local root the
lease file is removed by hand (a clean-up script), so that B can lock a new one."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckpt
from child_logs import wait_for
from ckpt import catalog, layout
from ckpt.storage import open_storage

SCRIPT = Path(__file__).parent / "procs" / "stale_writer.py"
TTL = 4.0  # A's lease: B takes it over this long after A stopped renewing it (B retries until then)


class _Child:
    """A writer process, alive as `wait_for` asks."""

    def __init__(self, root: str, value: float, pause: str, log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), root, "10", str(value), str(TTL), pause, str(log)])

    def is_alive(self) -> bool:
        return self.proc.poll() is None


@pytest.fixture
def children():
    started: list[_Child] = []
    yield started
    for c in started:  # whatever failed: no child left stopped or running
        if c.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.proc.pid, signal.SIGCONT)
                c.proc.kill()
        c.proc.wait(60)


def _values(root: str) -> set[float]:
    target = {"big": torch.zeros(768, 1024), "small": torch.zeros(16)}
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(target) == 10
    return {float(v) for t in target.values() for v in t.unique()}


def _takeover(root: str, pause: str, tmp_path: Path, children: list, take_root) -> str:
    """A pauses at `pause`, B takes the root and commits step 10, A goes on; returns what A logged."""
    a = _Child(root, 1.0, pause, tmp_path / "a.log")
    children.append(a)
    wait_for(a.log, f"paused {pause}", 120, a)
    take_root()
    b = _Child(root, 2.0, "none", tmp_path / "b.log")
    children.append(b)
    wait_for(b.log, "committed 10", 120, b)
    assert b.proc.wait(60) == 0
    storage = open_storage(root)
    committed = storage.read(layout.manifest_path(10))
    os.kill(a.proc.pid, signal.SIGCONT)
    outcome = wait_for(a.log, "failed 10", 120, a)
    assert a.proc.wait(60) == 0
    assert storage.read(layout.manifest_path(10)) == committed, "B's manifest was overwritten"
    assert not list(catalog.verify(storage, 10)), "the stale writer damaged B's step"
    assert _values(root) == {2.0}, "step 10 holds B's state"
    return outcome


@pytest.mark.parametrize("pause", ["commit", "write"])
def test_object_store_writer_that_lost_its_lease_neither_commits_nor_damages_the_successors_step(
    s3_bucket, tmp_path, children, pause
):
    root = f"s3://{s3_bucket}/stale"
    outcome = _takeover(root, pause, tmp_path, children, lambda: None)
    if pause == "commit":  # its lease check passed before it stopped: the conditional create refuses it
        assert "StepExistsError" in outcome and "by another writer" in outcome, outcome
    else:  # it wrote its arrays into its own data directory, then its commit found the lease gone
        assert "LeaseHeldError" in outcome, outcome
    storage = open_storage(root)
    named = layout.read_manifest(storage, 10).data
    catalog.collect_stale_data(storage)  # A's files, if any are left, are gc's: B's are kept
    assert layout.data_dirs(storage, 10) == [named]
    assert not list(catalog.verify(storage, 10))


@pytest.mark.parametrize("pause", ["commit", "write"])
def test_local_writer_whose_lease_file_was_replaced_neither_commits_nor_damages_the_successors_step(
    tmp_path, children, pause
):
    root = str(tmp_path / "ck")
    outcome = _takeover(root, pause, tmp_path, children, lambda: os.remove(os.path.join(root, layout.LEASE)))
    expected = "StepExistsError" if pause == "commit" else "was removed or replaced"
    assert expected in outcome, outcome
    assert layout.data_dirs(open_storage(root), 10) == [layout.read_manifest(open_storage(root), 10).data]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_committed_manifest_is_never_replaced(tmp_path, where):
    """The commit creates the manifest only if absent: a second commit of a step fails and leaves the first."""
    from ckpt.save import commit_step

    root = str(tmp_path) if where == "local" else f"memory://{tmp_path.name}"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, {"x": torch.ones(4)}).wait()
    storage = open_storage(root)
    first = storage.read(layout.manifest_path(1))
    with pytest.raises(ckpt.StepExistsError, match="step 1 was committed .* by another writer"):
        commit_step(storage, 1, b"another manifest", None)
    assert storage.read(layout.manifest_path(1)) == first
    if where == "local":  # nor a temp file left beside it
        assert [f for f in os.listdir(tmp_path / layout.step_dir(1)) if ".tmp" in f] == []


def test_a_writer_that_lost_the_root_runs_no_retention(tmp_path, caplog):
    """A writer paused between its commit and its retention past its lease, while another took the root, listed the
    successor's steps on waking and deleted all but the newest. Its retention now checks the lease first, and so does
    each queued delete: it deletes nothing and says why. (Here the lease is lost just after step 2's commit.)"""
    import contextlib as cl

    root = tmp_path / "ck"

    class LosesTheRoot:
        def span(self, category, **attrs):
            return cl.nullcontext()

        def checkpoint_committed(self, step, seconds, nbytes, **kw):
            if step == 2:  # another writer's lease file where this one's was
                os.replace(tmp_path / "other", root / layout.LEASE)

        def checkpoint_restored(self, step, **kw):
            pass

        def checkpoint_failed(self, step, error):
            pass

    (tmp_path / "other").write_text("{}")
    m = ckpt.CheckpointManager(root, keep_last=1, tracker=LosesTheRoot())
    m.save(1, {"x": torch.ones(4)}).wait()
    with caplog.at_level("WARNING", logger="ckpt"):
        m.save(2, {"x": torch.ones(4)}).wait()
        with pytest.raises(ckpt.LeaseHeldError, match="was removed or replaced"):
            m.save(3, {"x": torch.ones(4)})
        m.close()
    assert layout.committed_steps(open_storage(str(root))) == [1, 2]
    assert "retention after step 2 failed: " in caplog.text and "was removed or replaced" in caplog.text


def test_a_manifest_write_in_doubt_leaves_the_saves_data_for_a_late_commit(tmp_path, monkeypatch):
    """The manifest's PUT got no answer in time, and the store applies it later: the failed save left its data for
    it, so the step that commits late verifies. (Its cleanup deleted the data the late manifest named: `ckpt ls` said
    committed, `verify` found every pack missing.)"""
    from ckpt.errors import StorageError
    from ckpt.storage import KvStorage

    real, held = KvStorage.create, []

    def create(self, path, data, timeout=None):
        if path != layout.manifest_path(2):
            return real(self, path, data, timeout)
        held.append((self, path, data))  # sent, unanswered: the store applies it after the save gave up
        raise StorageError("no answer within 3 s", url=self.url, endpoint=None, bucket=None, key=path)

    root = f"memory://{tmp_path.name}/doubt"
    monkeypatch.setattr(KvStorage, "create", create)
    with ckpt.CheckpointManager(root) as m:
        m.save(1, {"x": torch.ones(4)}).wait()
        with pytest.raises(
            ckpt.CheckpointWriteError, match="should the store still apply it, step 2 becomes committed"
        ):
            m.save(2, {"x": torch.full((4,), 2.0)}).wait()
    storage, path, data = held[0]
    real(storage, path, data)  # the late landing
    assert layout.committed_steps(storage) == [1, 2]
    assert [list(catalog.verify(storage, s)) for s in (1, 2)] == [[], []]
    got = {"x": torch.zeros(4)}
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(got) == 2 and torch.equal(got["x"], torch.full((4,), 2.0))


def test_the_manifest_write_is_bounded_by_the_time_the_lease_has_left(s3_server, s3_bucket, monkeypatch):
    """A store that stops answering right at the commit: the manifest PUT is cut within the lease's remaining time
    (less its margin), not the store's 30 s timeout, so it cannot land after another writer could take the root."""
    from ckpt.storage import KvStorage

    ttl, real = 8.0, KvStorage.create
    bounds: list[float] = []
    waited: list[float] = []

    def create(self, path, data, timeout=None):
        bounds.append(timeout)
        os.killpg(s3_server.proc.pid, signal.SIGSTOP)  # frozen from the manifest's PUT on
        t0 = time.monotonic()
        try:
            return real(self, path, data, timeout)
        finally:
            waited.append(time.monotonic() - t0)
            os.killpg(s3_server.proc.pid, signal.SIGCONT)

    monkeypatch.setattr(KvStorage, "create", create)
    try:
        with ckpt.CheckpointManager(f"s3://{s3_bucket}/bounded", lease_ttl=ttl) as m:
            with pytest.raises(ckpt.CheckpointWriteError, match="cut at the lease's deadline"):
                m.save(1, {"x": torch.ones(4)}).wait()
    finally:
        os.killpg(s3_server.proc.pid, signal.SIGCONT)
    assert len(bounds) == 1 and 0 < bounds[0] <= ttl - ttl / 8, bounds
    assert waited[0] < 30, f"the PUT waited {waited[0]:.1f} s: the store's timeout, not the lease's"
