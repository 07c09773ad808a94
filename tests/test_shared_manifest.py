"""The manifest of a restore from a root every rank shares is read from it once, by rank 0, and sent to the other ranks
with the listing of the step's files, which rank 0 alone makes (4 gloo ranks on 127.0.0.1, FSDP2 on a CPU mesh): each
rank checks the bytes it got, so a damaged manifest or a missing file still makes every rank fall back to the previous
step, naming the file, and rank 0's failure to read the manifest or list the step reaches every rank."""

import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import manifest_worker  # noqa: E402
from ckpt.distributed import _tree  # noqa: E402
from test_distributed import _ok, run_ranks  # noqa: E402

WORLD = 4  # rank 3 gets the bytes from rank 2, which got them from rank 0 (a tree, not a star)


def test_the_tree_a_broadcast_of_bytes_goes_down_reaches_every_rank_once_within_log2_hops():
    for world in range(1, 70):
        tree = {r: _tree(r, world) for r in range(world)}
        assert tree[0][0] is None and sorted(c for _, kids in tree.values() for c in kids) == list(range(1, world))
        for r, (parent, kids) in tree.items():
            assert all(tree[c][0] == r for c in kids) and (parent is None or r in tree[parent][1])
            hops = 0
            while r:
                r, hops = tree[r][0], hops + 1
            assert hops <= max(world - 1, 0).bit_length()


def _line(result, tag: str) -> dict:
    found = re.findall(rf"^{tag} (.*)$", result.stdout, re.M)
    assert found, result.stdout[-3000:]
    return json.loads(found[-1])


@pytest.fixture(scope="module")
def once(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("once") / "ck")
    results = run_ranks(WORLD, "once", root, worker=manifest_worker)
    _ok(results)
    return root, results


def test_only_rank_0_reads_the_manifest_from_a_shared_root(once):
    root, results = once
    size = os.path.getsize(os.path.join(root, manifest_worker.manifest_of(2)))
    lines = [_line(r, "ONCE") for r in results]
    assert [(x["step"], x["mismatched"]) for x in lines] == [(2, [])] * WORLD, lines
    leader = lines[0]["manifest_reads"]  # the listing's first byte of each step, then step 2's manifest whole
    assert [[p, n] for p, n in leader if n > 1] == [["step_00000002/manifest.json", size]], leader
    for x in lines[1:]:
        assert x["manifest_reads"] == [], x


def test_only_rank_0_lists_the_step_directory_of_a_shared_root(once):
    _, results = once
    lines = [_line(r, "LISTED") for r in results]
    assert [(x["step"], x["mismatched"]) for x in lines] == [(2, [])] * WORLD, lines
    assert lines[0]["listed"] == ["step_00000002"], lines[0]
    for x in lines[1:]:
        assert x["listed"] == [] and x["manifest_reads"] == [], x


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("faults") / "ck")
    results = run_ranks(WORLD, "faults", root, worker=manifest_worker)
    _ok(results)
    return root, results


@pytest.mark.parametrize("tag", ["AT_REST", "IN_TRANSIT"])
def test_a_damaged_manifest_makes_every_rank_fall_back_to_the_previous_step_naming_the_file(faults, tag):
    root, results = faults
    file = os.path.join(root, manifest_worker.manifest_of(2))
    reason = "manifest checksum mismatch" if tag == "AT_REST" else "manifest is not valid JSON"
    for rank, result in enumerate(results):
        x = _line(result, tag)
        assert (x["step"], x["error"], x["mismatched"]) == (1, None, []), x
        [warning] = x["warnings"]
        assert "step 2 is damaged" in warning and reason in warning and file in warning, x
        assert "falling back to the previous committed step" in warning, x
        assert ("quarantined to" if rank == 0 else "quarantined by rank 0") in warning, x


def test_rank_0_unable_to_read_the_manifest_fails_every_rank_alike(faults):
    _, results = faults
    for rank, result in enumerate(results):
        x = _line(result, "UNREADABLE")
        assert x["step"] is None and x["changed"] == [], x
        if rank == 0:
            assert x["error"].startswith("InjectedFault: injected fault: read of step_00000002/manifest.json"), x
        else:
            assert x["error"].startswith("CheckpointError: rank 0 could not read step 2: InjectedFault"), x
        x = _line(result, "MISSING")
        assert x["step"] is None and x["changed"] == [], x
        assert x["error"].startswith("StepNotFoundError: step 2 is not committed in"), x


def test_rank_0_unable_to_list_the_steps_fails_every_rank_at_once(faults):
    _, results = faults
    for rank, result in enumerate(results):
        x = _line(result, "UNLISTABLE")
        assert x["step"] is None and x["changed"] == [], x
        if rank == 0:
            assert x["error"] == "InjectedFault: injected fault: listing of ''", x
        else:
            assert x["error"].startswith("CheckpointError: rank 0 could not list the steps of "), x
            assert x["error"].endswith("InjectedFault: injected fault: listing of ''"), x


def test_rank_0_unable_to_list_the_step_fails_every_rank_alike(faults):
    _, results = faults
    fault = "InjectedFault: injected fault: listing of 'step_00000002'"
    for rank, result in enumerate(results):
        x = _line(result, "UNLISTED_STEP")
        assert x["step"] is None and x["changed"] == [], x
        if rank == 0:
            assert x["error"] == fault and x["listed"] == ["step_00000002"], x
        else:
            assert x["error"] == f"CheckpointError: rank 0 could not read step 2: {fault}" and x["listed"] == [], x


def test_a_missing_chunk_file_makes_every_rank_fall_back_naming_it_from_rank_0s_listing(faults):
    root, results = faults
    lines = [_line(r, "MISSING_CHUNK") for r in results]
    file = os.path.join(root, lines[0]["deleted"])
    for rank, x in enumerate(lines):
        assert (x["step"], x["error"], x["mismatched"]) == (1, None, []), x
        [warning] = x["warnings"]
        assert "step 2 is damaged" in warning and "chunk file is missing" in warning and file in warning, x
        assert "falling back to the previous committed step" in warning, x
        assert x["listed"] == (["step_00000002", "step_00000001"] if rank == 0 else []), x
