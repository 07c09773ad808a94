"""A backend is one class: a `Storage` written against the protocol alone (tests/fault_storage.py) is a root that a
CheckpointManager saves to and restores from unchanged, and the faults it injects surface as the documented errors
(`CheckpointWriteError` at `wait()`, a fallback on restore) with nothing damaged committed."""

import subprocess
import sys
import uuid

import pytest
import torch

import ckpt
from ckpt import catalog, layout
from ckpt.errors import CheckpointWriteError
from ckpt.storage import open_storage
from fault_storage import FaultStorage, InjectedFault


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(8, generator=g), "n": step}


def _target() -> dict:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(8), "n": 0}


def _equal(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["n"] == b["n"]


def _intact(root: str) -> list[int]:
    """The committed steps of `root`, read through its own storage, each checked to be intact."""
    storage = open_storage(root)
    steps = layout.committed_steps(storage)
    for s in steps:
        assert not list(catalog.verify(storage, s)), s
    return steps


def _chunk_of(step: int):
    """Whether a path is a chunk file of `step` (of an array or a pack)."""
    return lambda path: path.startswith(layout.step_dir(step) + "/") and "/c/" in path


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    return str(tmp_path / "root") if request.param == "local" else f"memory://backend-{uuid.uuid4().hex}/"


def test_a_manager_saves_to_and_restores_from_a_backend_of_its_own(root):
    with ckpt.CheckpointManager(FaultStorage(open_storage(root))) as m:
        for s in (1, 2):
            m.save(s, _state(s))
    assert _intact(root) == [1, 2]  # the wrapped root holds them as its own
    backend, target = FaultStorage(open_storage(root)), _target()
    with ckpt.CheckpointManager(backend) as m:
        assert m.restore(target) == 2
    assert _equal(target, _state(2))
    assert any(map(_chunk_of(2), backend.reads)), "the chunks were read through the backend"


def test_a_failed_write_surfaces_at_wait_and_commits_nothing(root):
    backend = FaultStorage(open_storage(root), fail_path=lambda p: p.endswith(layout.MANIFEST), fail_write=2)
    with ckpt.CheckpointManager(backend) as m:
        m.save(1, _state(1)).wait()
        with pytest.raises(CheckpointWriteError, match="injected fault") as e:
            m.save(2, _state(2)).wait()  # its manifest, the commit, fails
        assert e.value.step == 2 and isinstance(e.value.__cause__, InjectedFault)
        m.save(3, _state(3)).wait()  # the manager goes on
    assert _intact(root) == [1, 3]
    target = _target()
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(target) == 3
    assert _equal(target, _state(3))


def test_a_corrupt_read_falls_back_to_the_previous_step(root):
    with ckpt.CheckpointManager(root) as m:
        for s in (1, 2):
            m.save(s, _state(s))
    backend, target = FaultStorage(open_storage(root), corrupt=_chunk_of(2)), _target()
    with pytest.warns(RuntimeWarning, match="step 2 is damaged.*quarantined"), ckpt.CheckpointManager(backend) as m:
        assert m.restore(target) == 1
    assert _equal(target, _state(1))
    assert _intact(root) == [1]  # step 2 set aside (its files are whole: the backend damaged what it read)


def test_open_storage_takes_a_backend_as_the_root_and_no_options_for_it(tmp_path):
    backend = FaultStorage(open_storage(str(tmp_path)))
    assert open_storage(backend) is backend
    with pytest.raises(ValueError, match="storage_options configure a root given by URL"):
        open_storage(backend, {"timeout": 5})


_FULL_WRITE = r"""
import os, resource, signal, sys
from ckpt.storage import open_storage
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
storage = open_storage(sys.argv[1])
for write in (storage.write_atomic, storage.create):
    try:
        write("run.json", b"x" * 100)
    except OSError as e:
        print(e.errno)
print(sorted(os.listdir(sys.argv[1])))
"""


def test_a_local_write_that_fails_leaves_no_temporary_file(tmp_path):
    """A write that fails (a full disk: here a file size limit) raises and leaves nothing: its temporary file used
    to stay, one more in the root per failed attempt, and gc never removed it."""
    root = tmp_path / "root"
    root.mkdir()
    out = subprocess.run([sys.executable, "-c", _FULL_WRITE, str(root)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["27", "27", "[]"], out.stdout


def test_a_marker_removed_while_a_step_is_listed_is_not_damage(tmp_path, monkeypatch):
    """A writer removes its `_IN_PROGRESS` marker right after its commit: a restore beside it that listed the step in
    between met the marker gone at its stat and called the step it had just committed damaged ("step directory
    changed while being read"), falling back to an older one. The entry is simply not there now."""
    import os

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.ones(2)}).wait()
    marker = tmp_path / layout.in_progress_path(1)
    marker.write_text("{}")  # as a writer's, an instant before its removal
    real = os.scandir

    class Listed:  # the listing read before the marker went, its entries not yet stat'ed
        def __init__(self, path):
            with real(path) as it:
                self.entries = list(it)
            marker.unlink(missing_ok=True)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(os, "scandir", Listed)
    files = layout.step_files(open_storage(str(tmp_path)), 1)
    monkeypatch.undo()
    assert files is not None and layout.IN_PROGRESS not in files.sizes and "manifest.json" in files.sizes
