"""The manager's settings as types: checked where they are made, the keywords as their shorthands, the local
tier's retention a real policy."""

import pytest
import torch

from ckpt import (
    CheckpointManager,
    KeepBest,
    KeepEvery,
    RootOptions,
    ShuffledSampler,
    StateKeyError,
    TierOptions,
    WriteOptions,
    layout,
    load,
)
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


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: CheckpointManager(None), "root must be a path or URL .str or os.PathLike., got NoneType None"),
        (lambda: CheckpointManager("/tmp/x", alone="yes"), "alone must be True or False, got 'yes'"),
        (lambda: WriteOptions(chunk_bytes="64MB"), "chunk_bytes must be an int, got '64MB'"),
        (lambda: WriteOptions(io_threads=1.5), "io_threads must be an int, got 1.5"),
        (lambda: TierOptions(3), "local must be a directory .a str or path., got 3"),
        (lambda: RootOptions(storage_options=3), "storage_options must be a dict, got 3"),
        (lambda: RootOptions(run_id=5), "run_id must be a non-empty str, got 5"),
        (lambda: RootOptions(lease_ttl="a"), "lease_ttl must be a number of seconds, got 'a'"),
        (lambda: KeepBest(1, 3), "best_metric must be the metadata key"),
        (lambda: ShuffledSampler(4.5, 2, 0), "num_items must be an int, got float 4.5"),
    ],
)
def test_an_option_of_the_wrong_type_fails_where_it_is_made_naming_the_field(make, message):
    """Not later, from deep inside a save (an AttributeError of None, a comparison of str and int)."""
    with pytest.raises(TypeError, match=message):
        make()


def test_the_manager_refuses_a_tracker_an_empty_root_and_arguments_of_the_wrong_type(tmp_path):
    with pytest.raises(ValueError, match="root must be a path or URL, got ''"):
        CheckpointManager("")  # an unset variable: not the working directory
    with pytest.raises(TypeError, match="tracker must be a CheckpointObserver"):
        CheckpointManager(tmp_path, tracker=1)
    with CheckpointManager(tmp_path) as m:
        m.save(1, state(1)).wait()
        m.save(2, state(2)).wait()
        with pytest.raises(TypeError, match=r"keys must be a list of top-level keys, e.g. \['w'\], not a str"):
            m.restore(state(0), keys="w")
        with pytest.raises(TypeError, match="state must be a dict"):
            m.restore([1])
        with pytest.raises(ValueError, match=r"step must be a non-negative int below 2\*\*63, got '1'"):
            m.delete("1")
    with pytest.raises(StateKeyError, match="key 'nope' is not in checkpoint step 2"):
        load(tmp_path, keys=["nope"])
    with pytest.raises(ValueError, match="io_threads must be an int >= 1, got 0"):
        load(tmp_path, io_threads=0)


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
