"""The manager's settings as types: checked where they are made, the keywords as their shorthands, the local
tier's retention a real policy."""

import pytest
import torch

from ckpt import CheckpointManager, KeepBest, KeepEvery, RootOptions, TierOptions, WriteOptions, layout
from ckpt.storage import open_storage
from integrations.loop import TrainLoop


def state(s: int) -> dict:
    return {"w": torch.full((64,), float(s))}


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: WriteOptions(chunk_bytes=0), r"chunk_bytes must be in \[1, "),
        (lambda: WriteOptions(snapshot="lazy"), "snapshot must be one of"),
        (lambda: WriteOptions(pack_bytes=-1), "pack_bytes must be >= 0, got -1"),
        (lambda: WriteOptions(io_threads=0), "io_threads must be >= 1, got 0"),
        (lambda: TierOptions("/tmp/x", persist_every=0), "persist_every and keep_local must be >= 1, got 0 and 2"),
        (lambda: RootOptions(lease_ttl=0), "lease_ttl must be positive seconds, got 0"),
        (lambda: RootOptions(collective_timeout=-1), "collective_timeout must be positive seconds, got -1"),
    ],
)
def test_a_bad_option_fails_where_it_is_made_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_write_budget_that_is_neither_a_budget_nor_a_share_is_refused_at_once():
    with pytest.raises(TypeError, match="write_budget must be a WriteBudget or a share of the CPUs"):
        WriteOptions(write_budget="half")


def test_an_option_object_and_its_shorthand_together_are_refused_naming_both(tmp_path):
    with pytest.raises(ValueError, match=r"give write= or the keywords \['chunk_bytes'\], not both"):
        CheckpointManager(str(tmp_path), write=WriteOptions(), chunk_bytes=1 << 20)
    with pytest.raises(TypeError, match="tiers must be a TierOptions"):
        CheckpointManager(str(tmp_path), tiers={"local": str(tmp_path / "l")})
    with pytest.raises(ValueError, match=r"\['persist_every'\] need local="):
        CheckpointManager(str(tmp_path), persist_every=2)  # a tier setting without a tier is not silently dropped


def test_the_object_and_the_keywords_save_the_same_checkpoint(tmp_path):
    """`pack_bytes=0` (every tensor its own array) through either spelling gives the same manifest arrays."""
    arrays = []
    for name, kw in (("kw", {"pack_bytes": 0}), ("obj", {"write": WriteOptions(pack_bytes=0)})):
        root = str(tmp_path / name)
        with CheckpointManager(root, **kw) as m:
            m.save(1, {"a": torch.ones(3), "b": torch.zeros(2)}).wait()
        arrays.append(sorted(layout.read_manifest(open_storage(root), 1).arrays))
    assert arrays[0] == arrays[1] == ["a", "b"]


def test_the_local_tier_keeps_what_its_retention_policy_says_and_always_its_newest(tmp_path):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    tiers = TierOptions(local, persist_every=100, local_retention=KeepEvery(2))
    with CheckpointManager(durable, tiers=tiers) as m:
        for s in range(1, 6):
            m.save(s, state(s)).wait()
    assert layout.committed_steps(open_storage(local)) == [2, 4, 5]  # the even ones, and 5, the newest
    # a policy that reads metadata reads the local tier's manifests
    local2 = str(tmp_path / "local2")
    tiers = TierOptions(local2, persist_every=100, local_retention=KeepBest(1, "loss"))
    with CheckpointManager(str(tmp_path / "durable2"), tiers=tiers) as m:
        for s, loss in ((1, 0.5), (2, 0.1), (3, 0.9), (4, 0.7)):
            m.save(s, state(s), metadata={"loss": loss}).wait()
    assert layout.committed_steps(open_storage(local2)) == [2, 4]  # the best, and the newest


def test_the_integrations_check_their_manager_options_where_they_are_configured(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="chunk_bytes must be in"):
        TrainLoop(str(tmp_path), {"model": model}, every_steps=1, chunk_bytes=0)
    loop = TrainLoop(str(tmp_path), {"model": model}, every_steps=1, write=WriteOptions(snapshot="overlap"))
    assert loop._manager_options["write"].snapshot == "overlap"
