"""Read-once restore of replicated state, 4 gloo ranks on 127.0.0.1: the ranks read a replicated (DDP) state, and
one with an HSDP part, once from the root between them, bitwise; damage one rank reads fails the step on every rank
and leaves every rank's state as it was."""

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import replicated_worker  # noqa: E402
from ckpt import layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from test_distributed import _ok, run_ranks  # noqa: E402

WORLD = 4


def _lines(results, tag: str) -> list[dict]:
    out = []
    for r in results:
        found = re.findall(rf"^{tag} (.*)$", r.stdout, re.M)
        assert found, r.stdout[-3000:]
        out.append(json.loads(found[-1]))
    return out


@pytest.mark.parametrize("mode", ["ddp", "mixed"])
def test_replicated_state_is_read_once_between_the_ranks_and_damage_fails_every_rank(tmp_path, mode):
    root = str(tmp_path / "ck")
    results = run_ranks(WORLD, mode, root, worker=replicated_worker)
    _ok(results)
    manifest = layout.read_manifest(open_storage(root), 1)
    tensor_bytes = sum(a.nbytes for a in manifest.arrays.values())

    restored = _lines(results, "RESULT")
    assert [(r["step"], r["mismatched"]) for r in restored] == [(1, [])] * WORLD, restored
    read = [r["bytes"] for r in restored]
    # every byte of the checkpoint read from the root once, whatever the replicas (4 of each tensor, or 2 of each
    # half of the HSDP one), and the reads spread over the ranks
    assert tensor_bytes <= sum(read) <= 1.1 * tensor_bytes, (read, tensor_bytes)
    assert max(read) <= 0.35 * tensor_bytes, (read, tensor_bytes)

    damage = _lines(results, "DAMAGE")
    assert damage[replicated_worker.DAMAGED_RANK]["bytes"] > 0  # the damaged rank read its share...
    for d in damage:  # ... and every rank failed the step, with its state as it was
        assert d["error"] and d["changed"] == [], d
        assert "checksum" in d["error"], d
    others = [d for d in damage if d["rank"] != replicated_worker.DAMAGED_RANK]
    assert all("another rank found damage" in d["error"] for d in others), others

    # an I/O error on one rank's reads (no damage): every rank raises, the others naming that rank, no rank takes the
    # step with bands that rank never read, every state is as it was, and the next restore reads step 1 everywhere
    unreadable = _lines(results, "UNREADABLE")
    for u in unreadable:
        assert u["step"] is None and u["error"] and u["changed"] == [], u
        assert u["then"] == 1 and u["mismatched"] == [], u
        if u["rank"] == replicated_worker.DAMAGED_RANK:
            assert u["error"].startswith("InjectedFault: injected fault: read of bytes"), u
        else:
            assert u["error"].startswith(f"CheckpointError: rank {replicated_worker.DAMAGED_RANK} could not read "), u

    # damage on rank 2, whose root then fails to say whether the step is still committed: every rank raises at once
    # (before, rank 2 raised alone and the others waited for its verdict until the collective timeout)
    for u in _lines(results, "UNCHECKED"):
        if u["rank"] == replicated_worker.DAMAGED_RANK:
            assert u["error"].startswith("InjectedFault: injected fault: read of bytes"), u
        else:
            assert u["error"].startswith(f"CheckpointError: rank {replicated_worker.DAMAGED_RANK} could not read "), u


def test_shared_regions_are_cut_where_digests_end_and_spread_evenly_over_their_holders():
    """The leader's plan from every rank's regions: a large region in bands at allowed rows, nearest to equal
    parts; a small one whole; a region one rank holds not shared; every holder reads about as many bytes; ranks
    that restore the same regions plan alone what the leader would have planned."""
    from ckpt.planner import _bands, _held

    big, small, own = ["big", [[0, 12]], 1200, [3, 6, 9]], ["small", [[0, 2]], 100, []], ["own", [[0, 4]], 400, []]
    gathered = [[big, small, own], [big, small], [big, small]]
    parts = _bands(_held(gathered), 3)
    assert [[name for name, _, _ in part] for part in parts] == [["big", "small"]] * 3
    bands = {name: bands for name, _, bands in parts[0]}
    assert [(lo, hi) for lo, hi, *_ in bands["big"]] == [(0, 3), (3, 9), (9, 12)]  # 4 and 8 are not allowed
    assert [(lo, hi) for lo, hi, *_ in bands["small"]] == [(0, 2)]
    reads = [0, 0, 0]
    for name, n, rows in (("big", 1200, 12), ("small", 100, 2)):
        for lo, hi, reader, holders, _ in bands[name]:
            assert holders == [0, 1, 2]
            reads[reader] += n * (hi - lo) // rows
    assert reads == [600, 400, 300], reads  # the largest band first (600, 300, 300, 100), each to the least loaded
    assert parts == _bands(_held(gathered), 3)  # every run plans the same (the tags agree among ranks)
    # ranks that restore the same regions (DDP) each plan alone, as the leader would have
    assert _bands(_held([[big, small]], range(3)), 3) == _bands(_held([[big, small]] * 3), 3)
