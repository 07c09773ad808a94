"""Two tiers: every save commits to a local tier, every K-th is persisted to the durable root from the local
files; restore takes the newest intact step, local first; a lost or damaged local copy falls back to the durable one."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import ckpt
from ckpt import catalog, layout
from ckpt import run as run_mod
from ckpt.distributed import Ranks
from ckpt.errors import CorruptCheckpointError
from ckpt.format import PACK_BYTES
from ckpt.persist import PersistJob
from ckpt.planner import Planner
from ckpt.storage import open_storage
from fault_storage import FaultStorage
from step_paths import data_dir

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
from tiers_worker import Restores  # noqa: E402


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 33, generator=g),
        "b": torch.randint(0, 1 << 30, (17,), generator=g),
        "meta": {"step": step, "name": f"s{step}"},
    }


def blank() -> dict:
    return {"w": torch.zeros(64, 33), "b": torch.zeros(17, dtype=torch.int64), "meta": None}


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["meta"] == b["meta"]


def saved(tmp_path, steps, **kw) -> tuple[str, str]:
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, **kw) as m:
        for s in steps:
            m.save(s, state(s)).wait()
    return durable, local


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0xFF]))


def chunk(root: str, step: int) -> str:
    """The first file of rank 0's pack ("w" at its start: byte 5 is in "w")."""
    return os.path.join(data_dir(root, step), "packs", "rank_00000", "c", "0")


def test_every_save_is_local_and_every_kth_is_persisted_with_its_own_retention(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=2, keep_local=2, keep_last=1) as m:
        for s in range(1, 6):
            m.save(s, state(s)).wait()
        m.wait()
        steps = m.steps()
        assert steps == [4, 5]
        assert [(int(s), s.tiers) for s in steps] == [(4, ("local", "durable")), (5, ("local",))]
    assert layout.committed_steps(open_storage(local)) == [4, 5]  # keep_local=2
    assert layout.committed_steps(open_storage(durable)) == [4]  # persisted 2 and 4, keep_last=1 there
    for root, s in ((local, 5), (durable, 4)):
        assert list(catalog.verify(open_storage(root), s)) == []
    # the durable copy is the local step's files: same manifest, same chunk bytes
    with (
        open(os.path.join(durable, layout.manifest_path(4)), "rb") as a,
        open(os.path.join(local, layout.manifest_path(4)), "rb") as b,
    ):
        assert a.read() == b.read()


def test_persist_copies_the_newest_local_save_to_the_durable_root_once(tmp_path):
    """A save at its interval that turns out to be the job's last (a loop's break, a preemption right after it) was
    in the local tier only, and saving it again with persist=True is a StepExistsError: persist(step) copies it."""
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=100) as m:
        m.save(2, state(2))
        m.save(4, state(4))
        with pytest.raises(ckpt.StepExistsError):
            m.save(4, state(4), persist=True)
        assert m.persist(4) is True  # waits for step 4's local commit first
        assert m.persist(4) is False  # queued already
        with pytest.raises(ValueError, match=r"persist\(2\): only this manager's newest save .* step 4"):
            m.persist(2)
        m.wait()
        assert [(int(s), s.tiers) for s in m.steps()] == [(2, ("local",)), (4, ("local", "durable"))]
    assert layout.committed_steps(open_storage(durable)) == [4]
    assert list(catalog.verify(open_storage(durable), 4)) == []
    got = blank()
    assert ckpt.CheckpointManager(durable).restore(got) == 4 and same(got, state(4))
    with ckpt.CheckpointManager(str(tmp_path / "one")) as m:  # one root: a committed step is durable already
        m.save(1, state(1))
        assert m.persist(1) is False


def test_restore_takes_the_newest_step_local_first_and_tells_the_tracker(tmp_path):
    durable, local = saved(tmp_path, [1, 2, 3], persist_every=1)
    tracker = Restores()
    with ckpt.CheckpointManager(durable, local=local, tracker=tracker) as m:
        got = blank()
        assert m.restore(got) == 3
    assert same(got, state(3))
    assert tracker.restored == [(3, "local")]


def test_lost_local_tier_restores_from_the_durable_tier_bitwise(tmp_path):
    durable, local = saved(tmp_path, [1, 2, 3, 4, 5], persist_every=2)
    shutil.rmtree(local)
    tracker = Restores()
    with ckpt.CheckpointManager(durable, local=local, tracker=tracker) as m:
        got = blank()
        assert m.restore(got) == 4
    assert same(got, state(4))
    assert tracker.restored == [(4, "durable")]


def test_a_step_committed_in_the_durable_tier_only_is_never_saved_again(tmp_path):
    """The local tier lost, the job resumes from durable step 4 and saves step 4 again: refused, as a single root
    refuses it. It was committed locally, so the tiers held two states of step 4 and the one a restore took
    depended on which tier survived."""
    durable, local = saved(tmp_path, [1, 2, 3, 4], persist_every=2)
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable, local=local, persist_every=2) as m:
        assert m.restore(blank()) == 4
        with pytest.raises(ckpt.StepExistsError, match=f"step 4 is already committed in {durable}; a committed"):
            m.save(4, state(5))
        m.save(5, state(5)).wait()
        assert [(int(s), s.tiers) for s in m.steps()] == [(2, ("durable",)), (4, ("durable",)), (5, ("local",))]
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable, local=local) as m:
        got = blank()
        assert m.restore(got, step=4) == 4
    assert same(got, state(4))


def test_a_step_this_manager_persisted_and_its_local_retention_dropped_is_never_saved_again(tmp_path):
    """The durable root is listed once per manager, not read at every save: a step this manager persisted itself
    (after that listing) and no longer holds locally (keep_local=1) is still refused."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with ckpt.CheckpointManager(durable, local=local, persist_every=1, keep_local=1) as m:
        for step in (1, 2, 3):
            m.save(step, state(step)).wait()
        assert layout.committed_steps(open_storage(local)) == [3]
        with pytest.raises(ckpt.StepExistsError, match=f"step 2 is already committed in {durable}; a committed"):
            m.save(2, state(5))
        m.save(4, state(4)).wait()


def test_a_save_below_a_newer_step_is_kept_by_both_tiers_retention(tmp_path):
    """Resumed with restore(step=3) while step 5 is committed in both tiers, a save of step 4 commits locally and is
    persisted; keep_local=1 and keep_last=1 each keep their newest (5) and the step just committed, in both tiers."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with ckpt.CheckpointManager(durable, local=local, persist_every=1) as m:
        for step in (1, 2, 3, 5):
            m.save(step, state(step))
    with ckpt.CheckpointManager(durable, local=local, persist_every=1, keep_local=1, keep_last=1) as m:
        assert m.restore(blank(), step=3) == 3
        m.save(4, state(4)).wait()
        m.wait()  # the persist and the durable retention after it
        assert [(int(s), s.tiers) for s in m.steps()] == [(4, ("local", "durable")), (5, ("local", "durable"))]
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable) as m:
        got = blank()
        assert m.restore(got, step=4) == 4
    assert same(got, state(4))


class _Raises:
    def keep(self, steps, metadata):
        raise RuntimeError("no metrics service")


def test_a_local_retention_that_fails_is_logged_and_the_save_still_commits(tmp_path, caplog):
    """A `local_retention` policy that raises failed every save with CheckpointWriteError (the tracker told of a
    failed checkpoint) although each step was committed in both tiers; as the durable retention does, it is logged."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    with ckpt.CheckpointManager(durable, local=local, persist_every=1, local_retention=_Raises()) as m:
        for step in (1, 2):
            m.save(step, state(step)).wait()
        m.wait()
        assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("local", "durable")), (2, ("local", "durable"))]
    assert "local retention in" in caplog.text and "no metrics service" in caplog.text


def test_damaged_local_step_falls_back_to_its_durable_copy_and_is_quarantined(tmp_path):
    durable, local = saved(tmp_path, [1, 2], persist_every=1)
    flip_byte(chunk(local, 2))
    tracker = Restores()
    with ckpt.CheckpointManager(durable, local=local, tracker=tracker) as m:
        got = blank()
        with pytest.warns(RuntimeWarning, match=r"step 2 in the local tier is damaged.*durable copy"):
            assert m.restore(got) == 2
        assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("local", "durable")), (2, ("durable",))]
    assert same(got, state(2))
    assert tracker.restored == [(2, "durable")]
    assert [q.step for q in catalog.quarantined(open_storage(local))] == [2]


def test_a_restore_beside_the_live_writer_of_the_local_tier_stands_and_deletes_none_of_its_steps(tmp_path):
    """An evaluation restores while the trainer holds the local tier: its newest step is damaged (and cannot be
    quarantined under the trainer's lease), so the restore takes step 1. Step 2 is the trainer's, not left behind
    by a killed attempt: it stays, and the restore, applied, returns instead of raising LeaseHeldError."""
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=100) as trainer:
        trainer.save(1, state(1))
        trainer.save(2, state(2)).wait()
        flip_byte(chunk(local, 2))
        with ckpt.CheckpointManager(durable, local=local, persist_every=100) as reader:
            got = blank()
            with pytest.warns(RuntimeWarning, match=r"step 2 in the local tier is damaged.*could not be quarantined"):
                assert reader.restore(got) == 1
            assert same(got, state(1))
        assert layout.committed_steps(open_storage(local)) == [1, 2]


def test_newer_local_step_wins_over_an_older_durable_one_and_damage_falls_back_to_the_older(tmp_path):
    durable, local = saved(tmp_path, [1, 2, 3], persist_every=2, keep_local=3)
    flip_byte(chunk(local, 3))
    with ckpt.CheckpointManager(durable, local=local) as m:
        got = blank()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert m.restore(got) == 2  # local step 2 (equal to the durable one: local first)
    assert same(got, state(2))


def test_the_newest_intact_step_wins_whichever_tier_holds_it(tmp_path, caplog):
    """No damage anywhere: a local step newer than every durable one is restored from the local tier, and a durable
    step newer than every local one from the durable tier."""
    durable, local = saved(tmp_path, [1, 2, 3], persist_every=2, keep_local=3)  # durable: 2; local: 1, 2, 3
    assert layout.committed_steps(open_storage(durable)) == [2]
    with caplog.at_level("INFO", logger="ckpt"), ckpt.CheckpointManager(durable, local=local) as m:
        got = blank()
        assert m.restore(got) == 3
    assert same(got, state(3)) and "(local tier)" in caplog.text
    caplog.clear()
    for s in (2, 3):  # the local tier now lags behind the durable one: only step 1 is left there
        shutil.rmtree(os.path.join(local, layout.step_dir(s)))
    with caplog.at_level("INFO", logger="ckpt"), ckpt.CheckpointManager(durable, local=local) as m:
        got = blank()
        assert m.restore(got) == 2
    assert same(got, state(2)) and "(durable tier)" in caplog.text


def test_a_persist_never_copies_a_damaged_local_file(tmp_path):
    durable, local = saved(tmp_path, [1], persist_every=5)  # nothing persisted
    flip_byte(chunk(local, 1))
    src, dst = open_storage(local), open_storage(durable)
    tensors = {k: v for k, v in state(1).items() if k != "meta"}
    plan, _, boxes = Planner().plan(Ranks.local(), tensors, 64 << 20, PACK_BYTES, every_holder=True)
    job = PersistJob(src, dst, 1, boxes, plan.durable, Ranks.local(), None)
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        job.run()
    assert layout.step_dirs(dst) == []  # nothing partial left behind


def test_restore_into_a_fresh_root_with_nothing_anywhere_returns_none(tmp_path):
    tracker = Restores()
    with ckpt.CheckpointManager(tmp_path / "d", local=tmp_path / "l", tracker=tracker) as m:
        assert m.restore(blank()) is None
        assert m.steps() == []
    assert tracker.restored == [(None, None)]


def test_local_tier_has_its_own_lease(tmp_path):
    with ckpt.CheckpointManager(tmp_path / "d", local=tmp_path / "l") as m:
        m.save(1, state(1)).wait()
        with ckpt.CheckpointManager(tmp_path / "d2", local=tmp_path / "l") as other:
            with pytest.raises(ckpt.LeaseHeldError):
                other.save(2, state(2))


def test_a_local_tier_that_is_the_durable_root_under_another_name_is_refused_at_once(tmp_path):
    """local= a link to the durable root: refused when the manager is made, naming both, not at the first save
    with a LeaseHeldError that names this very process as the live writer."""
    durable = tmp_path / "durable"
    durable.mkdir()
    (tmp_path / "link").symlink_to(durable)
    with pytest.raises(ValueError, match=f"the local tier {tmp_path}/link must not be the durable root {durable}$"):
        ckpt.CheckpointManager(durable, local=tmp_path / "link")


_PERSISTER = r"""
import sys, torch, ckpt
durable, local = sys.argv[1], sys.argv[2]
with ckpt.CheckpointManager(durable, local=local, persist_every=1, keep_local=3, chunk_bytes=4096) as m:
    for s in range(1, 1000):
        g = torch.Generator().manual_seed(s)
        m.save(s, {"w": torch.randn(1 << 18, generator=g)})
        print(s, flush=True)
"""


def test_sigkill_during_a_persist_leaves_no_partial_durable_step_and_a_valid_local_tier(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    script = tmp_path / "persister.py"
    script.write_text(_PERSISTER)
    proc = subprocess.Popen([sys.executable, str(script), durable, local], stdout=subprocess.PIPE, env=os.environ)

    def in_flight() -> list[int]:
        """Persists in flight once an earlier one committed: marked, some of their files copied, no manifest yet."""
        d = open_storage(durable)
        committed = layout.committed_steps(d)
        return [
            s
            for s in layout.step_dirs(d)
            if committed
            and s not in committed
            and os.path.exists(os.path.join(durable, layout.in_progress_path(s)))
            and any(
                os.path.isdir(os.path.join(durable, layout.data_path(s, x), "packs", "rank_00000", "c"))
                for x in layout.data_dirs(d, s)
            )
            and not layout.is_committed(d, s)
        ]

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if in_flight():  # stop the process, and kill it only if the persist is still in flight once stopped
                proc.send_signal(signal.SIGSTOP)
                partial = in_flight()
                if partial:
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.005)
        else:
            pytest.fail("never saw a persist in flight")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    d, lo = open_storage(durable), open_storage(local)
    assert set(partial) - set(layout.committed_steps(d))  # it died with a persist half done
    for root in (d, lo):
        for s in layout.committed_steps(root):
            assert list(catalog.verify(root, s)) == [], (root.url, s)
    newest = max(layout.committed_steps(lo) + layout.committed_steps(d))
    with ckpt.CheckpointManager(durable, local=local) as m:
        got = {"w": torch.zeros(1 << 18)}
        assert m.restore(got) == newest
        g = torch.Generator().manual_seed(newest)
        assert torch.equal(got["w"], torch.randn(1 << 18, generator=g))
        m.save(newest + 1, got).wait()  # both leases are free again
    assert not [e.step for e in catalog.entries(d) if not e.committed], "the next writer removed the half persist"


def test_the_next_writer_removes_what_kills_left_in_both_tiers(tmp_path):
    """A kill during each tier's retention left step 1 without its manifest, in the local tier and in the durable
    root: the next manager's first commit removes both (no `ckpt gc`); every committed step stays."""
    durable, local = saved(tmp_path, [1, 2], persist_every=1)
    for root in (durable, local):
        os.remove(os.path.join(root, layout.manifest_path(1)))
        assert [e.step for e in catalog.entries(open_storage(root)) if not e.committed] == [1]
    with ckpt.CheckpointManager(durable, local=local, persist_every=1) as m:
        got = blank()
        assert m.restore(got) == 2 and same(got, state(2))
        m.save(3, state(3)).wait()
    for root in (durable, local):
        assert [(e.step, e.committed) for e in catalog.entries(open_storage(root))] == [(2, True), (3, True)], root


def test_cli_ls_verify_gc_cover_both_tiers(tmp_path, capsys):
    from ckpt import cli

    durable, local = saved(tmp_path, [1, 2, 3], persist_every=2)
    assert cli.main(["ls", durable, "--local", local]) == 0
    out = capsys.readouterr().out
    durable_part, local_part = out.split(f"== local tier {local}")
    assert durable_part.startswith(f"== durable tier {durable}")
    assert [line.split()[0] for line in durable_part.splitlines()[2:]] == ["2"]
    assert [line.split()[0] for line in local_part.splitlines()[2:]] == ["2", "3"]

    flip_byte(chunk(local, 3))
    assert cli.main(["verify", "-q", durable, "--local", local]) == 1
    out = capsys.readouterr().out
    assert "step 2: ok" in out.split("== local tier")[0]
    assert "step 3: DAMAGED: placed tensor checksum (crc32c) mismatch" in out
    assert f"(step=3, key=w, file={chunk(local, 3)})" in out

    os.makedirs(os.path.join(local, layout.step_dir(9), "arrays"))  # a crashed local save's leftovers
    assert cli.main(["gc", durable, "--local", local]) == 0
    assert "removed incomplete step 9" in capsys.readouterr().out.split("== local tier")[1]
    assert layout.step_dirs(open_storage(local)) == [2, 3]


def test_cli_verify_of_a_step_only_a_local_tier_holds_verifies_it_there(tmp_path, capsys):
    """`verify --step 3 ROOT --local DIR` with persist_every=2 (step 3 in the local tier only) failed 'step 3 is not
    committed in ROOT' at the durable root, and the local tier that holds it was never checked; a tier without the
    step now says so and the others are verified; a step no tier holds is still the one-line error."""
    from ckpt import cli

    durable, local = saved(tmp_path, [1, 2, 3], persist_every=2)
    assert cli.main(["verify", "-q", "--step", "3", durable, "--local", local]) == 0
    durable_part, local_part = capsys.readouterr().out.split(f"== local tier {local}")
    assert "step 3: not committed in this tier (committed: [2])" in durable_part
    assert "step 3: ok" in local_part
    flip_byte(chunk(local, 3))
    assert cli.main(["verify", "-q", "--step", "3", durable, "--local", local]) == 1
    assert "step 3: DAMAGED" in capsys.readouterr().out
    assert cli.main(["verify", "-q", "--step", "7", durable, "--local", local]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: step 7 is not committed in any tier: {durable}: [2]; {local}: [2, 3]\n", err


def test_cli_gc_spares_a_replica_the_live_writer_of_its_local_tier_receives(tmp_path, capsys):
    """A peer's replica being received into the local tier (`_replica/rank_1/step_2`, marked in progress by the
    transfer's `begin_step`, which names no lease) is a live save of the local tier's writer: gc beside it removes
    nothing there (it removed the directory, and the replica then committed a manifest naming no files); once the
    writer is gone, gc removes it as a leftover."""
    from ckpt import cli
    from ckpt.save import begin_step
    from ckpt.storage import LocalStorage

    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    replica = LocalStorage(os.path.join(local, layout.replica_root(1)))
    with ckpt.CheckpointManager(durable, local=local, persist_every=1) as writer:
        writer.save(1, state(1)).wait()  # the writer holds the local tier's lease from here on
        begin_step(replica, 2, None)  # what `replica.transfer` does before it receives a step's files
        for dry in ([], ["--dry-run"]):
            assert cli.main(["gc", *dry, durable, "--local", local]) == 0
            out = capsys.readouterr().out.split("== replica of rank 1")[1]
            assert f"kept incomplete step 2: {local} is being written by a writer: pid {os.getpid()}" in out, out
        assert layout.step_dirs(replica) == [2]
    assert cli.main(["gc", durable, "--local", local]) == 0
    assert "removed incomplete step 2" in capsys.readouterr().out.split("== replica of rank 1")[1]
    assert layout.step_dirs(replica) == []


def held_persist(root, step: int) -> tuple[FaultStorage, threading.Event, threading.Event]:
    """A durable root whose persist of `step` waits at its first write (before it reads the local step) until `go`
    is set; `started` is set once it waits."""
    started, go = threading.Event(), threading.Event()

    def hold(path: str) -> bool:
        if path.startswith(layout.step_dir(step)) and not started.is_set():
            started.set()
            go.wait(120)
        return False

    return FaultStorage(open_storage(str(root)), fail_path=hold), started, go


def test_a_step_being_persisted_is_not_deleted_under_its_persist(tmp_path):
    """delete(2) while step 2 is being persisted is refused: deleting its local copy under the persist either failed
    the persist (an error at the next call) or let it finish and bring step 2 back, durable, after delete() had
    returned. Once persisted it is deleted from both tiers."""
    durable, started, go = held_persist(tmp_path / "durable", 2)
    with ckpt.CheckpointManager(durable, local=tmp_path / "local", persist_every=2, keep_local=3) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        m.save(3, state(3)).wait()
        assert started.wait(120)
        try:
            with pytest.raises(ValueError, match=f"step 2 is still being persisted to {durable.url}"):
                m.delete(2)
        finally:
            go.set()
        m.wait()
        m.delete(2)
        m.wait()
        assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("local",)), (3, ("local",))]
    assert layout.committed_steps(durable) == []


def test_a_persist_whose_local_manifest_is_gone_says_so(tmp_path):
    """The local step's manifest removed under its persist (by hand, a clean-up script) failed the persist with
    "manifest is not valid JSON": it reads as a step not committed there, naming the local tier."""
    durable, started, go = held_persist(tmp_path / "durable", 2)
    local = tmp_path / "local"
    with ckpt.CheckpointManager(durable, local=local, persist_every=2) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        assert started.wait(120)
        os.remove(local / layout.manifest_path(2))
        go.set()
        with pytest.raises(ckpt.CheckpointWriteError, match=f"step 2 is not committed in .*{local}") as e:
            m.wait()
        assert "not valid JSON" not in str(e.value)
    assert layout.committed_steps(durable) == []


def test_a_failed_persist_is_raised_by_the_next_call_and_the_local_step_stays(tmp_path):
    durable, local = tmp_path / "durable", str(tmp_path / "local")
    durable.mkdir()
    (durable / layout.step_dir(1)).write_text("in the way")  # the persist of step 1 cannot create its directory
    m = ckpt.CheckpointManager(durable, local=local, persist_every=1)
    m.save(1, state(1)).wait()  # committed locally
    with pytest.raises(ckpt.CheckpointWriteError, match=r"saving step 1 failed: .*persisting to"):
        m.wait()
    assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("local",))]
    m.close()
    assert list(catalog.verify(open_storage(local), 1)) == []


def test_a_local_tier_of_another_run_is_never_resumed(tmp_path):
    from ckpt import run

    durable, local = saved(tmp_path, [1, 2, 3], persist_every=2, run_id="first")
    run.claim(open_storage(durable), run.Run("second", "run_id"))  # the durable root was taken over by another run
    with ckpt.CheckpointManager(durable, local=local, run_id="second") as m:
        got = blank()
        assert m.restore(got) == 2  # its durable step, not the first run's local step 3
    assert same(got, state(2))


def test_a_new_run_never_restores_counts_or_deletes_another_runs_local_steps(tmp_path):
    """Run B starts with a durable root of its own and run A's local tier: A's local steps are not restored, not
    listed, not counted by B's local retention, and B's save into that tier is refused (no step written or deleted);
    run A still resumes from them."""
    local = str(tmp_path / "local")
    with ckpt.CheckpointManager(tmp_path / "a", local=local, persist_every=100, run_id="runA") as m:
        for s in (1, 2, 3):
            m.save(s, state(s)).wait()
    held = layout.committed_steps(open_storage(local))
    assert held == [2, 3]
    with ckpt.CheckpointManager(tmp_path / "b", local=local, persist_every=100, run_id="runB", keep_local=1) as m:
        got = blank()
        assert m.restore(got) is None and same(got, blank())
        assert m.steps() == [] and m.latest_step() is None
        with pytest.raises(ckpt.RunMismatchError, match=r"holds committed steps \[2, 3\] of run 'runA'.*no run"):
            m.save(1, state(1))
        with pytest.raises(ckpt.StepNotFoundError):
            m.delete(2)
    assert layout.committed_steps(open_storage(local)) == held
    assert json.loads(open(os.path.join(local, "run.json")).read())["id"] == "runA"
    assert layout.committed_steps(open_storage(str(tmp_path / "b"))) == []
    with ckpt.CheckpointManager(tmp_path / "a", local=local, run_id="runA") as m:  # A's restart: its local step 3
        got = blank()
        assert m.restore(got) == 3
    assert same(got, state(3))


def test_a_local_tier_whose_run_record_is_damaged_is_never_resumed_nor_written(tmp_path):
    """Run A's local tier, its run.json emptied (a power loss, bit rot): whose steps it holds cannot be told, so run B,
    with a durable root of its own, restores its durable step, not A's local one, and its save there is refused
    naming the damaged file; A's steps stay."""
    local = str(tmp_path / "local")
    with ckpt.CheckpointManager(tmp_path / "a", local=local, persist_every=100, run_id="runA") as m:
        m.save(5, state(5)).wait()
    with ckpt.CheckpointManager(tmp_path / "b", local=tmp_path / "b_local", persist_every=1, run_id="runB") as m:
        m.save(1, state(1)).wait()
    record = os.path.join(local, "run.json")
    open(record, "w").close()
    with ckpt.CheckpointManager(tmp_path / "b", local=local, persist_every=1, run_id="runB") as m:
        got = blank()
        assert m.restore(got) == 1
        assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("durable",))]
        with pytest.raises(
            ckpt.RunMismatchError, match=rf"holds committed steps \[5\] of a run its damaged record.*{record}"
        ):
            m.save(2, state(2))
    assert same(got, state(1))
    assert layout.committed_steps(open_storage(local)) == [5]


def test_a_restart_without_a_run_id_resumes_its_own_local_steps(tmp_path, monkeypatch):
    """Without run_id= nor a launcher's id every process draws a new id: its local tier is still its own, being of
    the run its durable root records."""
    for var in ("CKPT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    durable, local = saved(tmp_path, [1, 2, 3], persist_every=2)
    with ckpt.CheckpointManager(durable, local=local) as m:
        got = blank()
        assert m.restore(got) == 3
        assert [(int(s), s.tiers) for s in m.steps()] == [(2, ("local", "durable")), (3, ("local",))]
        m.save(4, state(4)).wait()
    assert same(got, state(3))


@pytest.mark.parametrize("died", ["before its first commit", "before the durable root recorded it"])
def test_an_attempt_killed_between_recording_its_run_in_the_two_tiers_leaves_a_restart_that_resumes(tmp_path, died):
    """Run A's local steps; attempt B (an id of its own: no launcher's) recorded itself in the local tier and died
    before its first step committed, or before the durable root recorded it: the next attempt resumes the newest
    local step and saves, as the same job. A new job's local tier whose durable root records no run yet is its own."""
    local, durable = str(tmp_path / "local"), str(tmp_path / "d")
    with ckpt.CheckpointManager(durable, local=local, persist_every=100, run_id="A") as m:
        for s in (1, 2, 3):
            m.save(s, state(s)).wait()
    run_mod.claim(open_storage(local), run_mod.Run("B", "generated"), durable=os.path.abspath(durable))
    newest = 3
    if died == "before the durable root recorded it":  # B's step 4 committed in the local tier only
        with ckpt.CheckpointManager(local, run_id="B") as m:
            m.save(4, state(4)).wait()
        newest = 4
    assert run_mod.lineage(open_storage(local)) == ["B", "A"] and run_mod.lineage(open_storage(durable)) == ["A"]
    with ckpt.CheckpointManager(durable, local=local, run_id="C") as m:
        got = blank()
        assert m.restore(got) == newest
        m.save(5, state(5)).wait()
    assert same(got, state(newest))
    assert run_mod.lineage(open_storage(local))[:3] == ["C", "B", "A"]
    assert run_mod.lineage(open_storage(durable))[:2] == ["C", "A"]
    fresh_local, fresh_durable = str(tmp_path / "l2"), str(tmp_path / "d2")
    run_mod.claim(open_storage(fresh_local), run_mod.Run("D", "generated"), durable=os.path.abspath(fresh_durable))
    with ckpt.CheckpointManager(fresh_local, run_id="D") as m:  # a new job's first step, in its local tier only
        m.save(1, state(1)).wait()
    with ckpt.CheckpointManager(fresh_durable, local=fresh_local, run_id="E") as m:
        assert m.restore(blank()) == 1
        m.save(2, state(2)).wait()


def test_the_durable_tier_can_be_an_object_store(tmp_path):
    durable, local = "memory://tiers-object-store/run", str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=2) as m:
        for s in (1, 2, 3):
            m.save(s, state(s)).wait()
        m.wait()
        assert [(int(s), s.tiers) for s in m.steps()] == [(2, ("local", "durable")), (3, ("local",))]
        assert list(catalog.verify(m.storage, 2)) == []
    shutil.rmtree(local)
    with ckpt.CheckpointManager(durable, local=local) as m:
        got = blank()
        assert m.restore(got) == 2
    assert same(got, state(2))


def test_file_urls_name_the_directory_of_this_machine_or_are_refused(tmp_path, monkeypatch):
    """file://localhost/PATH is /PATH, for either tier; file://mnt/ckpt (two slashes) names a host: refused, where it
    was the directory mnt/ckpt under the working directory, so a restart from another one found nothing; and
    file://localhost alone names no directory (it was "/")."""
    monkeypatch.chdir(tmp_path)
    durable, local = f"file://localhost{tmp_path}/durable", f"file://localhost{tmp_path}/local"
    with ckpt.CheckpointManager(durable, local=local, persist_every=1) as m:
        m.save(1, state(1)).wait()
        m.wait()
        assert (m.storage.url, m.local_root) == (str(tmp_path / "durable"), str(tmp_path / "local"))
    assert [layout.committed_steps(open_storage(str(tmp_path / d))) for d in ("durable", "local")] == [[1], [1]]
    for root, tier in (("file://mnt/ckpt", str(tmp_path / "l")), (str(tmp_path / "d"), "file://nvme/ckpt/{rank}")):
        with pytest.raises(ValueError, match="names the host '(mnt|nvme)': a directory of this machine is file:///"):
            ckpt.CheckpointManager(root, local=tier)
    # file://localhost with no path was "/": a save wrote step_00000001/, run.json and _LEASE into the file system's root
    for root, tier in (("file://localhost", str(tmp_path / "l")), (str(tmp_path / "d"), "local://localhost")):
        with pytest.raises(
            ValueError, match="'(file|local)://localhost' names no directory: .*localhost/PATH is /PATH"
        ):
            ckpt.CheckpointManager(root, local=tier)
    assert sorted(os.listdir(tmp_path)) == ["durable", "local"]


def test_save_with_persist_true_makes_that_step_durable_and_false_keeps_it_local(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=2) as m:
        m.save(1, state(1), persist=True).wait()  # the last save before a preemption
        m.save(2, state(2), persist=False).wait()  # the K-th, but not this time
        m.wait()
        assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("local", "durable")), (2, ("local",))]


def test_an_attempt_restored_from_a_local_step_the_durable_tier_lacks_persists_its_first_save(tmp_path):
    """persist_every counts each manager's saves: without this, jobs that crash before their K-th save never persist."""
    durable, local = saved(tmp_path, [1, 2], persist_every=3)  # an attempt dies before its 3rd save: nothing durable
    with ckpt.CheckpointManager(durable, local=local, persist_every=3) as m:
        got = blank()
        assert m.restore(got) == 2
        for s in range(3, 7):
            m.save(s, state(s)).wait()
            m.wait()
    assert layout.committed_steps(open_storage(durable)) == [3, 6]  # the first save, then every 3rd after it
    with ckpt.CheckpointManager(durable, local=local, persist_every=3) as m:
        assert m.restore(blank()) == 6  # local, and durable too: the counting starts afresh
        for s in range(7, 10):
            m.save(s, state(s)).wait()
    assert layout.committed_steps(open_storage(durable)) == [3, 6, 9]


@pytest.mark.parametrize(
    "local, world, offset",
    [("4", 8, 4), ("4", 4, 1), (None, 8, 1), ("", 8, 1), ("0", 8, 1), ("four", 8, 1)],
)
def test_the_default_replica_goes_to_the_same_local_rank_of_the_next_node(monkeypatch, local, world, offset):
    # one node (or LOCAL_WORLD_SIZE unset or unreadable): the next rank, never rank + 0 (itself) or a crash
    from ckpt.tiers import default_offset

    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert default_offset(world) == offset


def test_a_roll_back_covers_the_local_tier_and_refuses_a_damaged_step_to_resume_from(tmp_path):
    """Durable 2, 4, 6, 8, 10 and local 9, 10: `ckpt rollback --to 4 --local` checked each tier alone, failed on the
    local one (nothing there at or before 4) after deleting the durable steps, and the next resume took local step
    10. The tiers are judged together now, newest step first, and the resume takes 4. Rolling back to a step that is
    damaged deletes nothing (it deleted the intact newer steps, and the resume fell back further)."""
    root, local = tmp_path / "root", tmp_path / "local"
    with ckpt.CheckpointManager(root, local=local, persist_every=2, keep_local=2) as m:
        for step in range(1, 11):
            m.save(step, {"x": torch.full((4,), float(step))}, persist=step % 2 == 0)
        m.wait()
        assert [(int(s), s.tiers) for s in m.steps()][-2:] == [(9, ("local",)), (10, ("local", "durable"))]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    rollback = [sys.executable, "-m", "ckpt", "rollback", str(root), "--local", str(local)]
    dry = subprocess.run([*rollback, "--to", "4", "--dry-run"], capture_output=True, text=True, env=env)
    assert dry.returncode == 0 and dry.stdout.count("would remove") == 5, dry
    store = open_storage(str(root))
    chunk = next(p for p in (root / "step_00000002").rglob("*") if p.is_file() and p.name == "0")  # a pack's file
    chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 1]) + chunk.read_bytes()[1:])
    refused = subprocess.run([*rollback, "--to", "3"], capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and "step 2, which a roll back to step 3 resumes from, is damaged" in refused.stderr
    assert "nothing was deleted" in refused.stderr and layout.committed_steps(store)[-1] == 10
    done = subprocess.run([*rollback, "--to", "4"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done
    assert done.stdout.splitlines()[:3] == [
        f"removed committed step 10 from the durable tier {root}",
        f"removed committed step 10 from the local tier {local}",
        f"removed committed step 9 from the local tier {local}",
    ], done.stdout
    state = {"x": torch.zeros(4)}
    with ckpt.CheckpointManager(root, local=local, persist_every=2, keep_local=2) as m:
        assert m.restore(state) == 4 and torch.equal(state["x"], torch.full((4,), 4.0))
        m.save(5, {"x": torch.ones(4)}).wait()  # the numbers after 4 are free again


def test_the_next_writer_removes_a_replica_a_kill_left_half_received(tmp_path):
    """A rank killed while its peer's step 2 was being received into `_replica/rank_1/` (marked in progress, some files
    written, no manifest) left a step's worth of disk there: the next manager's first commit removes it, as it does
    the local tier's own leftovers; the replica's committed step stays."""
    from ckpt.save import begin_step
    from ckpt.storage import LocalStorage

    durable, local = saved(tmp_path, [1], persist_every=1)
    replica = LocalStorage(os.path.join(local, layout.replica_root(1)))
    shutil.copytree(os.path.join(local, layout.step_dir(1)), os.path.join(replica.root, layout.step_dir(1)))
    begin_step(replica, 2, None)  # what `replica.transfer` does before it receives a step's files
    replica.write_atomic(f"{layout.step_dir(2)}/some_file", b"x" * 1000)
    with ckpt.CheckpointManager(durable, local=local, persist_every=1) as m:
        m.save(3, state(3)).wait()
    assert [(e.step, e.committed) for e in catalog.entries(replica)] == [(1, True)]


def test_a_durable_root_removed_under_the_writer_is_named_as_gone_and_the_local_steps_stay(tmp_path):
    """The durable root deleted while the job runs (its file system unmounted, a clean-up script): the next save is
    refused by the lease check, which said the root's lease was "now held by an unknown process (its lease names no
    holder yet)", sending the user after another writer; it says the lease file and the root are gone."""
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    m = ckpt.CheckpointManager(durable, local=local, persist_every=2)
    for s in (1, 2, 3):
        m.save(s, state(s)).wait()
    m.wait()
    shutil.rmtree(durable)
    with pytest.raises(
        ckpt.LeaseHeldError, match=f"lease file {durable}/_LEASE was removed .*the root {durable} itself"
    ) as e:
        m.save(4, state(4))
    assert "unknown process" not in str(e.value)
    with contextlib.suppress(ckpt.LeaseHeldError):
        m.close()
    assert layout.committed_steps(open_storage(local)) == [2, 3]  # keep_local=2


def test_persist_after_a_failed_persist_of_that_step_retries_it(tmp_path):
    """The persist of step 1 failed (its durable root refused a write once) and wait() raised it; persist(1) then
    returned False, as for a step persisted already, and step 1 stayed in the local tier only: now it persists it."""
    durable = FaultStorage(open_storage(str(tmp_path / "durable")), fail_path=lambda p: p.startswith("step_"))
    with ckpt.CheckpointManager(durable, local=tmp_path / "local", persist_every=5) as m:
        m.save(1, state(1), persist=True)
        with pytest.raises(ckpt.CheckpointWriteError, match="saving step 1 failed: .*persisting to .*injected fault"):
            m.wait()
        assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("local",))]
        assert m.persist(1) is True
        m.wait()
        assert m.persist(1) is False  # persisted now
        assert [(int(s), s.tiers) for s in m.steps()] == [(1, ("local", "durable"))]
    with ckpt.CheckpointManager(tmp_path / "durable") as m:  # the durable copy by itself, bitwise
        got = blank()
        assert m.restore(got) == 1 and same(got, state(1))


def test_metadata_of_a_step_whose_local_manifest_is_damaged_is_read_from_its_durable_copy(tmp_path):
    """metadata(2) raised CorruptCheckpointError for the damaged local manifest while the durable copy was intact (a
    restore falls back to it); a step only in the local tier still names its damage."""
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=2, keep_local=3) as m:
        for s in (1, 2, 3):
            m.save(s, state(s), metadata={"loss": s / 10}).wait()
    for s in (2, 3):
        with open(os.path.join(local, layout.manifest_path(s)), "w") as f:
            f.write("{damaged")
    with ckpt.CheckpointManager(durable, local=local, persist_every=2) as m:
        assert [(int(s), s.tiers) for s in m.steps()][1:] == [(2, ("local", "durable")), (3, ("local",))]
        assert m.metadata(2) == {"loss": 0.2}
        assert m.metadata(1) == {"loss": 0.1}
        with pytest.raises(CorruptCheckpointError, match=f"manifest is not valid JSON.*{local}/step_00000003"):
            m.metadata(3)
        with pytest.raises(ckpt.StepNotFoundError):
            m.metadata(4)


def test_a_local_step_a_rank_lacks_without_a_replica_is_passed_over_saying_why(caplog):
    """Rank 1 lost step 3 and no peer kept its replica: the restore took step 2 and logged only that it deleted the
    other ranks' step 3, never why it had not restored it; now it names the rank and what it tries instead."""
    from ckpt.target import DURABLE, LOCAL, Source
    from ckpt.tiers import restore_order

    inventories = [{"local": [2, 3], "replica": {"1": [2]}}, {"local": [2], "replica": {"0": [2, 3]}}]
    with caplog.at_level("WARNING", logger="ckpt"):
        assert restore_order([2], inventories) == [Source(2, LOCAL, {}), Source(2, DURABLE)]
    assert caplog.messages == [
        "step 3 is not restored from the local tiers: rank 1 holds no copy of it and no peer keeps a replica of it "
        "(a lost local tier, or an attempt killed before every rank committed it); trying an older step"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckpt"):
        assert restore_order([2, 3], inventories)[:1] == [Source(3, DURABLE)]
    assert caplog.messages[0].endswith(
        "rank 1 holds no copy of it and no peer keeps a replica of it (a lost local "
        "tier, or an attempt killed before every rank committed it); trying its durable copy"
    )


def test_a_long_run_with_a_local_tier_caches_the_metadata_of_the_durable_steps_only(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with ckpt.CheckpointManager(durable, local=local, persist_every=4, keep_local=2, keep_last=2) as m:
        for s in range(1, 41):
            m.save(s, state(s), metadata={"loss": float(s)})
        m.wait()
        # 40 saves, 10 persisted, 2 kept there: the retention's cache is not one entry per save
        assert set(m._metadata) <= {36, 37, 38, 39, 40}, sorted(m._metadata)
    with ckpt.CheckpointManager(str(tmp_path / "all")) as m:  # no retention: nothing reads a cache
        for s in range(1, 6):
            m.save(s, state(s), metadata={"loss": float(s)})
        m.wait()
        assert m._metadata == {}
