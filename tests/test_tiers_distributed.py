"""The peer replica with 4 gloo ranks on 127.0.0.1, each with its own local tier: a lost local tier comes back
bitwise from its peer's replica without the durable tier; two adjacent lost tiers fall back to the durable tier."""

import os
import re
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import pytest  # noqa: E402
import torch  # noqa: E402

import ckpt  # noqa: E402
import tiers_worker  # noqa: E402
from ckpt import catalog, cli, layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from test_distributed import _ok, run_ranks  # noqa: E402


def _restored(results) -> list[tuple[int, str, bool]]:
    out = []
    for r in results:
        found = re.findall(r"restored (\d+) tier (\w+) bitwise (\w+)", r.stdout)  # the log of the latest run is last
        assert found, r.stdout[-3000:]
        step, tier, ok = found[-1]
        out.append((int(step), tier, ok == "True"))
    return out


def _data_files(root: str, step: int) -> dict[str, int]:
    """The data files of a committed step by the array or pack directory that holds them (zarr.json left out)."""
    storage = open_storage(root)
    data = os.path.join(root, layout.data_path(step, layout.read_manifest(storage, step).data))
    out: dict[str, int] = {}
    for dirpath, _, names in os.walk(data):
        for name in names:
            if name != "zarr.json":
                top = os.path.relpath(dirpath, data).split(os.sep)[:2]
                out["/".join(top)] = out.get("/".join(top), 0) + 1
    return out


def test_lost_local_tier_comes_back_from_the_peer_and_two_lost_fall_back_to_durable(tmp_path, capsys):
    root = str(tmp_path)
    _ok(run_ranks(4, "save", root, worker=tiers_worker))
    durable = open_storage(os.path.join(root, "durable"))
    assert layout.committed_steps(durable) == [2]
    assert list(catalog.verify(durable, 2)) == []  # the ranks' persisted regions make the whole step
    # a pack per rank in both tiers (issue 25): the local one with the replicated table too, the durable one with
    # each box once, by its designated writer
    files = _data_files(os.path.join(root, "durable"), 2)
    assert set(files) <= {f"packs/rank_{r:05d}" for r in range(4)} and all(n <= 4 for n in files.values()), files
    for r in range(4):
        assert _data_files(os.path.join(root, f"local{r}"), 2) == {f"packs/rank_{r:05d}": 1}
    for r in range(4):
        local = open_storage(os.path.join(root, f"local{r}"))
        assert layout.committed_steps(local) == [2, 3]
        assert layout.replica_ranks(local) == [(r - 1) % 4]  # the ring: rank r keeps rank r-1's steps
        assert layout.committed_steps(
            open_storage(os.path.join(root, f"local{r}", layout.replica_root((r - 1) % 4)))
        ) == [2, 3]

    assert cli.main(["ls", os.path.join(root, "durable"), "--local", os.path.join(root, "local2")]) == 0
    assert f"== replica of rank 1 in {os.path.join(root, 'local2')}" in capsys.readouterr().out

    # each local tier and peer replica holds its rank's boxes only: verify checks those (a false "zarr.json is
    # missing" of the other ranks' packs made verify fail and rollback refuse), and still finds damage in them
    tiers = [a for r in range(4) for a in ("--local", os.path.join(root, f"local{r}"))]
    assert cli.main(["verify", "-q", os.path.join(root, "durable"), *tiers]) == 0, capsys.readouterr().out
    assert "DAMAGED" not in capsys.readouterr().out
    assert cli.main(["rollback", os.path.join(root, "durable"), "--to", "2", "--dry-run", *tiers]) == 0
    assert capsys.readouterr().out.count("would remove committed step 3") == 8  # 4 local tiers, 4 replicas
    copy = os.path.join(root, "copy")
    shutil.copytree(os.path.join(root, "local3"), copy)
    copied = open_storage(copy)
    pack = os.path.join(copy, layout.pack_path(3, "rank_00003", layout.read_manifest(copied, 3).data), "c", "0")
    with open(pack, "r+b") as f:
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 1]))
    problems = list(catalog.verify(copied, 3))
    assert len(problems) == 1 and problems[0].file.endswith(pack.removeprefix(copy)), problems
    shutil.rmtree(copy)

    results = run_ranks(2, "restore", root, worker=tiers_worker)  # at another world size: the local copies do not fit
    _ok(results)
    assert _restored(results) == [(2, "durable", True)] * 2
    assert not os.path.exists(os.path.join(root, "local0", layout.QUARANTINE))  # and are no damage

    shutil.rmtree(os.path.join(root, "local1"))  # node 1 is lost
    durable_files = sorted(os.listdir(os.path.join(root, "durable")))
    results = run_ranks(4, "restore", root, worker=tiers_worker)
    _ok(results)
    assert _restored(results) == [(3, "local", True), (3, "peer", True), (3, "local", True), (3, "local", True)]
    assert sorted(os.listdir(os.path.join(root, "durable"))) == durable_files  # the durable tier was not touched

    shutil.rmtree(os.path.join(root, "local1"))
    shutil.rmtree(os.path.join(root, "local2"))  # rank 1's replica was on rank 2: both copies of its shard gone
    results = run_ranks(4, "restore", root, worker=tiers_worker)
    _ok(results)
    assert _restored(results) == [(2, "durable", True)] * 4


def test_steps_an_attempt_left_on_some_ranks_only_are_dropped_and_saved_again(tmp_path):
    root = str(tmp_path)
    _ok(run_ranks(4, "save", root, worker=tiers_worker))
    shutil.rmtree(os.path.join(root, "local1"))  # node 1 lost: rank 1's step 3 is gone, and its replica of it too
    catalog.delete_step(open_storage(os.path.join(root, "local2", layout.replica_root(1))), 3)
    results = run_ranks(4, "resume", root, worker=tiers_worker)
    _ok(results)
    assert _restored(results) == [(2, "local", True), (2, "peer", True), (2, "local", True), (2, "local", True)]
    assert all("saved 3" in r.stdout for r in results)  # not StepExistsError: the other ranks' step 3 was dropped
    for r in range(4):
        assert layout.committed_steps(open_storage(os.path.join(root, f"local{r}"))) == [2, 3]


def test_local_copies_of_another_sharding_are_skipped_not_quarantined(tmp_path):
    """A restore whose shards are not those saved (the same world size, columns instead of rows) reads the durable
    copy: the local tiers' copies lack its regions, which is no damage. They were quarantined as damaged ("chunk file
    is missing"), as every step was by a single process given one rank's local tier as its root, which now says what
    the directory is, as ckpt.load does."""
    root = str(tmp_path)
    _ok(run_ranks(2, "save", root, worker=tiers_worker))
    local0 = os.path.join(root, "local0")
    target = {"shard": torch.zeros(8, 16), "table": torch.zeros(300), "step": 0}
    with pytest.raises(ckpt.CheckpointError, match=r"step 2 here is one rank's own copy of a 2-rank save .* 'shard'"):
        with ckpt.CheckpointManager(local0) as m:
            m.restore(target)
    with pytest.raises(ckpt.CheckpointError, match=r"holds the region \[\[0, 4\], \[0, 16\]\]"):
        ckpt.load(local0, step=3)
    assert layout.committed_steps(open_storage(local0)) == [2, 3] and torch.equal(target["shard"], torch.zeros(8, 16))

    results = run_ranks(2, "reshard", root, worker=tiers_worker)
    _ok(results)
    assert _restored(results) == [(2, "durable", True)] * 2
    assert all("not restoring in the local tier: step 3 here is one rank's own copy" in r.stdout for r in results)
    for r in range(2):  # no damage: nothing quarantined; step 3, newer than the step resumed, dropped as a resume does
        local = os.path.join(root, f"local{r}")
        assert not os.path.exists(os.path.join(local, layout.QUARANTINE))
        assert layout.committed_steps(open_storage(local)) == [2]
    assert _restored(run_ranks(2, "restore", root, worker=tiers_worker)) == [(2, "local", True)] * 2


def test_a_resume_at_another_world_size_drops_the_newer_local_steps_of_the_old_one_and_saves_them_again(tmp_path):
    """Saved at 2 ranks (step 2 durable, step 3 local only), resumed at 1 rank: the local copies do not fit, so the
    job resumes from the durable step 2, and its save of step 3 is not refused by the old world size's step 3."""
    root = str(tmp_path)
    _ok(run_ranks(2, "save", root, worker=tiers_worker))
    results = run_ranks(1, "resume", root, worker=tiers_worker)
    _ok(results)
    assert _restored(results) == [(2, "durable", True)]
    assert "saved 3" in results[0].stdout
    local = open_storage(os.path.join(root, "local0"))
    assert layout.committed_steps(local) == [2, 3] and layout.read_manifest(local, 3).world_size == 1
