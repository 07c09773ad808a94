"""Where a committed step keeps its arrays and packs, for tests that damage or inspect their files (see ckpt.layout)."""

from __future__ import annotations

import os

from ckpt import layout
from ckpt.storage import Storage, open_storage


def data_dir(root, step: int) -> str:
    """The local directory holding step `step`'s arrays and packs (the one its manifest names)."""
    manifest = layout.read_manifest(open_storage(str(root)), step)
    return os.path.join(str(root), layout.step_dir(step), manifest.data)


def array_path(storage: Storage, step: int, name: str) -> str:
    """The directory of an array of a committed step, relative to the root (any kind of root)."""
    return layout.array_path(step, name, layout.read_manifest(storage, step).data)


def pack_path(storage: Storage, step: int, name: str) -> str:
    """The directory of a pack array of a committed step, relative to the root (any kind of root)."""
    return layout.pack_path(step, name, layout.read_manifest(storage, step).data)


def to_old_layout(root, step: int) -> None:
    """Move a step's arrays and packs up into its step directory, where formats before ckpt/4 kept them (the
    caller rewrites the manifest's format)."""
    data = data_dir(root, step)
    for name in os.listdir(data):
        os.rename(os.path.join(data, name), os.path.join(os.path.dirname(data), name))
    os.rmdir(data)
