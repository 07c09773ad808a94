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
