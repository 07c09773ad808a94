"""Directory entries are durable before a manifest vouches for them: every new directory is fsync'd, and the root."""

import os
import time

import pytest
import torch

import ckpt


@pytest.mark.parametrize("kw", [{}, {"pack_bytes": 0}], ids=["packed", "arrays"])
def test_every_directory_of_a_step_and_the_root_are_fsynced_before_the_manifest_is_published(tmp_path, monkeypatch, kw):
    events: list[tuple[str, str]] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd):  # observes which file or directory is synced, then syncs it
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def link(src, dst, **kw):  # the manifest is published by a hard link: it never replaces a file
        real_link(src, dst, **kw)
        events.append(("link", os.fspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    root = tmp_path / "new" / "ck"  # the root itself is new too
    state = {
        "model": {"fc": {"weight": torch.randn(40, 30), "bias": torch.randn(30)}},
        "scalar": torch.tensor(1.5),
        "step": 3,
    }
    with ckpt.CheckpointManager(root, chunk_bytes=1024, **kw) as m:  # several chunks: c/0/0, c/1/0, ...
        m.save(3, state).wait()
    step = root / "step_00000003"
    published = events.index(("link", str(step / "manifest.json")))
    synced_before = {path for kind, path in events[:published] if kind == "fsync"}
    dirs = {d for d, _, _ in os.walk(step)} | {str(root), str(root.parent), str(tmp_path)}
    assert len(dirs) > (10 if kw else 6)
    assert not dirs - synced_before, f"not fsync'd before the manifest: {sorted(dirs - synced_before)}"
    assert ("fsync", str(step)) in events[published:], "the manifest's own directory entry is made durable"


@pytest.mark.parametrize("kw", [{}, {"pack_bytes": 0}], ids=["packed", "arrays"])
def test_every_chunk_file_is_fdatasynced_before_the_manifest_exists(tmp_path, monkeypatch, kw):
    """The data of every chunk file written by the save itself is durable before the commit: each is fdatasync'd (or
    fsync'd), and every such call happens while the step's manifest does not exist yet."""
    root = tmp_path / "ck"
    manifest = root / "step_00000001" / "manifest.json"
    synced: dict[str, bool] = {}  # file -> the manifest existed when it was synced
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync")}

    def recorder(name):
        def sync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if os.path.isfile(path):
                time.sleep(0.05)  # a slow disk: a commit that did not wait for the syncs publishes before they end
                synced[path] = synced.get(path, False) or manifest.exists()
            return real[name](fd)

        return sync

    for name in real:
        monkeypatch.setattr(os, name, recorder(name))
    state = {"w": torch.randn(512, 1024), "v": torch.randn(300, 700), "small": torch.randn(10)}
    with ckpt.CheckpointManager(root, chunk_bytes=256 << 10, **kw) as m:  # several chunk files (per array)
        m.save(1, state).wait()
    chunks = [os.path.join(d, f) for d, _, fs in os.walk(root / "step_00000001") for f in fs if "/c/" in d + "/"]
    assert len(chunks) > 4 if kw else len(chunks) == 4  # the pack's 4 files
    missing = [c for c in chunks if c not in synced]
    assert not missing, f"chunk files never synced: {missing}"
    late = [c for c in chunks if synced[c]]
    assert not late, f"chunk files synced only after the manifest was published: {late}"


def test_a_deleted_step_loses_its_manifest_before_any_of_its_files(tmp_path, monkeypatch):
    """Retention and delete() remove the manifest first: a crash in the middle leaves an uncommitted leftover,
    never a manifest vouching for chunks that are gone."""
    from ckpt.storage import LocalStorage

    root = tmp_path / "ck"
    with ckpt.CheckpointManager(root) as m:
        for s in (1, 2):
            m.save(s, {"w": torch.randn(256, 256)}).wait()
    real = LocalStorage.delete_tree
    seen: list[bool] = []

    def delete_tree(self, path):
        if path.startswith("step_00000001"):
            seen.append((root / "step_00000001" / "manifest.json").exists())
        return real(self, path)

    monkeypatch.setattr(LocalStorage, "delete_tree", delete_tree)
    with ckpt.CheckpointManager(root) as m:
        m.delete(1)
        m.wait()
        assert m.steps() == [2]
    assert seen and not any(seen), "files of step 1 were deleted while its manifest still vouched for them"
