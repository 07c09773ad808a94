"""A corpus of token shards read as one stream at the disk's random-read rate, the same windows as one file.

    python examples/token_shards.py [DIR]    # writes 4 shards of 8 MiB under DIR (default: a temp dir)

`TokenWindowDataset` takes the shard directory; `make_loader` serves it through the batch window reader (O_DIRECT
reads in flight together, the next batches read ahead), with or without DataLoader workers. The script checks
each batch against the concatenated shards and prints which reader backend served it.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from ckpt import RandomWindowSampler, TokenWindowDataset, make_loader

SHARDS, SHARD_TOKENS, WINDOW = 4, 4 << 20, 2048


def main(folder: str) -> None:
    rng = np.random.default_rng(0)
    for i in range(SHARDS):
        rng.integers(0, 50_000, SHARD_TOKENS, dtype=np.uint16).tofile(os.path.join(folder, f"shard-{i:05d}.bin"))
    dataset = TokenWindowDataset(folder, np.uint16, WINDOW, seed=0)  # the directory's files, by name
    stream = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in dataset.files])
    for workers in (0, 2):
        sampler = RandomWindowSampler(
            dataset.n_tokens, WINDOW, WINDOW // 2, global_batch_size=64, seed=0, fingerprint=dataset.fingerprint()
        )
        batches = sampler.track(make_loader(dataset, sampler, num_workers=workers))
        for _, batch in zip(range(20), batches):
            starts = batch["start"].numpy()
            assert np.array_equal(batch["tokens"].numpy(), stream[starts[:, None] + np.arange(WINDOW)])
        print(f"{workers} workers: 20 batches of 64 windows equal the concatenated shards (step {sampler.step})")
    print(f"{len(dataset.files)} shards, {dataset.n_tokens:,} tokens, fingerprint {dataset.fingerprint()}, "
          f"backend {dataset.reader().backend}")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", nargs="?", default=None, help="where the shards are written (default: a temp dir)")
    folder = p.parse_args().dir
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        main(folder)
    else:
        with tempfile.TemporaryDirectory() as folder:
            main(folder)
