"""Sharded save across gloo ranks on 127.0.0.1 and restore at any world size, bitwise."""

import multiprocessing
import os
import re
import socket
import sys
from dataclasses import dataclass

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import dist_worker  # noqa: E402

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed.fsdp", "ckpt", "dist_worker", "tiers_worker"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    returncode: int
    stdout: str


def run_ranks(world: int, mode: str, root: str, timeout: float = 240, worker=dist_worker) -> list[RankResult]:
    """Start `world` rank processes (forked from a torch-preloaded server) running `worker.run`, and wait for all."""
    port = _free_port()
    logs = [f"{root}.{mode}.{world}.rank{r}.log" for r in range(world)]
    procs = [_CTX.Process(target=worker.run, args=(mode, root, r, world, port, logs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.exitcode is None:
            for q in procs:
                q.kill()
            raise TimeoutError(f"rank did not finish in {timeout}s: {open(logs[procs.index(p)]).read()[-3000:]}")
    return [RankResult(p.exitcode, open(log).read()) for p, log in zip(procs, logs)]


def _ok(results):
    for r in results:
        assert r.returncode == 0, f"rank failed ({r.returncode}):\n{r.stdout[-3000:]}"


@pytest.mark.parametrize("save_world", [2, 4])
def test_fsdp2_save_then_restore_at_1_2_4_ranks(tmp_path, save_world):
    root = str(tmp_path / "ck")
    _ok(run_ranks(save_world, "save", root))
    for world in (1, 2, 4):
        results = run_ranks(world, "restore", root)
        _ok(results)
        assert all("mismatched []" in r.stdout for r in results)
    # replicated tensors are written once: bytes on disk within 5% of the unique bytes
    from ckpt import layout
    from ckpt.storage import open_storage

    storage = open_storage(root)
    manifest = layout.read_manifest(storage, 2)
    unique = sum(a.nbytes for a in manifest.arrays.values())
    on_disk = storage.size("step_00000002")
    assert manifest.world_size == save_world
    assert unique <= on_disk <= unique * 1.05, (unique, on_disk)
    rng = manifest.tree["rng"]["$per_rank"]
    assert sorted(r for r, _ in rng) == list(range(save_world))
    # each rank placed the boxes it writes (its RNG state, restored bitwise above; its shard of each sharded array)
    # in a pack of its own: at most 4 data files per rank, whatever the number of tensors
    assert sorted(manifest.packs) == [f"rank_{r:05d}" for r in range(save_world)]
    for name, info in manifest.arrays.items():
        if name.startswith("rng/rank_"):
            assert info.places == ((f"rank_{int(name.split('/')[1][5:]):05d}", info.places[0][1]),), name
        if name.startswith("model/"):
            assert [p for p, _ in info.places] == [f"rank_{r:05d}" for r in range(save_world)], name
    data = [f for d, _, fs in os.walk(os.path.join(root, "step_00000002")) for f in fs if "/c" in d]
    assert len(data) <= 4 * save_world, data


def test_adam_over_a_head_of_one_row_saves_at_2_ranks_and_restores_at_3(tmp_path):
    """FSDP2 gives rank 1 of 2 no row of a (1, 40) head: its two Adam moments there are empty shards, with the same
    (null) address, and were taken for one tied tensor, so the save failed on every rank ('the ranks' states differ
    in their keys'); they are two arrays, restored bitwise at world size 3."""
    root = str(tmp_path / "ck")
    _ok(run_ranks(2, "head1_save", root, timeout=120))
    _restored(run_ranks(3, "head1_restore", root, timeout=120), 1)


def test_a_dtensor_with_a_partial_placement_is_refused_by_save_and_restore_naming_the_key(tmp_path):
    """A Partial DTensor (a sum still to be reduced: ranks hold 1 and 2 of a 3) was saved as one rank's term (read
    back as 2) and restored into as if replicated (the sum became 6); both now refuse it, naming the key."""
    results = run_ranks(2, "partial", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    for rank, r in enumerate(results):
        assert "save refused: DTensor at key 'p' has placements (Partial(sum),)" in r.stdout, r.stdout[-3000:]
        assert "restore refused: restore of key 'p': the target DTensor has placements (Partial(sum),)" in r.stdout
        assert f"local part {[rank + 1.0] * 3}" in r.stdout, r.stdout[-3000:]


def test_a_plan_is_agreed_once_and_again_only_when_the_states_structure_changes(tmp_path):
    """Saves of an unchanged state reuse the first save's plan (no gather of every tensor's description); a new
    tensor or a new shape on any rank is planned again, and the checkpoint holds it."""
    results = run_ranks(2, "replan", str(tmp_path / "ck"))
    _ok(results)
    for r in results:
        assert "agreements [1, 1, 1, 2, 3]" in r.stdout, r.stdout[-2000:]
    assert all(f"restored 5: mismatched [], extra {list(map(float, range(12)))}" in r.stdout for r in results), results


def test_a_key_that_is_no_utf8_saves_and_restores_at_2_ranks(tmp_path):
    """A key holding a lone surrogate (os.fsdecode's of a file name's bytes that are not UTF-8): the digest of the
    state's structure the ranks compare failed with a UnicodeEncodeError on every rank."""
    results = run_ranks(2, "odd_keys", str(tmp_path / "ck"))
    _ok(results)
    assert all("restored 1: [1.0, 1.0] 3" in r.stdout for r in results), [r.stdout[-2000:] for r in results]


def test_a_closed_manager_gives_its_process_groups_back(tmp_path):
    """Each manager talks through gloo groups of its own (a second one for a local tier's persists): `close`
    destroys them, so an evaluation sweep that opens a manager per checkpoint does not run out of file descriptors
    (each group held ~5 and 3 threads a rank, for the life of the process)."""
    results = run_ranks(2, "sweep", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    grown = [int(re.search(r"fds grew (-?\d+) over 10 managers", r.stdout).group(1)) for r in results]
    assert all(n < 5 for n in grown), grown


def test_a_delete_is_rank_0s_alone_on_the_shared_root(tmp_path):
    """A root has one writer: rank 1's delete (it holds no lease) never touches the shared root; a delete every rank
    calls is made once, by rank 0, and every rank then sees it, also when rank 1 calls it after rank 0 deleted it."""
    results = run_ranks(2, "delete", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    for r in results:
        assert "after rank 1 deleted step 1: [1, 2, 3]" in r.stdout, r.stdout[-2000:]
        assert "after every rank deleted step 2: [1, 3]" in r.stdout, r.stdout[-2000:]


def test_a_save_one_rank_cannot_make_fails_on_every_rank_and_the_next_one_commits(tmp_path):
    """Rank 1's metadata is not JSON: it raises its TypeError, rank 0 a CheckpointWriteError naming it, and neither
    takes rank 1's next save for this one; saves of different steps (or persist=), or of states with different keys,
    on different ranks fail everywhere, and so do samplers at different positions (rank 0's alone was committed)."""
    results = run_ranks(2, "refused", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    zero, one = (r.stdout for r in results)
    assert (
        "save 2 refused: CheckpointWriteError: saving step 2 failed: RuntimeError: rank 1: TypeError: metadata" in zero
    )
    assert "save 2 refused: TypeError: metadata" in one
    assert "save 4 refused: CheckpointWriteError" in zero and "save 5 refused: CheckpointWriteError" in one
    assert "different steps (rank 0: 4, rank 1: 5)" in zero
    assert "save 7 refused: ranks disagree on tensor 'odd'" in zero and "save 7 refused: rank 0 could not plan" in one
    assert all("steps [1, 3, 6, 8]" in r.stdout for r in results), results  # 8: an RNG state on rank 0 alone
    for key in ("'ema (tensor ema)'", "'note (value)'"):  # was committed without it, its array unreferenced
        assert all(
            f"save 9 refused: saving step 9 failed: RuntimeError: the ranks' states differ in their keys (against rank "
            f"0's: rank 1 has {key})" in r.stdout
            for r in results
        ), results
    for r in results:  # rank 1 one batch ahead, named with both positions: rank 0's alone was committed
        assert "save 10 refused: saving step 10 failed: RuntimeError: the ranks' states differ" in r.stdout, r.stdout
        for what, position in (("has", '"step": 3, "t": 12'), ("lacks", '"step": 2, "t": 8')):
            assert re.search(f'rank 1 {what} \'sampler = {{"[$]state": "ShuffledSampler"[^\']*{position}', r.stdout)
    assert all("different persist= (rank 0: True, rank 1: False)" in r.stdout for r in results), results
    assert all("tiered steps [2]" in r.stdout for r in results), results


def test_a_save_that_fails_on_one_rank_after_its_plan_fails_on_every_rank_at_once(tmp_path):
    """Rank 1 cannot allocate its snapshot, then rank 0 cannot write the step's in-progress marker: each rank raises
    at once (none waits for the other until the collective timeout, or finds the group broken after it), the others
    naming the rank that failed and why, and the next save commits."""
    results = run_ranks(2, "unbegun", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    zero, one = (r.stdout for r in results)
    short = "MemoryError: could not allocate 268435456 bytes (256.0 MiB) of host memory for the staging arena"
    assert f"save 2 refused: saving step 2 failed: RuntimeError: rank 1: {short}" in zero, zero
    assert f"save 2 refused: saving step 2 failed: {short}" in one, one
    assert "save 3 refused: saving step 3 failed: InjectedFault: injected fault: write 3 of step_00000003/" in zero, (
        zero
    )
    assert "save 3 refused: saving step 3 failed: RuntimeError: rank 0 could not begin writing step 3: " in one, one
    assert all("save 4 ok" in r.stdout and "steps [1, 4]" in r.stdout for r in results), results


def test_a_root_that_cannot_be_created_fails_the_first_save_on_every_rank_at_once(tmp_path):
    """A root made uncreatable after the managers were: rank 0 raised its NotADirectoryError alone; rank 1 waited
    in the lease's broadcast until rank 0's group went away (or the collective timeout, were rank 0 to go on), and
    named only that."""
    results = run_ranks(2, "uncreatable", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    assert all("refused after" in r.stdout and "cannot be created" in r.stdout for r in results), results


def test_a_restore_one_ranks_state_does_not_fit_fails_on_every_rank_and_changes_nothing(tmp_path):
    """Rank 1's state has a key the checkpoint lacks, then a sampler over other data: every rank raises (none waits
    for it until the timeout, or pairs its next save with this restore), every tensor is as it was, and the next save
    commits. Ranks that pass different steps or keys= raise too, before anything is read."""
    results = run_ranks(2, "restore_refused", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    zero, one = (r.stdout for r in results)
    assert "refused: StateMismatchError: rank 1 cannot restore step 1 into its state: StateKeyError" in zero, zero
    assert "refused: StateKeyError" in one and "'extra'" in one, one
    assert all("changed []" in r.stdout and "steps [1, 2]" in r.stdout for r in results), results
    assert all("different steps (rank 0: 1, rank 1: 2)" in r.stdout for r in results), results
    assert all("then restored 2" in r.stdout for r in results), results
    keys = "different keys (rank 0: ['model'], rank 1: ['model', 'opt'])"
    assert all(f"keys refused: the ranks called restore with {keys}" in r.stdout for r in results), results
    assert all("keys changed []" in r.stdout for r in results), results
    # a sampler over other data on rank 1 alone: refused on every rank before anything is read
    assert "sampler refused: StateMismatchError: rank 1 cannot restore step 3 into its state: DataMismatchError" in zero
    said = "sampler refused: DataMismatchError: restore of key 'sampler' (step 3): resuming on different data"
    assert said in one, one
    assert all("then changed [], sampler at 5" in r.stdout for r in results), results


def test_rank_killed_during_save_fails_the_others_and_keeps_previous_step(tmp_path):
    root = str(tmp_path / "ck")
    results = run_ranks(2, "kill", root, timeout=120)
    assert results[1].returncode == -9
    assert results[0].returncode == 0, results[0].stdout[-3000:]
    assert "error after" in results[0].stdout and "latest 1" in results[0].stdout, results[0].stdout
    assert "this manager's group broke earlier (rank 0 waited for rank 1 in" in results[0].stdout, results[0].stdout
    assert "make a new CheckpointManager on every rank" in results[0].stdout, results[0].stdout
    from ckpt import CheckpointManager

    with CheckpointManager(root) as m:  # the previous step is still the newest and restores (here at world size 1)
        assert m.steps() == [1]
        model, opt = dist_worker.build()
        assert m.restore(dist_worker.state_of(model, opt)) == 1
    assert opt.state and all(p.abs().sum() > 0 for p in model.parameters())


def test_a_preemption_signal_on_one_rank_saves_the_same_step_on_every_rank(tmp_path):
    """SIGTERM on rank 0 alone (ranks signalled one after another): TrainLoop agrees on it at each step's end, so
    every rank saves that step and exits 143. Rank 0 used to save alone and wait in its collective for rank 1,
    which trained on: collective_timeout later, nothing saved."""
    results = run_ranks(2, "loop_preempt", str(tmp_path / "ck"), timeout=180)
    _ok(results)
    for r in results:
        assert "preempted at 5 with 143; committed [5]" in r.stdout, r.stdout[-3000:]


def test_ranks_that_do_not_share_the_root_fail_the_first_save_on_every_rank(tmp_path):
    """Each rank's root on its own disk: rank 0 committed manifests naming packs that only the other ranks' disks
    held, so every step was damaged. The first save now finds that rank 1 cannot see rank 0's lease."""
    results = run_ranks(2, "own_roots", str(tmp_path / "ck"), timeout=120)
    _ok(results)
    for r in results:
        assert "refused: CheckpointError: the ranks do not share the root" in r.stdout, r.stdout[-3000:]
        assert "rank 1 sees none" in r.stdout and "committed []" in r.stdout, r.stdout[-3000:]


def test_a_rank_killed_after_the_commit_leaves_an_error_that_says_the_step_is_committed(tmp_path):
    """Rank 1 dies after rank 0 gathered every report and committed step 2, before the verdict reached it: rank 0
    said "saving step 2 failed" of a step that is committed and intact (restore resumes from it)."""
    root = str(tmp_path / "ck")
    results = run_ranks(2, "kill_at_verdict", root, timeout=120)
    assert results[1].returncode == -9
    zero = results[0].stdout
    assert results[0].returncode == 0 and "save 1 ok" in zero, zero[-3000:]
    assert "save 2 raised (committed True): step 2 is committed, but its save did not end on every rank" in zero, zero
    assert "committed [1, 2]" in zero
    from ckpt import CheckpointManager, catalog

    with CheckpointManager(root) as m:
        assert not list(catalog.verify(m.storage, 2))
        model, opt = dist_worker.build()
        assert m.restore(dist_worker.state_of(model, opt)) == 2


def _restored(results, step: int) -> None:
    for rank, r in enumerate(results):
        assert r.returncode == 0 and f"rank {rank} restored {step}: mismatched [];" in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("damage", ["replicated", "shard"])
def test_damaged_step_is_skipped_by_every_rank_and_quarantined_once(tmp_path, damage):
    """A byte of step 2 flipped where every rank reads it, or where only the last rank does (its row shard):
    every rank falls back to step 1, bitwise, and rank 0 quarantines step 2 once."""
    root = str(tmp_path / "ck")
    results = run_ranks(2, f"damaged:{damage}", root)
    _restored(results, 1)
    chunk = results[0].stdout.split("damaged ", 1)[1].split()[0]
    assert "step 2 is damaged" in results[0].stdout and "step 2 is damaged" in results[1].stdout
    assert chunk in results[1].stdout  # the rank that read it names the file
    if damage == "shard":  # rank 0 never read that chunk: it learned of the damage from rank 1
        assert "another rank found damage" in results[0].stdout and chunk in results[0].stdout
    assert "quarantined to" in results[0].stdout and "quarantined by rank 0" in results[1].stdout
    assert [d.startswith("step_00000002-") for d in os.listdir(tmp_path / "ck" / "_quarantine")] == [True]
    dirs = sorted(d for d in os.listdir(tmp_path / "ck") if (tmp_path / "ck" / d).is_dir())
    assert dirs == ["_quarantine", "step_00000001"]
    if damage == "shard":  # at world size 3 the shards are not aligned with the chunks (the chunk-by-chunk read path)
        results = run_ranks(3, "restore_damaged", f"{root}.copy")
        _restored(results, 1)
        # asked for step 2 first: ranks 0 and 1 read their shards intact, rank 2 did not; all failed, none changed
        assert all(f"rank {i} failed step 2, changed []" in r.stdout for i, r in enumerate(results)), results
        assert (
            "another rank found damage" in results[0].stdout
            and chunk.replace(root, f"{root}.copy") in results[1].stdout
        )


def test_rank_map_skip_keeps_the_per_rank_state_at_another_world_size(tmp_path):
    """Saved at world size 2, restored by one process: "modulo" gives it rank 0's RNG, "skip" leaves its own."""
    import torch

    from ckpt import CheckpointManager

    root = str(tmp_path / "ck")
    _ok(run_ranks(2, "save", root))
    model, opt = dist_worker.build()
    with torch.random.fork_rng(), CheckpointManager(root) as m:
        torch.manual_seed(12345)
        mine = torch.get_rng_state()
        assert m.restore(dist_worker.state_of(model, opt), rank_map="skip") == 2
        assert torch.equal(torch.get_rng_state(), mine)
        assert m.restore(dist_worker.state_of(model, opt)) == 2
        assert torch.equal(torch.get_rng_state(), torch.load(tmp_path / "rng0.pt"))
