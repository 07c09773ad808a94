"""A checkpoint is complete and verified or invisible: corruption, bad input, failed writes, retention."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from argparse import Namespace

import pytest
import torch

import ckpt
from ckpt import catalog, cli, layout, lease
from ckpt.errors import CheckpointWriteError, CorruptCheckpointError
from ckpt.storage import open_storage
from fault_storage import FaultStorage
from step_paths import data_dir


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g), "step": step}


# Tests here that damage or list the files of one array save unpacked (the tensors are small enough to be packed);
# packed tensors have their own in test_ckpt_packed.py.
UNPACKED = {"pack_bytes": 0}


def _save_steps(root, steps, **kw):
    with ckpt.CheckpointManager(root, **{**UNPACKED, **kw}) as m:
        for s in steps:
            m.save(s, _state(s), metadata={"loss": 1.0 / (s + 1)})


def _chunk(root, step, key="w"):
    d = os.path.join(data_dir(root, step), "arrays", key, "c")
    return os.path.join(d, *["0"] * (2 if key == "w" else 1))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ckpt", *args], capture_output=True, text=True)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_chunk_is_named_and_restore_falls_back(tmp_path, damage):
    root = str(tmp_path)
    _save_steps(root, [1, 2])
    path = _chunk(root, 2)
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(1234)
            b = f.read(1)
            f.seek(1234)
            f.write(bytes([b[0] ^ 0x01]))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 100)
    else:
        os.remove(path)
    res = _cli("verify", root, "-q")
    assert res.returncode == 1
    assert "step 2: DAMAGED" in res.stdout and path in res.stdout and "step 1: ok" in res.stdout
    target = {"w": torch.zeros(300, 200), "b": torch.zeros(7), "step": None}
    with ckpt.CheckpointManager(root) as m, pytest.raises(CorruptCheckpointError, match="key=w"):
        m.restore(target, step=2)  # an explicit step never silently falls back
    with pytest.warns(RuntimeWarning, match=r"step 2 is damaged.*key=w.*quarantined.*falling back"):
        with ckpt.CheckpointManager(root) as m:
            assert m.restore(target) == 1
    assert torch.equal(target["w"], _state(1)["w"]) and target["step"] == 1


def test_damaged_manifest_is_detected(tmp_path):
    _save_steps(str(tmp_path), [1, 2])
    p = tmp_path / "step_00000002" / "manifest.json"
    p.write_bytes(p.read_bytes().replace(b'"step":2', b'"step":3'))
    assert _cli("verify", str(tmp_path), "-q").returncode == 1
    with pytest.warns(RuntimeWarning, match="manifest checksum mismatch"):
        with ckpt.CheckpointManager(tmp_path) as m:
            assert m.restore(_state(0)) == 1


def test_manifest_paths_leaving_the_root_are_rejected(tmp_path):
    _save_steps(str(tmp_path), [1])
    p = tmp_path / "step_00000001" / "manifest.json"
    body = json.loads(p.read_bytes())["body"]
    body["arrays"]["../../../etc/passwd"] = body["arrays"].pop("w")
    body["tree"]["w"] = {"$tensor": "../../../etc/passwd"}
    text = json.dumps(body, separators=(",", ":"))
    p.write_text(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}, separators=(",", ":")))
    with ckpt.CheckpointManager(tmp_path) as m, pytest.raises(CorruptCheckpointError, match="unsafe array path"):
        m.restore({"w": torch.zeros(300, 200)}, step=1)


def test_bad_input_errors_name_the_key(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        with pytest.raises(TypeError, match=r"key 'cfg.fn'.*function"):
            m.save(0, {"cfg": {"fn": lambda: 0}})
        with pytest.raises(TypeError, match=r"key 'opt'.*only str and int keys"):
            m.save(0, {"opt": {(1, 2): 3}})
        with pytest.raises(TypeError, match=r"key 'cfg.ids' has an int key of 20001 bits"):  # was a ValueError of
            m.save(0, {"cfg": {"ids": {2**20000: 1}}})  # str(int) naming no key
        m.save(1, {"w": torch.zeros(3, 4), "x": torch.zeros(2, dtype=torch.int64)}).wait()
        with pytest.raises(ValueError, match=r"key 'w'.*shape \[3, 4\].*shape \[4, 3\]"):
            m.restore({"w": torch.zeros(4, 3)})
        with pytest.raises(ValueError, match=r"key 'x'.*dtype int64.*dtype float32"):
            m.restore({"x": torch.zeros(2)})
        with pytest.raises(KeyError, match=r"\['nope'\] not in checkpoint step 1"):
            m.restore({"nope": torch.zeros(1)})
        with pytest.raises(ValueError, match="already committed"):
            m.save(1, {"w": torch.ones(3, 4)})
        with pytest.raises(ValueError, match="non-negative int"):
            m.save(-1, {})


def test_a_mismatch_error_names_the_key_as_the_state_spells_it_not_its_storage_name(tmp_path):
    """A shape or dtype mismatch named the array's storage name: 'model/0~1' for the int key 0 (beside "0"),
    'model/a%2Fb' for 'a/b', a key of 300 characters cut and hashed, 'model/weight' for a module's parameter. Now
    the dotted key path, as load(keys=) and the other restore errors spell it."""
    saved = {"model": {"0": torch.ones(3), 0: torch.ones(1), "a/b": torch.ones(2), "x" * 300: torch.ones(2)}}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {**saved, "lin": torch.nn.Linear(3, 2)}).wait()
        for key, bad, what in (
            (0, torch.ones(2), r"shape \[1\], the target tensor has shape \[2\]"),
            ("a/b", torch.ones(2, dtype=torch.int64), "dtype float32, the target tensor has dtype int64"),
            ("x" * 300, torch.ones(3), r"shape \[2\]"),
        ):
            target = {"model": {**saved["model"], key: bad}}
            with pytest.raises(ckpt.StateMismatchError, match=rf"^restore of key 'model\.{key}' \(step 1\): .*{what}"):
                m.restore(target, keys=["model"])
        with pytest.raises(ckpt.StateMismatchError, match=r"^restore of key 'lin\.weight' \(step 1\): checkpoint has"):
            m.restore({"lin": torch.nn.Linear(4, 2)}, keys=["lin"])


def test_a_manager_of_a_step_directory_is_refused_naming_its_root(tmp_path):
    """CheckpointManager(ROOT/step_00000001) found no step there: restore(keys=['model']) returned None (an
    evaluation went on with random weights) and a save wrote steps inside that committed step. It is refused where
    the manager is made, naming the root; a root merely named like a step (no manifest in it) is still one."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2)}}).wait()
    step_dir = tmp_path / "root" / "step_00000001"
    held = sorted(os.listdir(step_dir))
    with pytest.raises(
        ValueError,
        match=r"root/step_00000001 is a committed step, not a root \(step_00000001 is step "
        rf"1's directory: its root is {re.escape(str(tmp_path / 'root'))}\): give the root",
    ):
        ckpt.CheckpointManager(step_dir)
    assert sorted(os.listdir(step_dir)) == held
    with ckpt.CheckpointManager(tmp_path / "step_00000002") as m:
        m.save(1, {"w": torch.ones(1)}).wait()
        assert m.steps() == [1]


def test_restore_of_a_dotted_key_says_restore_takes_top_level_entries(tmp_path):
    """restore(state, keys=['model.w']) said "keys ['model.w'] not in checkpoint step 1 (it has ['model'])", though
    the step holds model.w (ckpt.load(keys=['model.w']) reads it). Now it says restore's keys are top-level entries
    and what reads the dotted one."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"model": {"w": torch.ones(2)}}).wait()
        with pytest.raises(
            ckpt.StateKeyError,
            match=r"restore's keys are top-level entries: restore 'model' whole, or read 'model.w' with "
            r"ckpt.load\(root, keys=\['model.w'\]\)",
        ):
            m.restore({"model": {"w": torch.zeros(2)}}, keys=["model.w"])


ROOT_IS_A_FILE = """
import sys, torch, ckpt
try:
    manager = ckpt.CheckpointManager(sys.argv[1])
except NotADirectoryError as e:
    print(e)
"""


@pytest.mark.parametrize("under", [False, True], ids=["root_is_a_file", "root_under_a_file"])
def test_a_root_that_is_not_a_directory_is_one_clear_error(tmp_path, under):
    """A manager of a root that is a file (or lies under one) fails where it is made, naming the root (and the file
    in its way), with nothing else on stderr (a lease that was never taken is not released); the CLI says it in one
    line."""
    file = tmp_path / "afile"
    file.write_text("not a root")
    root = str(file / "sub" if under else file)
    what = f"cannot be created: {file} is not a directory" if under else "is not a directory"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([sys.executable, "-c", ROOT_IS_A_FILE, root], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == f"the checkpoint root {root} {what}", (res.stdout, res.stderr)
    assert not res.stderr, res.stderr
    sd = tmp_path / "sd.pt"
    torch.save({"x": torch.zeros(2)}, sd)
    res = subprocess.run(
        [sys.executable, "-m", "ckpt", "import", str(sd), root, "--step", "1"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 1 and res.stderr.strip() == f"error: the checkpoint root {root} {what}", res.stderr
    assert not res.stdout and "Exception ignored" not in res.stderr


def test_a_root_no_save_could_create_fails_where_the_manager_is_made_creating_nothing(tmp_path):
    """A root through a file, or in a directory this process may not write (procfs refuses even root), fails the
    manager's construction, not its first save an hour later; so does such a local tier; a root that is merely
    missing is created by the first save and a constructor creates nothing."""
    file = tmp_path / "afile"
    file.write_text("x")
    with pytest.raises(NotADirectoryError, match=f"{file}/a/b cannot be created: {file} is not a directory"):
        ckpt.CheckpointManager(file / "a" / "b")
    with pytest.raises(PermissionError, match="/proc/1/ck cannot be created: no permission to write in /proc/1$"):
        ckpt.CheckpointManager("/proc/1/ck")
    with pytest.raises(NotADirectoryError, match=f"{file}/local cannot be created"):
        ckpt.CheckpointManager(tmp_path / "durable", local=file / "local")
    with pytest.raises(OSError, match="cannot be created: a name in it is longer than 255 bytes"):
        ckpt.CheckpointManager(tmp_path / ("a" * 300) / "x")  # its first save failed with ENAMETOOLONG
    with ckpt.CheckpointManager(tmp_path / "new" / "root", local=tmp_path / "new" / "local") as m:
        assert not (tmp_path / "new").exists()
        m.save(1, {"x": torch.zeros(2)}).wait()
    assert (tmp_path / "new" / "root").is_dir() and (tmp_path / "new" / "local").is_dir()


def test_directories_that_only_look_like_steps_are_not_steps(tmp_path):
    """A stray ``step_99999999999999999999999`` (past 2**63) failed every listing, restore and gc of the root with
    "step must be ... below 2**63"; a copy padded otherwise (``step_0000000000001``) or named with a trailing newline
    listed step 1 twice. Only
    the library's own spelling of a step is one; the others are left alone."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"x": torch.ones(2)}).wait()
    shutil.copytree(tmp_path / "step_00000001", tmp_path / "step_0000000000001")
    for name in ("step_99999999999999999999999", "step_9223372036854775808", "step_123", "step_00000001\n"):
        (tmp_path / name).mkdir()
    state = {"x": torch.zeros(2)}
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.steps() == [1] and m.restore(state) == 1 and torch.equal(state["x"], torch.ones(2))
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for command in (["ls"], ["gc"], ["verify", "-q"]):
        res = subprocess.run(
            [sys.executable, "-m", "ckpt", *command, str(tmp_path)], capture_output=True, text=True, env=env
        )
        assert res.returncode == 0 and not res.stderr, (command, res)
        assert res.stdout.count("committed") <= 1 and "step_" not in res.stdout.replace("step_00000001", ""), res
    assert (tmp_path / "step_99999999999999999999999").is_dir() and (tmp_path / "step_0000000000001").is_dir()


def test_errors_are_one_family_and_keep_the_builtin_types_callers_caught(tmp_path):
    """Every refusal is a `CheckpointError` of its own type, and still the built-in it was before."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.zeros(3, 4)}).wait()
        m.save(2, {"w": torch.zeros(3, 4)}).wait()
        cases = [
            (lambda: m.save(2, {"w": torch.zeros(3, 4)}), ckpt.StepExistsError, (FileExistsError, ValueError)),
            (lambda: m.restore({"w": torch.zeros(3, 4)}, step=7), ckpt.StepNotFoundError, (FileNotFoundError,)),
            (lambda: m.delete(7), ckpt.StepNotFoundError, (ValueError,)),
            (lambda: m.metadata(7), ckpt.StepNotFoundError, (FileNotFoundError,)),
            (lambda: m.restore({"w": torch.zeros(4, 3)}), ckpt.StateMismatchError, (ValueError,)),
            (lambda: m.restore({"v": torch.zeros(1)}), ckpt.StateKeyError, (KeyError,)),
        ]
        for call, kind, builtins in cases:
            with pytest.raises(kind) as info:
                call()
            assert isinstance(info.value, (ckpt.CheckpointError, *builtins)), info.value
            assert all(isinstance(info.value, b) for b in (ckpt.CheckpointError, *builtins)), info.value
    assert issubclass(ckpt.DataMismatchError, ckpt.CheckpointError) and issubclass(ckpt.DataMismatchError, ValueError)
    from ckpt import DataMismatchError

    assert DataMismatchError is ckpt.DataMismatchError


def test_background_write_error_surfaces_at_next_call_and_keeps_earlier_steps(tmp_path):
    root = str(tmp_path)
    _save_steps(root, [1])
    (tmp_path / "step_00000002").write_text("a file where the step directory should go")
    with ckpt.CheckpointManager(root) as m:
        h = m.save(2, _state(2))  # returns after the snapshot; the write fails in the background
        with pytest.raises(CheckpointWriteError, match="saving step 2 failed"):
            m.save(3, _state(3))
        assert h.done()  # the next save waited for it
        with pytest.raises(CheckpointWriteError, match="saving step 2 failed"):
            h.wait()  # the handle keeps its own outcome
        m.wait()  # reported once by the manager; the loop decided to go on
        assert m.steps() == [1]
        t = _state(0)
        assert m.restore(t) == 1 and torch.equal(t["w"], _state(1)["w"])


@contextlib.contextmanager
def _gc_holding(root, give_up_after: float = 20.0):
    """Hold ROOT/_GC_LOCK, as `ckpt gc` does while it deletes: the background part of a save waits for it (it
    clears its step directory and marks itself in progress under it), the training thread must not. Released on
    exit, or by a timer after `give_up_after` s, so that a save that wrongly waits for its write returns."""
    held = lease.gc_lock(str(root))
    held.__enter__()
    once = threading.Lock()
    done = []

    def release() -> None:
        with once:
            if not done:
                done.append(True)
                held.__exit__(None, None, None)

    timer = threading.Timer(give_up_after, release)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        release()


def test_save_returns_before_its_write_and_the_write_follows(tmp_path):
    """save() returns once the snapshot is taken: with its write held back (gc holding the root), the handle is
    not done, nothing is committed, and the caller may change its tensors; the write then commits the snapshot."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, _state(1)).wait()
        state = _state(2)
        with _gc_holding(tmp_path):
            h = m.save(2, state)
            done_on_return, committed_on_return = h.done(), m.steps()
            state["w"].add_(1.0)
        assert not done_on_return, "save() waited for its write"
        assert committed_on_return == [1]
        h.wait()
        assert h.done() and m.steps() == [1, 2]
        t = _state(0)
        assert m.restore(t) == 2 and torch.equal(t["w"], _state(2)["w"]), "the snapshot, not the later values"


def test_delete_refuses_the_step_in_flight_and_never_counts_it_as_committed(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        for s in (1, 2, 3):
            m.save(s, _state(s))
        m.wait()
        with _gc_holding(tmp_path):
            h = m.save(4, _state(4))
            with pytest.raises(ValueError, match="step 4 is still being written"):
                m.delete(4)
            with pytest.raises(ValueError, match="step 3 is the newest committed step"):
                m.delete(3)  # step 4 may still fail: 3 is what a restart would need
            m.delete(2)
            assert m.steps() == [1, 3]
        h.wait()
        m.wait()
        assert m.steps() == [1, 3, 4] and not (tmp_path / "step_00000002").exists()


@pytest.mark.parametrize("attempt", ["other_chunking", "other_keys"])
def test_resaving_a_step_over_a_crashed_attempts_leftovers(tmp_path, attempt):
    """A writer killed just before its commit left step 2's arrays (other chunking, or an extra key) and its
    marker; the restarted writer saves step 2 again, with other data: the step holds only the new save."""
    root = tmp_path / "ck"
    _save_steps(str(root), [1])
    crashed = tmp_path / "crashed"
    with ckpt.CheckpointManager(
        crashed, chunk_bytes=4096 if attempt == "other_chunking" else 64 << 20, **UNPACKED
    ) as m:
        m.save(2, {**_state(22), **({"extra": torch.ones(5)} if attempt == "other_keys" else {})}).wait()
    shutil.copytree(crashed / "step_00000002", root / "step_00000002", ignore=shutil.ignore_patterns("manifest.json"))
    (root / "step_00000002" / "_IN_PROGRESS").write_text(
        json.dumps({"pid": 1 << 22, "host": "gone", "time": 0.0, "lease": "a-dead-writer"})
    )
    with ckpt.CheckpointManager(root, **UNPACKED) as m:
        m.save(2, _state(2)).wait()
        t = _state(0)
        assert m.restore(t) == 2 and torch.equal(t["w"], _state(2)["w"]) and t["step"] == 2
    storage = open_storage(str(root))
    assert not list(catalog.verify(storage, 2))
    data = data_dir(root, 2)
    assert sorted(os.listdir(root / "step_00000002")) == sorted([os.path.basename(data), "manifest.json"]), (
        "the crashed attempt's data and marker are gone"
    )
    assert sorted(os.listdir(os.path.join(data, "arrays"))) == ["b", "w"]
    assert os.listdir(os.path.join(data, "arrays", "w", "c")) == ["0"], "one chunk (64 MiB target), as saved"
    assert [(e.step, e.committed, e.in_progress) for e in catalog.entries(storage)] == [
        (1, True, None),
        (2, True, None),
    ]


FULL_DISK = os.path.join(os.path.dirname(__file__), "procs", "full_disk.py")


def _observed(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def _assert_failed_save_cleaned_up(seen: dict, reason: str) -> None:
    """The failed step 2 was reported by the next call, left nothing behind; step 1 restores, step 3 saves."""
    assert seen["next_call"].startswith("CheckpointWriteError: saving step 2 failed") and reason in seen["next_call"], (
        seen
    )
    assert [d for d in seen["leftovers"] if d.startswith("step_")] == ["step_00000001"], "a failed save cleans up"
    assert seen["steps_after_failure"] == [1] and seen["restored"] == 1 and seen["restored_bitwise"]
    assert seen["steps_at_end"] == [1, 3] and seen["problems"] == []


def test_write_past_a_file_size_limit_fails_at_the_next_call_cleans_up_and_keeps_the_previous_step(tmp_path):
    """No privileges: the child lowers its own RLIMIT_FSIZE to 1 MiB, so the 4 MB chunk of step 2 fails (EFBIG)."""
    cmd = [sys.executable, FULL_DISK, str(tmp_path / "ck"), "--file-size-limit", str(1 << 20)]
    _assert_failed_save_cleaned_up(
        _observed(subprocess.run(cmd, capture_output=True, text=True, timeout=300)), "File too large"
    )


def test_full_disk_surfaces_enospc_cleans_up_and_keeps_the_previous_step(tmp_path):
    """A real ENOSPC: the child runs in a mount namespace of its own (as root, or as anyone where user namespaces
    are allowed) on a 3 MB tmpfs."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = 'mount -t tmpfs -o size=3m tmpfs "$0" || exit 97; exec "$@"'
    for namespace in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        out = subprocess.run(
            [*namespace, "sh", "-c", script, str(mnt), sys.executable, FULL_DISK, str(mnt)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode == 0 or (out.returncode != 97 and not out.stderr.startswith("unshare:")):
            break
    else:
        pytest.skip(
            "cannot mount a size-limited tmpfs here (needs root or unprivileged user namespaces); "
            "test_write_past_a_file_size_limit_* covers the same without privileges"
        )
    _assert_failed_save_cleaned_up(_observed(out), "No space left")


def test_retention_keep_last_every_and_best(tmp_path):
    _save_steps(str(tmp_path / "last"), range(1, 7), keep_last=2)
    assert ckpt.CheckpointManager(tmp_path / "last").steps() == [5, 6]
    _save_steps(str(tmp_path / "every"), range(1, 8), keep_last=1, keep_every=3)
    assert ckpt.CheckpointManager(tmp_path / "every").steps() == [3, 6, 7]
    # loss = 1/(s+1) falls with s: best by "max" keeps the earliest steps, and always the newest
    _save_steps(str(tmp_path / "best"), range(1, 6), keep_best=2, best_metric="loss", best_mode="max")
    assert ckpt.CheckpointManager(tmp_path / "best").steps() == [1, 2, 5]
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        ckpt.CheckpointManager(tmp_path, keep_best=1)
    with ckpt.CheckpointManager(tmp_path / "last") as m:
        with pytest.raises(ValueError, match="newest committed step; it is never deleted"):
            m.delete(6)
        with pytest.raises(ValueError, match="not a committed step"):
            m.delete(1)
        m.delete(5)
        assert m.steps() == [6]


def test_a_writer_removes_what_kills_during_retention_and_saves_left(tmp_path):
    """A kill between a retention's manifest delete and its tree delete left step 1's arrays with no manifest; a kill
    mid-save left step 3's partial files, marked by a dead writer. The next writer's first commit removes both in the
    background (no disk stays taken until a `ckpt gc`); every committed step stays, its own saves in flight too."""
    root = tmp_path / "ck"
    _save_steps(str(root), [1, 2])
    os.remove(root / layout.manifest_path(1))
    (root / "step_00000003" / "arrays").mkdir(parents=True)
    (root / layout.in_progress_path(3)).write_text(
        json.dumps({"pid": 1 << 22, "host": "gone", "time": 0.0, "lease": "a-dead-writer"})
    )
    storage = open_storage(str(root))
    assert [(e.step, e.committed) for e in catalog.entries(storage)] == [(1, False), (2, True), (3, False)]
    with ckpt.CheckpointManager(root, **UNPACKED) as m:
        t = _state(0)
        assert m.restore(t) == 2 and torch.equal(t["w"], _state(2)["w"])
        for s in (4, 5, 6):  # saves in flight while the leftovers go
            m.save(s, _state(s))
    assert [(e.step, e.committed) for e in catalog.entries(storage)] == [(s, True) for s in (2, 4, 5, 6)]
    for s in (2, 4, 5, 6):
        assert not list(catalog.verify(storage, s)), s


def test_memory_root_is_one_store(tmp_path):
    root = f"memory://{uuid.uuid4().hex}/run"
    _save_steps(root, [1, 2], keep_last=1)
    with ckpt.CheckpointManager(root) as m:
        assert m.steps() == [2]
        t = _state(0)
        assert m.restore(t) == 2 and torch.equal(t["w"], _state(2)["w"])


def test_cli_verify_beside_a_writer_whose_retention_deletes_a_step_reports_no_damage(tmp_path, capsys):
    """`ckpt verify ROOT` beside a live writer under keep_last=1 said 'step 1: DAMAGED: zarr.json is missing' (exit 1)
    for a step retention deleted while it was read (37 of 9,752 runs), or failed with StepNotFoundError. Here the
    step is deleted (manifest first, as retention does) at the first read of its data."""
    root = tmp_path / "ck"
    with ckpt.CheckpointManager(root) as m:
        for step in (1, 2):
            m.save(step, {"w": torch.full((64,), float(step))}).wait()
    inner = open_storage(str(root))

    def retention_deletes_step_1(path: str) -> bool:
        if path.startswith("step_00000001/w-"):
            catalog.delete_step(inner, 1)
        return False

    storage = FaultStorage(inner, hide=retention_deletes_step_1)
    assert cli.cmd_verify(storage, Namespace(step=None, quiet=True)) == 0
    out = capsys.readouterr().out
    assert "step 1: deleted while it was being verified" in out and "DAMAGED" not in out and "step 2: ok" in out


def test_cli_ls_inspect_gc(tmp_path):
    root = str(tmp_path)
    _save_steps(root, [4])
    (tmp_path / "step_00000009" / "arrays").mkdir(parents=True)
    ls = _cli("ls", root).stdout
    assert "4  committed" in ls and "9  incomplete" in ls
    ins = _cli("inspect", root).stdout
    assert "w: float32[300, 200]" in ins and "step: 4" in ins and '"loss": 0.2' in ins
    assert "removed incomplete step 9" in _cli("gc", root).stdout
    assert not (tmp_path / "step_00000009").exists() and (tmp_path / "step_00000004").exists()


def test_cli_inspect_shows_values_as_python_writes_them(tmp_path):
    """inspect printed a value's JSON tags (`lr: {"$float": "nan"}`, `t: {"$tuple": [1, 2]}`): now nan, (1, 2)..."""
    import numpy as np

    values = {"lr": float("nan"), "t": (1,), "s": torch.Size([3]), "d": torch.float16, "b": b"\x00", "n": np.int64(3)}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.zeros(2), "cfg": {**values, "big": bytes(100), "plain": [None, True, "x"]}})
    lines = _cli("inspect", str(tmp_path)).stdout.splitlines()
    assert lines[lines.index("cfg:") + 1 :] == [
        "  lr: nan",
        "  t: (1,)",
        "  s: torch.Size([3])",
        "  d: torch.float16",
        "  b: b'\\x00'",
        "  n: numpy.int64(3)",
        "  big: <100 bytes>",
        "  plain: [None, True, 'x']",
    ], lines


def test_cli_explain_prints_the_batch_of_a_step(tmp_path):
    from ckpt import RandomWindowSampler

    sampler = RandomWindowSampler(10_000, 16, 8, global_batch_size=4, seed=3, rank=0, world_size=1)
    it = iter(sampler)
    for _ in range(5):
        next(it)
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(5, {"data": {"sampler": sampler}, "w": torch.zeros(2)})
    out = _cli("explain", str(tmp_path), "--step", "7")
    assert out.returncode == 0, out.stderr
    expected = sampler.explain(7)
    assert "sampler 'data.sampler' from checkpoint step 5" in out.stdout
    assert (
        expected.batch_hash in out.stdout and f"tokens [{expected.starts[0]}, {expected.starts[0] + 16})" in out.stdout
    )
    assert _cli("explain", str(tmp_path), "--step", "7", "--key", "nope").returncode == 1


def test_cli_explain_names_the_batch_a_step_trained_before_a_later_skip(tmp_path):
    """A resume from step 20 skips a window step 3 trained (the record-of-death workflow): explain --step 3 read the
    newest sampler state, skip list included, and named the replacement window. It now reads the earliest checkpoint
    at or after the step by default."""
    from ckpt import RandomWindowSampler

    def sampler():
        return RandomWindowSampler(1000, 17, 8, global_batch_size=8, seed=5, rank=0, world_size=1)

    first = sampler()
    trained = dict(zip(range(1, 21), first.track(iter(first))))
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(20, {"sampler": first})
    again = sampler()
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore({"sampler": again}) == 20
        again.skip([trained[3][0][1] // 8])  # the window of step 3's first sample: it recurs in epoch 1
        trained |= dict(zip(range(21, 31), again.track(iter(again))))
        m.save(30, {"sampler": again})
    for step, checkpoint in ((3, 20), (25, 30)):
        out = _cli("explain", str(tmp_path), "--step", str(step))
        assert out.returncode == 0 and f"from checkpoint step {checkpoint}" in out.stdout, out.stdout + out.stderr
        named = [[int(t), int(s)] for t, s in re.findall(r"t=(\d+) epoch=\d+ index=\d+ tokens \[(\d+),", out.stdout)]
        assert named == [list(map(int, pair)) for pair in trained[step]], step
    assert "from checkpoint step 30" in _cli("explain", str(tmp_path), "--step", "40").stdout  # none after: newest


def test_a_ctrl_c_in_wait_leaves_the_save_in_flight_and_the_next_save_waits_for_it(tmp_path):
    """Ctrl-C while `wait()` waits for a save: the save goes on writing from the arena, so the next `save` must wait
    for it before it copies into that arena (it used to copy at once: the first step committed damaged)."""
    import signal

    from test_ckpt_snapshot import seen_calling

    main, gate = threading.get_ident(), threading.Event()
    state = {"w": torch.ones(1 << 20)}
    with ckpt.CheckpointManager(tmp_path) as m:
        commit = m._commit
        m._commit = lambda *args: (gate.wait(30), commit(*args))[1]  # save 1 cannot finish before the gate
        first = m.save(1, state)
        threading.Thread(
            target=lambda: (seen_calling(main, "wait", "drain"), signal.pthread_kill(main, signal.SIGINT))
        ).start()
        with pytest.raises(KeyboardInterrupt):
            m.wait()
        assert not first.done()
        state["w"].fill_(2.0)
        threading.Thread(target=lambda: (seen_calling(main, "save", "drain"), gate.set())).start()
        m.save(2, state)
        assert first.done(), "save 2 copied into the arena while save 1 was still writing from it"
        m.wait()
    storage = open_storage(str(tmp_path))
    assert [list(catalog.verify(storage, s)) for s in (1, 2)] == [[], []]
    assert torch.equal(ckpt.load(tmp_path, step=1)["w"], torch.ones(1 << 20))
    assert torch.equal(ckpt.load(tmp_path, step=2)["w"], torch.full((1 << 20,), 2.0))


def test_a_ctrl_c_during_a_restore_leaves_the_callers_tensors_as_they_were(tmp_path, monkeypatch):
    """Ctrl-C while a restore's reads are in flight: the restore raises only once every read has stopped and the
    tensors read into directly have their bytes back (they used to go on being written after it raised)."""
    import signal

    from ckpt import packs
    from test_ckpt_snapshot import seen_calling

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.ones(1 << 21)}).wait()
    main, gate, reading = threading.get_ident(), threading.Event(), threading.Event()
    read_spans = packs._read_spans
    monkeypatch.setattr(packs, "_read_spans", lambda *a, **k: (reading.set(), gate.wait(30), read_spans(*a, **k))[2])
    interrupt = lambda: (  # noqa: E731 (a read in flight, held at the gate; the restore waiting for it)
        reading.wait(60),
        seen_calling(main, "execute", "result"),
        signal.pthread_kill(main, signal.SIGINT),
    )
    threading.Thread(target=lambda: (interrupt(), seen_calling(main, "execute", "wait"), gate.set())).start()
    target = {"w": torch.full((1 << 21,), 5.0)}
    m = ckpt.CheckpointManager(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        m.restore(target)
    m.close()  # its readers are done
    assert torch.equal(target["w"], torch.full((1 << 21,), 5.0)), "the reads went on into the caller's tensor"
    assert gate.is_set()
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(target) == 1 and torch.equal(target["w"], torch.ones(1 << 21))


@pytest.mark.parametrize("when", ["submitting", "applying"])
def test_a_ctrl_c_at_either_end_of_a_restore_leaves_the_state_whole_and_the_manager_closes(tmp_path, monkeypatch, when):
    """A SIGINT while the reads are being submitted (before the set-aside thread had started, the reads waited for it
    forever: close() and the interpreter's exit hung), or once they verified and land in the state (half the
    tensors were the checkpoint's, a strided one the caller's): the state is as before, or the checkpoint's whole,
    and KeyboardInterrupt is raised; the manager closes."""
    import signal

    from ckpt import packs
    from ckpt import restore as restore_mod

    def state(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        lin = torch.nn.Linear(64, 64)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(64, 64, generator=g))
            lin.bias.copy_(torch.randn(64, generator=g))
        return {"model": lin, "extra": {"w": torch.randn(32, 16, generator=g).t()}}  # strided: copied in by apply

    def values(s: dict) -> list:
        return [t.clone() for t in (*s["model"].state_dict().values(), s["extra"]["w"])]

    with ckpt.CheckpointManager(tmp_path, **UNPACKED) as m:  # arrays of their own: read before the packs
        m.save(1, state(1)).wait()
    module, name = (packs, "read_boxes") if when == "submitting" else (restore_mod, "apply")
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (signal.raise_signal(signal.SIGINT), real(*a, **k))[1])
    target = state(2)
    before, saved = values(target), values(state(1))
    m = ckpt.CheckpointManager(tmp_path, **UNPACKED)
    with pytest.raises(KeyboardInterrupt):
        m.restore(target)
    closing = threading.Thread(target=m.close, daemon=True)
    closing.start()
    closing.join(120)
    assert not closing.is_alive(), "close() hangs: reads wait for a set-aside thread that never started"
    expected = before if when == "submitting" else saved
    assert all(torch.equal(a, b) for a, b in zip(values(target), expected)), "a mixed state"
    monkeypatch.setattr(module, name, real)
    with ckpt.CheckpointManager(tmp_path) as m:
        assert m.restore(state(3)) == 1
    ckpt.load(tmp_path)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "Ctrl-C is held back for good"


_WAVES_PAST_A_LIMIT = r"""
import json, os, resource, signal, sys, torch, ckpt
root = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
g = torch.Generator().manual_seed(0)
small, big = {"w": torch.randn(100, 100, generator=g)}, {"w": torch.randn(1000, 1000, generator=g)}
fds = lambda: len(os.listdir("/proc/self/fd"))
seen = {}
with ckpt.CheckpointManager(root, max_staging_bytes=1 << 20) as m:
    m.save(1, small).wait()
    before = fds()
    for _ in range(3):
        try:
            m.save(2, big)  # 4 MB past a 1 MiB cap: its first waves are written inside save, and fail there
            seen["save"] = "no error"
        except OSError as e:
            seen["save"] = f"{type(e).__name__}: {e}"
    seen["fds_leaked"] = fds() - before
    seen["leftovers"] = sorted(os.listdir(root))
    m.save(3, small).wait()
    seen["steps"] = m.steps()
print(json.dumps(seen))
"""


def test_a_save_past_the_staging_cap_that_fails_inside_save_leaves_no_file_open_and_nothing_behind(tmp_path):
    """Past `max_staging_bytes` a save writes its first waves before it returns: a failure there is raised by
    `save` itself, and closes and removes what the save opened and wrote (it used to leak an fd and leave the
    step's files, which kept a full disk full)."""
    root = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-c", _WAVES_PAST_A_LIMIT, str(root)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert "File too large" in seen["save"], seen
    assert seen["fds_leaked"] == 0 and [d for d in seen["leftovers"] if d.startswith("step_")] == ["step_00000001"]
    assert seen["steps"] == [1, 3]


def test_a_close_interrupted_twice_still_releases_the_root_and_a_second_close_finishes_it(tmp_path):
    """Two Ctrl-Cs in `close()`: one in its wait for the save in flight, one while it stops the threads. The root's
    lease is released anyway, and another close() finishes the rest (the first close used to mark the manager
    closed before releasing anything: the lease stayed held by a closed manager)."""
    import signal

    from test_ckpt_snapshot import seen_calling

    main, gate = threading.get_ident(), threading.Event()

    def interrupt_twice() -> None:
        seen_calling(main, "wait", "drain")
        signal.pthread_kill(main, signal.SIGINT)
        seen_calling(main, "close", "shutdown")
        signal.pthread_kill(main, signal.SIGINT)
        gate.set()

    m = ckpt.CheckpointManager(tmp_path)
    commit = m._commit
    m._commit = lambda *args: (gate.wait(30), commit(*args))[1]
    m.save(1, {"w": torch.ones(4)})
    threading.Thread(target=interrupt_twice).start()
    with pytest.raises(KeyboardInterrupt):
        m.close()
    with ckpt.CheckpointManager(tmp_path) as other:  # the root's lease was released: another writer saves at once
        other.save(2, {"w": torch.full((4,), 2.0)}).wait()
    m.close()  # finishes stopping its threads (its save committed before the lease went, or never)
    assert not [t for t in threading.enumerate() if t.is_alive() and t.name.startswith(("ckpt-writer", "ckpt-copy"))]
    storage = open_storage(str(tmp_path))
    steps = layout.committed_steps(storage)
    assert set(steps) <= {1, 2} and 2 in steps and all(list(catalog.verify(storage, s)) == [] for s in steps)


def test_a_step_name_taken_by_a_file_or_link_is_refused_naming_it_and_later_steps_save(tmp_path):
    """A file or symbolic link named like a step (a user's copy, a link to another root's step) is no step: saving
    that step is refused naming what is there (the link was "already committed"; the file, whose write fails in the
    background, a NotADirectoryError from inside the write), the link's target is untouched, and the other steps
    save and restore."""
    root = tmp_path / "root"
    root.mkdir()
    (root / layout.step_dir(2)).write_text("notes")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / layout.step_dir(3)).symlink_to(elsewhere)
    with ckpt.CheckpointManager(str(root)) as m:
        said = "{} is {}, not a step directory; move it out of the root"
        with pytest.raises(CheckpointWriteError, match=said.format(root / layout.step_dir(2), "a file")):
            m.save(2, {"w": torch.ones(2)}).wait()
        with pytest.raises(ckpt.StepExistsError, match=said.format(root / layout.step_dir(3), "a symbolic link")):
            m.save(3, {"w": torch.ones(2)})
        m.save(4, {"w": torch.full((2,), 4.0)}).wait()
        out = {"w": torch.zeros(2)}
        assert m.restore(out) == 4 and out["w"].tolist() == [4.0, 4.0]
    assert list(elsewhere.iterdir()) == [] and (root / layout.step_dir(2)).read_text() == "notes"
