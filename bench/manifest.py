"""The metadata a restore reads on every rank, against world size and tensor count: ckpt's manifest beside DCP's.

Each of T float32 tensors of shape (4R, 256) is row-sharded over R ranks, as FSDP shards it: R boxes per tensor,
placed in the ranks' packs, each with its crc32c. For ckpt the figures are the bytes of ``manifest.json``, the
leader's time to build them (`Manifest.to_bytes`, at each commit) and a reader's time to parse and validate them
(`Manifest.from_bytes`, on every rank at each restore). For DCP, the same layout as `torch.distributed.checkpoint`
records it in ``.metadata`` (a `Metadata` of `TensorStorageMetadata` chunks and `_StorageInfo` entries), pickled as
DCP writes it and unpickled as each rank's `load` reads it. Medians of `--repeats`, one process, no disk.

    .venv/bin/python bench/manifest.py                          # R x T in 8 x 1,000, 64 x 1,000, 256 x 1,000
    .venv/bin/python bench/manifest.py --shapes 8x100,1000x20
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kit import positive  # noqa: E402

COLS = 256


def ckpt_manifest(ranks: int, tensors: int):
    """A committed step's manifest of the layout above."""
    from ckpt.format import ArrayInfo, Manifest

    box_bytes = 4 * COLS * 4
    pack_bytes = tensors * box_bytes
    packs = {
        f"rank_{r:05d}": ArrayInfo(
            f"rank_{r:05d}", "uint8", (pack_bytes,), (pack_bytes,), (((0, pack_bytes),),), raw=True
        )
        for r in range(ranks)
    }
    arrays, tree = {}, {}
    for t in range(tensors):
        name = f"model.layers.{t}.weight"
        arrays[name] = ArrayInfo(
            name,
            "float32",
            (4 * ranks, COLS),
            (4 * ranks, COLS),
            tuple(((4 * r, 4 * r + 4), (0, COLS)) for r in range(ranks)),
            digests=tuple(0x1234ABCD for _ in range(ranks)),
            places=tuple((f"rank_{r:05d}", t * box_bytes) for r in range(ranks)),
            segment=64 << 20,
        )
        tree[f"layers.{t}.weight"] = {"$array": name}
    return Manifest(0, {"model": tree}, arrays, {}, time.time(), world_size=ranks, packs=packs, data="w-000000000000")


def dcp_metadata(ranks: int, tensors: int):
    """DCP's `.metadata` for the same layout."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    box_bytes = 4 * COLS * 4
    state, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        chunks = [ChunkStorageMetadata(torch.Size([4 * r, 0]), torch.Size([4, COLS])) for r in range(ranks)]
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4 * ranks, COLS]), chunks)
        for r in range(ranks):
            storage[MetadataIndex(fqn, torch.Size([4 * r, 0]))] = _StorageInfo(
                f"__{r}_0.distcp", t * box_bytes, box_bytes
            )
    return Metadata(state_dict_metadata=state, storage_data=storage)


def _median(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def shape_list(text: str) -> str:
    """The argparse type of `--shapes`: comma-separated RxT pairs of integers > 0."""
    for shape in text.split(","):
        r, _, t = shape.lower().partition("x")
        if not (r.isdigit() and t.isdigit() and int(r) > 0 and int(t) > 0):
            raise argparse.ArgumentTypeError(f"expected RxT with integers > 0 (8x1000), got {shape!r}")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=shape_list, default="8x1000,64x1000,256x1000", help="RxT pairs, comma-separated")
    p.add_argument("--repeats", type=positive(int), default=3)
    args = p.parse_args()
    from ckpt.format import Manifest

    print("| ranks | tensors | boxes | ckpt manifest MB | ckpt build s | ckpt parse s | us/box | DCP .metadata MB "
          "| DCP pickle s | DCP unpickle s | parse / unpickle |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        ranks, tensors = (int(x) for x in shape.lower().split("x"))
        manifest = ckpt_manifest(ranks, tensors)
        build, data = _median(manifest.to_bytes, args.repeats)
        parse, _ = _median(lambda: Manifest.from_bytes(data, file="manifest.json"), args.repeats)
        meta = dcp_metadata(ranks, tensors)
        dump, blob = _median(lambda: pickle.dumps(meta), args.repeats)
        load, _ = _median(lambda: pickle.loads(blob), args.repeats)
        boxes = ranks * tensors
        print(
            f"| {ranks:,} | {tensors:,} | {boxes:,} | {len(data) / 1e6:.1f} | {build:.3f} | {parse:.3f} | "
            f"{parse / boxes * 1e6:.1f} | {len(blob) / 1e6:.1f} | {dump:.3f} | {load:.3f} | {parse / load:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
