"""Two nodes on one machine (`tests/cluster.py`: network namespaces on a bridge, each node with its own hostname and
tmpfs) running the demo's model under torchrun's multi-node rendezvous with two tiers and the peer replica on the
other node; node losses at random instants, each resumed bitwise from the newest surviving copy.

Skipped, naming what is missing, where this process may not create namespaces (not root, no `ip`, unshare refused).
Set CLUSTER_SEED to replay a run's random instants (the seed is in every failure message).
"""

import json
import os
import random
import re
import statistics
import subprocess
import sys

import pytest

import cluster
from examples.lm_demo.corpus import write_corpus

REASON = cluster.missing()
if REASON:
    pytest.skip(f"the two-node cluster harness cannot run here: {REASON}", allow_module_level=True)

STEPS = 24  # every 2 steps a local save, every 3rd of them persisted: 12 saves, 4 durable
SEED = int(os.environ.get("CLUSTER_SEED", random.randrange(1 << 16)))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two nodes for the module, torn down at its end whatever happened."""
    work = tmp_path_factory.mktemp("cluster")
    write_corpus(work / "corpus.bin", 100_000)
    with cluster.Cluster(work) as c:
        yield c


@pytest.fixture(scope="module")
def reference(nodes):
    """One uninterrupted run, which every interrupted one must equal bitwise."""
    job = cluster.Job(nodes, "reference", steps=STEPS)
    job.launch()
    assert job.wait() == {0: 0, 1: 0}, job.text()[-4000:]
    return job


def test_the_namespaces_a_killed_run_left_are_removed_and_a_live_runs_are_kept(nodes):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{cluster.PREFIX}{gone.pid}x0000-n0"  # named after a process that no longer exists
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in cluster.cleanup_stale()  # and not this run's own: its creator is alive
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in listed and nodes.nodes[0].ns in listed
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def _hostname(node) -> str:
    enter = ["nsenter", "-t", str(node.init), "-u", "hostname"]
    return subprocess.run(enter, capture_output=True, text=True, check=True).stdout.strip()


def test_two_nodes_each_with_its_hostname_tmpfs_and_link_local_address_train_under_torchrun(nodes, reference):
    from ckpt import layout
    from ckpt.storage import LocalStorage

    assert [_hostname(n) for n in nodes.nodes] == ["node0", "node1"]
    assert all(n.addr.startswith("169.254.") for n in nodes.nodes)
    assert list(nodes.nvme.iterdir()) == []  # the host sees none of the nodes' tmpfs
    for n in nodes.nodes:
        ranks = [2 * n.index, 2 * n.index + 1]  # torchrun ranks the nodes by their address: node i has 2i, 2i+1
        tier = n.path(reference.local)
        assert sorted(os.listdir(tier)) == [str(r) for r in ranks]
        for r in ranks:
            local = LocalStorage(str(tier / str(r)))
            assert layout.committed_steps(local) == [STEPS - 2, STEPS]  # keep_local=2
            assert layout.replica_ranks(local) == [(r + 2) % 4]  # the same local rank of the other node
    final = json.loads((reference.root / "final.json").read_text())
    assert final["steps"] == STEPS
    records = reference.records()
    assert records["done"] == {0, 1, 2, 3} and len(records["loss"]) == 4 * STEPS


def test_node_losses_resume_bitwise_from_the_newest_surviving_copy(nodes, reference):
    rng = random.Random(SEED)
    losses = [(rng.randrange(2),), None, (0, 1), (0, 1)]  # six nodes lost: one, the other, then both twice
    losses[1] = (1 - losses[0][0],)
    rng.shuffle(losses)
    job = cluster.Job(nodes, "chaos", steps=STEPS)
    seen = cluster.node_loss(job, rng, losses, say=lambda line: print(line, flush=True))
    assert job.wait() == {0: 0, 1: 0}, f"seed {SEED}: {job.text()[-4000:]}"

    for record in seen:  # each resumed from the step and tier the surviving copies allow
        step, tiers = record["expected"]
        assert record["got"] == {r: (step, tiers[r]) for r in range(4)}, f"seed {SEED}: {record}"
    assert {t for r in seen for _, t in r["got"].values()} == {"local", "peer", "durable"}, f"seed {SEED}"
    assert json.loads((job.root / "final.json").read_text()) == json.loads((reference.root / "final.json").read_text())
    want = reference.records()["loss"]
    for attempt in range(1, job.attempt + 1):  # every step of every attempt, bitwise the reference's loss
        for key, loss in job.records(attempt)["loss"].items():
            assert loss == want[key], f"seed {SEED}: attempt {attempt}, (rank, step) {key}: {loss} != {want[key]}"

    done = subprocess.run(
        [sys.executable, "-m", "ettr", "report", str(job.root), "--json"], capture_output=True, text=True, check=True
    )
    report = json.loads(done.stdout)
    assert set(report["restores_per_tier"]) == {"local", "peer", "durable"}
    assert report["failures"] >= len(losses) and report["seconds"]["lost"] > 0 and report["seconds"]["downtime"] > 0
    tiers = {a["restored_tier"] for a in report["attempts"] if a["restored_tier"]}
    assert tiers == {"local", "peer", "durable"}
    print(f"seed {SEED}: restores per tier {report['restores_per_tier']}", flush=True)


TIMEOUT = 5.0  # the fault job's collective_timeout


def test_partitions_and_a_stopped_rank_fail_every_rank_within_the_timeout_and_commit_nothing_partial(nodes):
    job = cluster.Job(
        nodes,
        "faults",
        script=cluster.FAULTS,
        args=[f"--gates={nodes.workdir / 'faults' / 'gates'}", f"--timeout={TIMEOUT}"],
    )
    cases = ["save", "persist", "replicate", "sigstop"]
    seen = cluster.faults(job, cases, node=1, say=lambda line: print(line, flush=True))
    for case in cases:
        got, step = seen[case], seen[case]["step"]
        assert got["detected_s"] <= TIMEOUT + 10, (case, got["detected_s"])
        for rank, (seconds, kind, message) in got["failures"].items():
            assert kind in ("CheckpointWriteError", "CollectiveTimeout"), (case, rank, kind, message)
            named = re.search(r"rank (\d+) waited for rank (\d+)", message)
            assert named and int(named.group(1)) == rank and int(named.group(2)) != rank, (case, rank, message)
            assert rank == 3 and case == "sigstop" or seconds <= TIMEOUT + 10, (case, rank, seconds)
        if case == "sigstop":  # the ranks that were not stopped name it, or the leader that waited for it
            assert "waited for rank 3" in got["failures"][0][2]
        assert step not in got["durable"]  # nothing partial: in no tier, or whole in every rank's
        local = {r for r, inv in enumerate(got["inventories"]) if step in inv["local"]}
        replica = {r for inv in got["inventories"] for r, steps in inv["replica"].items() if step in steps}
        assert local in (set(), {0, 1, 2, 3}) and replica in (set(), {"0", "1", "2", "3"}), (case, local, replica)
        assert local == (set() if case in ("save", "sigstop") else {0, 1, 2, 3}), (case, local)
        assert replica == (set() if case != "persist" else {"0", "1", "2", "3"}), (case, replica)
        assert step + 1 in got["after"]  # the link is back: the next save commits, in the durable tier too


def test_a_slow_link_still_commits_and_replication_takes_longer(nodes, reference):
    """50 ms of netem delay on node 1's link; where the kernel has no netem (say so), a slow NIC instead: what node 1
    sends is limited to `cluster.SLOW_MBIT` by a token bucket. Saves commit, and every replication takes at least
    the delay (or the time the bytes node 1 sends take at that rate), which most of the reference's did not."""
    no_netem = cluster.netem_missing()
    job = cluster.Job(nodes, "slow", steps=8)
    if no_netem:
        print(f"no 50 ms delay ({no_netem}): node 1 limited to {cluster.SLOW_MBIT} Mbit/s instead", flush=True)
        nodes.nodes[1].rate(cluster.SLOW_MBIT)
    else:
        nodes.nodes[1].delay(50)
    try:
        job.launch()
        codes = job.wait()
        shaped = nodes.nodes[1].qdisc()
    finally:
        nodes.nodes[1].delay(None)
    assert codes == {0: 0, 1: 0}, job.text()[-4000:]
    assert json.loads((job.root / "final.json").read_text())["steps"] == 8
    assert not no_netem or int(re.search(r"overlimits (\d+)", shaped).group(1)) > 0, shaped  # the bucket held packets
    fast, slow = cluster.replication_seconds(reference.text()), cluster.replication_seconds(job.text())
    # each replication moves bytes node 1 sends (its ranks' replicas, the status): it cannot take less than the delay,
    # or than one replica's bytes at the limited rate (node 1 sends two at once). The least time is the figure: the
    # rest is the writer thread's share of two cores beside four training ranks, which varies run to run.
    # (less the bucket's 4 KB burst and a margin: 0.9 of the bytes' time)
    least = 0.05 if not no_netem else 0.9 * max(cluster.replication_bytes(job.text())) * 8 / (cluster.SLOW_MBIT * 1e6)
    print(
        f"replication moving bytes: least {min(fast):.3f} s (median {statistics.median(fast):.3f} s), with node 1 "
        f"{'delayed 50 ms' if not no_netem else f'at {cluster.SLOW_MBIT} Mbit/s'} least {min(slow):.3f} s (median "
        f"{statistics.median(slow):.3f} s); the link alone makes it at least {least:.3f} s",
        flush=True,
    )
    assert min(slow) >= least > statistics.median(fast), (fast, slow, least)
