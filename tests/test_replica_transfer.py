"""The peer replica's byte mechanism with two real gloo ranks on 127.0.0.1: a step of many files (an array of its
own per tensor, an empty one among them) sent as one stream, cut so that files span messages and messages span
files, arrives byte for byte and verifies; a file that changes while being sent commits nothing on the receiver."""

import filecmp
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import replica_worker  # noqa: E402
from ckpt import CheckpointManager, catalog, layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from test_distributed import _ok, run_ranks  # noqa: E402


def _source(root: str) -> list[str]:
    """Step STEP under ROOT/src, every tensor an array of its own (pack_bytes=0); its files, relative to the step."""
    state = {f"t{i}": torch.arange(37 * i, dtype=torch.float32) for i in range(12)}  # t0 is empty
    state["big"] = torch.randn(3000)  # 12 KB: one file over many 1,000-byte messages
    with CheckpointManager(os.path.join(root, "src"), pack_bytes=0) as m:
        m.save(replica_worker.STEP, state).wait()
    step = os.path.join(root, "src", layout.step_dir(replica_worker.STEP))
    return sorted(os.path.relpath(os.path.join(d, f), step) for d, _, fs in os.walk(step) for f in fs)


def test_a_step_of_many_files_arrives_byte_for_byte_and_verifies(tmp_path):
    root = str(tmp_path)
    files = _source(root)
    assert len(files) > 25
    results = run_ranks(2, "ok", root, worker=replica_worker)
    _ok(results)
    for rank, r in enumerate(results):
        assert f"rank {rank} committed [{replica_worker.STEP}]" in r.stdout, r.stdout[-3000:]
        dest = os.path.join(root, f"dest{rank}", layout.step_dir(replica_worker.STEP))
        src = os.path.join(root, "src", layout.step_dir(replica_worker.STEP))
        _, mismatch, errors = filecmp.cmpfiles(src, dest, files, shallow=False)
        assert mismatch == errors == [], (mismatch, errors)
        got = int(re.search(r"got (\d+)", r.stdout).group(1))
        assert got == sum(os.path.getsize(os.path.join(src, f)) for f in files)
        assert list(catalog.verify(open_storage(os.path.join(root, f"dest{rank}")), replica_worker.STEP)) == []


def test_a_file_changed_while_being_sent_commits_nothing_and_names_the_file(tmp_path):
    root = str(tmp_path)
    _source(root)
    results = run_ranks(2, "changed", root, worker=replica_worker)
    _ok(results)
    sender, receiver = results[0].stdout, results[1].stdout
    assert re.search(r"rank 0 failed OSError: \S+ of step 4 changed while being sent", sender), sender[-3000:]
    assert "rank 1 failed OSError: rank 0 could not read its copy of step 4" in receiver, receiver[-3000:]
    assert "rank 1 committed []" in receiver  # nothing partial, nothing padded
    assert "rank 0 committed [4]" in sender  # the other direction was whole: it commits
