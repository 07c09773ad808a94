"""Directory entries are durable before a manifest vouches for them: every new directory is fsync'd, and the root."""

import os

import torch

import ckpt


def test_every_directory_of_a_step_and_the_root_are_fsynced_before_the_manifest_is_published(tmp_path, monkeypatch):
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
    with ckpt.CheckpointManager(root, chunk_bytes=1024) as m:  # several chunks: c/0/0, c/1/0, ...
        m.save(3, state).wait()
    step = root / "step_00000003"
    published = events.index(("link", str(step / "manifest.json")))
    synced_before = {path for kind, path in events[:published] if kind == "fsync"}
    dirs = {d for d, _, _ in os.walk(step)} | {str(root), str(root.parent), str(tmp_path)}
    assert len(dirs) > 10
    assert not dirs - synced_before, f"not fsync'd before the manifest: {sorted(dirs - synced_before)}"
    assert ("fsync", str(step)) in events[published:], "the manifest's own directory entry is made durable"
