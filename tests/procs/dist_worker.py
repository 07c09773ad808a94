"""One rank of the distributed tests (gloo on 127.0.0.1, FSDP2 on a CPU mesh).

Modes: "save" trains 2 steps sharded at world size W, saves step 2 and dumps a full reference;
"restore" rebuilds at W (1 = no process group), restores and compares bitwise; "kill" saves step 1,
then rank 1 dies during the save of step 2; "damaged:replicated" / "damaged:shard" save steps 1 and 2
(a full reference of step 1 beside the root), rank 0 flips a byte of step 2 in a chunk every rank reads
(the replicated table) or only the last rank reads (a row shard of model.0.weight; a copy of the root is
kept for "restore_damaged"), then every rank restores; "restore_damaged" restores that copy at W and
compares with step 1. Run as a script (RANK/WORLD_SIZE/MASTER_* in the environment) or through
`run(...)` from a forkserver that has torch preloaded.
"""

import gc
import os
import shutil
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

import ckpt
from ckpt import RNGState

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def run(mode: str, root: str, rank: int, world: int, port: int, log: str) -> None:
    """Entry point for one rank started from a forkserver: environment, output to `log`, then main."""
    global WORLD
    WORLD = world
    redirect(rank, world, port, log)
    main(mode, root)


def redirect(rank: int, world: int, port: int, log: str) -> None:
    """A rank's environment for torch.distributed on 127.0.0.1, one thread, stdout and stderr into `log`."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def build(out: int = 8):
    """The FSDP2 model (plain at world size 1) and its Adam; `out` = 1 gives a head no rank but rank 0 holds a row
    of."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 40), torch.nn.Linear(40, out)
    )
    if WORLD > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def flat_reference(model, opt):
    ref = {f"model.{k}": full(v).clone() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            ref[f"opt.{pid}.{k}"] = full(v).clone()
    return ref


def state_of(model, opt):
    # just over 1 MiB, replicated on every rank: must be stored once
    table = torch.arange((1 << 18) + 1024, dtype=torch.float32)
    return {"model": model, "opt": opt, "rng": RNGState(), "table": table}


def train(model, opt, g) -> None:
    model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _damage(root: str, what: str) -> str:
    """Flip a byte of step 2: in the replicated table (every rank reads it) or in model.0.weight's last rows (only
    the last rank's shard covers them). Returns the pack file's path."""
    from ckpt.layout import read_manifest
    from ckpt.storage import open_storage

    manifest = read_manifest(open_storage(root), 2)
    data = os.path.join(root, "step_00000002", manifest.data)  # the save's files
    info = manifest.arrays["table" if what == "replicated" else "model/0.weight"]
    assert what == "replicated" or len(info.boxes) > 1, f"one box for every shard: {info}"
    pack, offset = info.places[-1]  # its last box
    size = manifest.packs[pack].chunk[0]
    path = os.path.join(data, "packs", pack, "c", str(offset // size))
    with open(path, "r+b") as f:
        f.seek(offset % size)
        byte = f.read(1)
        f.seek(offset % size)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def restore_and_compare(m, model, opt, reference_path: str) -> None:
    """Restore the newest intact step; print it, the tensors that differ from the reference, and the warnings."""
    rank = dist.get_rank() if WORLD > 1 else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = m.restore(state_of(model, opt))
    got, ref = flat_reference(model, opt), torch.load(reference_path)
    bad = [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]
    print(f"rank {rank} restored {step}: mismatched {bad}; {[str(w.message) for w in caught]}", flush=True)


def main(mode: str, root: str) -> None:
    if WORLD > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if WORLD > 1 else 0
    model, opt = build()
    if mode.startswith("damaged:"):
        g = torch.Generator().manual_seed(1)
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            for step in (1, 2):
                train(model, opt, g)
                m.save(step, state_of(model, opt)).wait()
                reference = flat_reference(model, opt)  # full_tensor() is a collective: every rank
                if step == 1 and rank == 0:
                    torch.save(reference, os.path.join(root, "..", "reference1.pt"))
            if rank == 0:
                chunk = _damage(root, mode.split(":")[1])
                print(f"damaged {chunk}", flush=True)
                if mode == "damaged:shard":
                    shutil.copytree(root, f"{root}.copy")
            dist.barrier()
            restore_and_compare(m, model, opt, os.path.join(root, "..", "reference1.pt"))
    elif mode in ("head1_save", "head1_restore"):
        # a one-row head: at world size 2 rank 1's shards of its weight and bias, and of their Adam moments, are empty
        model, opt = build(out=1)
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            if mode == "head1_save":
                train(model, opt, torch.Generator().manual_seed(1))
                m.save(1, state_of(model, opt)).wait()
                reference = flat_reference(model, opt)
                if rank == 0:
                    torch.save(reference, os.path.join(root, "..", "reference_head1.pt"))
                print(f"rank {rank} saved", flush=True)
            else:
                restore_and_compare(m, model, opt, os.path.join(root, "..", "reference_head1.pt"))
    elif mode == "partial":
        # a Partial DTensor is a pending sum: each rank's local part is one term of it, never the value to save
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = init_device_mesh("cpu", (WORLD,))
        pending = DTensor.from_local(torch.full((3,), rank + 1.0), mesh, [Partial()])
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            try:
                m.save(1, {"p": pending}).wait()
                print(f"saved, reads back {ckpt.load(root)['p'].tolist()} of {pending.full_tensor().tolist()}")
            except TypeError as e:
                print(f"save refused: {e}", flush=True)
            m.save(2, {"p": DTensor.from_local(torch.full((3,), 3.0), mesh, [Replicate()])}).wait()
            try:
                m.restore({"p": pending})
                print(f"restored into a sum of {pending.full_tensor().tolist()}", flush=True)
            except ckpt.StateMismatchError as e:
                print(f"restore refused: {e}; local part {pending.to_local().tolist()}", flush=True)
    elif mode == "replan":
        g = torch.Generator().manual_seed(1)
        agreements, extras = [], {4: torch.arange(10.0), 5: torch.arange(12.0).reshape(3, 4)}
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            for step in range(1, 6):
                train(model, opt, g)
                state = state_of(model, opt)
                if step in extras:  # the state's structure changes: a new tensor, then its shape
                    state["extra"] = extras[step]
                m.save(step, state).wait()
                agreements.append(m._planner.agreements)
            ref = flat_reference(model, opt)
        print(f"agreements {agreements}", flush=True)
        model, opt = build()
        state = {**state_of(model, opt), "extra": torch.zeros(3, 4)}
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            step = m.restore(state, step=5)
        got = flat_reference(model, opt)
        bad = [k for k in ref if not torch.equal(ref[k], got[k])]
        print(f"restored {step}: mismatched {bad}, extra {state['extra'].flatten().tolist()}", flush=True)
    elif mode == "sweep":
        # an evaluation sweep: a manager (two tiers: a group for the persists too) per checkpoint, each closed
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            m.save(1, state_of(model, opt)).wait()
        fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
        before = fds()
        for _ in range(10):
            with ckpt.CheckpointManager(root, local=f"{root}.local/{rank}", collective_timeout=20) as m:
                m.restore(state_of(model, opt), track=False)
        print(f"fds grew {fds() - before} over 10 managers", flush=True)
    elif mode == "delete":
        # the shared root has one writer: a delete by rank 1 alone leaves it as it is; one by every rank is rank 0's,
        # also when rank 0's came first (rank 1 then finds the step gone); no collective may time out on a busy machine
        with ckpt.CheckpointManager(root, collective_timeout=120) as m:
            for step in (1, 2, 3):
                m.save(step, state_of(model, opt)).wait()
            if rank == 1:
                m.delete(1)
            m.wait()
            m.ranks.barrier()
            print(f"after rank 1 deleted step 1: {[int(s) for s in m.steps()]}", flush=True)
            m.ranks.barrier()  # every rank listed the steps before rank 0 deletes the next one
            if rank == 0:  # every rank deletes it, rank 0 first: to rank 1 the step is gone already
                m.delete(2)
                m.wait()  # its delete is done
            m.ranks.barrier()
            if rank == 1:
                m.delete(2)
            m.ranks.barrier()
            print(f"after every rank deleted step 2: {[int(s) for s in m.steps()]}", flush=True)
    elif mode == "uncreatable":
        # a root under a file made after the managers: rank 0 cannot take the lease, and rank 1 learns why at once
        # (not at the timeout)
        with ckpt.CheckpointManager(f"{root}.file/ck", collective_timeout=60) as m:
            if rank == 0:
                open(f"{root}.file", "w").close()
            try:
                m.save(1, state_of(model, opt)).wait()
                print("NO ERROR", flush=True)
            except Exception as e:
                print(f"refused after the save: {type(e).__name__}: {e}", flush=True)
    elif mode == "refused":
        # a save one rank cannot make (its metadata is not JSON) fails on every rank, and ranks that call save with
        # different steps fail too: no rank pairs one save's messages with another's, later saves commit
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            m.save(1, state_of(model, opt)).wait()
            for step, metadata in ((2, {"bad": object()} if rank == 1 else {}), (4 + rank, {})):
                try:
                    m.save(step, state_of(model, opt), metadata=metadata).wait()
                    print(f"save {step} ok", flush=True)
                except (TypeError, ckpt.CheckpointWriteError) as e:
                    print(f"save {step} refused: {type(e).__name__}: {e}", flush=True)
                m.save(step + 1 if step == 2 else 6, state_of(model, opt)).wait()
            try:  # a tensor whose shape differs between ranks: rank 0 cannot plan it, and every rank learns so
                m.save(7, {**state_of(model, opt), "odd": torch.zeros(8 + rank)}).wait()
                print("save 7 ok", flush=True)
            except ValueError as e:
                print(f"save 7 refused: {e}", flush=True)
            m.save(8, {**state_of(model, opt), "rng": RNGState()} if rank == 0 else state_of(model, opt)).wait()
            for extra in ({"ema": torch.ones(4)}, {"note": "x"}):  # a key on rank 1 alone: rank 0's tree lacks it
                try:
                    m.save(9, {**state_of(model, opt), **(extra if rank == 1 else {})}).wait()
                    print("save 9 ok", flush=True)
                except ckpt.CheckpointWriteError as e:
                    print(f"save 9 refused: {e}", flush=True)
            sampler = ckpt.ShuffledSampler(100, 4, 0)
            sampler.advance(2 + rank)  # a rank one batch ahead: rank 0's position alone was committed
            try:
                m.save(10, {**state_of(model, opt), "sampler": sampler}).wait()
                print("save 10 ok", flush=True)
            except ckpt.CheckpointWriteError as e:
                print(f"save 10 refused: {e}", flush=True)
            print(f"steps {m.steps()}", flush=True)
        with ckpt.CheckpointManager(f"{root}.tiered", local=f"{root}.local/{rank}", collective_timeout=20) as m:
            try:  # ranks that disagree on persist=: no rank persists alone
                m.save(1, state_of(model, opt), persist=rank == 0).wait()
                print("persist ok", flush=True)
            except ckpt.CheckpointWriteError as e:
                print(f"persist refused: {e}", flush=True)
            m.save(2, state_of(model, opt), persist=True).wait()
        print(f"tiered steps {ckpt.CheckpointManager(f'{root}.tiered').steps()}", flush=True)
    elif mode == "unbegun":
        # a save that fails on one rank after the plan was agreed: rank 1 cannot allocate step 2's snapshot (its
        # address space is capped), rank 0 cannot write step 3's in-progress marker (a storage error): every rank
        # raises at once, none waits for the other until the timeout, and step 4 commits
        import resource
        import zlib

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from ckpt.storage import open_storage
        from fault_storage import FaultStorage

        marker = lambda path: rank == 0 and path.endswith("_IN_PROGRESS")  # noqa: E731
        name = next(f"big{i}" for i in range(64) if zlib.crc32(f"big{i}".encode()) % WORLD == 1)  # rank 1 writes it
        big = {name: torch.arange(64 << 20, dtype=torch.float32)}  # 256 MiB
        with ckpt.CheckpointManager(FaultStorage(open_storage(root), fail_path=marker, fail_write=3, direct=True)) as m:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            for step in (1, 2, 3, 4):
                if step == 2 and rank == 1:  # room for a few threads, not for a snapshot of 256 MiB
                    vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
                    resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (64 << 20), hard))
                try:
                    m.save(step, big if step > 1 else {name: torch.zeros(4)}).wait()
                    print(f"save {step} ok", flush=True)
                except ckpt.CheckpointWriteError as e:
                    print(f"save {step} refused: {e}", flush=True)
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            print(f"steps {m.steps()}", flush=True)
    elif mode == "restore_refused":
        # rank 1's state has a key the checkpoint lacks: it raises its StateKeyError, rank 0 a StateMismatchError
        # naming it, neither waits for the other, every tensor is as it was, and a save after it commits
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            m.save(1, state_of(model, opt)).wait()
            train(model, opt, torch.Generator().manual_seed(1))
            before = flat_reference(model, opt)
            state = {**state_of(model, opt), **({"extra": torch.zeros(2)} if rank == 1 else {})}
            try:
                m.restore(state)
                print("NO ERROR", flush=True)
            except (ckpt.StateKeyError, ckpt.StateMismatchError) as e:
                print(f"refused: {type(e).__name__}: {e}", flush=True)
            after = flat_reference(model, opt)
            print(f"changed {[k for k in before if not torch.equal(before[k], after[k])]}", flush=True)
            m.save(2, state_of(model, opt)).wait()
            print(f"steps {m.steps()}", flush=True)
            try:  # ranks asking for different steps: every rank raises, none reads another's step
                m.restore(state_of(model, opt), step=1 + rank)
                print("NO ERROR", flush=True)
            except ckpt.CheckpointError as e:
                print(f"steps refused: {e}", flush=True)
            print(f"then restored {m.restore(state_of(model, opt))}", flush=True)
            train(model, opt, torch.Generator().manual_seed(3))
            before = flat_reference(model, opt)
            try:  # ranks selecting different keys: rank 0's shards of the optimizer would stay a step ahead of rank 1's
                m.restore(state_of(model, opt), keys=["model"] if rank == 0 else ["model", "opt"])
                print("NO ERROR", flush=True)
            except ckpt.CheckpointError as e:
                print(f"keys refused: {e}", flush=True)
            after = flat_reference(model, opt)
            print(f"keys changed {[k for k in before if not torch.equal(before[k], after[k])]}", flush=True)
            # rank 1's sampler is over other data: every rank raises before anything is read (rank 0 did load the
            # step, with rank 1 left at its own state), every model and sampler as it was
            m.save(3, {**state_of(model, opt), "sampler": ckpt.ShuffledSampler(64, 4, seed=0)}).wait()
            train(model, opt, torch.Generator().manual_seed(2))
            before = flat_reference(model, opt)
            sampler = ckpt.ShuffledSampler(64 if rank == 0 else 72, 4, seed=0)
            sampler.advance(5)
            try:
                m.restore({**state_of(model, opt), "sampler": sampler})
                print("NO ERROR", flush=True)
            except (ckpt.DataMismatchError, ckpt.StateMismatchError) as e:
                print(f"sampler refused: {type(e).__name__}: {e}", flush=True)
            after = flat_reference(model, opt)
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            print(f"then changed {changed}, sampler at {sampler.state_dict()['step']}", flush=True)
    elif mode == "loop_preempt":
        # SIGTERM reaches rank 0 alone, during step 5 (a launcher signalling ranks one after another): every rank
        # saves step 5 and exits 143; alone, rank 0 waited in the save's collective while rank 1 trained on
        from integrations import Preempted, TrainLoop

        model, opt = build()
        g = torch.Generator().manual_seed(1)
        sampler = ckpt.ShuffledSampler(64, 2 * WORLD, seed=0)
        try:
            state = {"model": model, "opt": opt}
            with TrainLoop(root, state, sampler=sampler, every_steps=1000, collective_timeout=60) as loop:
                for step in loop.steps(40):
                    train(model, opt, g)  # FSDP2: collectives of the job's own every step
                    sampler.advance()  # the batch it would have given (this test's data is the generator's)
                    if step == 5 and rank == 0:
                        signal.raise_signal(signal.SIGTERM)
                    loop.on_step_end(step)
            print("NOT PREEMPTED", flush=True)
        except Preempted as e:
            print(f"preempted at {e.step} with {e.code}; committed {ckpt.layout.committed_steps(loop.manager.storage)}")
    elif mode == "own_roots":
        # a path on each node's own disk (here: another directory per rank): the first save fails on every rank
        with ckpt.CheckpointManager(f"{root}/node{rank}", collective_timeout=20) as m:
            try:
                m.save(1, state_of(model, opt)).wait()
                print("NO ERROR", flush=True)
            except ckpt.CheckpointError as e:
                print(f"refused: {type(e).__name__}: {e}", flush=True)
        print(f"committed {ckpt.layout.committed_steps(ckpt.storage.open_storage(f'{root}/node0'))}", flush=True)
    elif mode == "kill_at_verdict":
        # rank 1 dies once rank 0 gathered its report of step 2 and commits, before the verdict reaches it: rank 0's
        # error says the step is committed (it is, complete), not that the save failed
        from ckpt import save as save_mod

        real = save_mod.raise_outcome

        def dying(*args, **kw):
            if rank == 1 and dying.step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kw)

        save_mod.raise_outcome = dying
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            for dying.step in (1, 2):
                try:
                    m.save(dying.step, state_of(model, opt)).wait()
                    print(f"save {dying.step} ok", flush=True)
                except ckpt.CheckpointWriteError as e:
                    print(f"save {dying.step} raised (committed {e.committed}): {e}", flush=True)
            print(f"committed {ckpt.layout.committed_steps(m.storage)}", flush=True)
            os._exit(0)  # the dead peer would make process-group teardown hang
    elif mode == "restore_damaged":
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            # step 2 asked for: every rank but the last reads its part intact (straight into the model), the last
            # finds the damage; the step fails on every rank and every rank's model is as it was
            before = flat_reference(model, opt)
            try:
                m.restore(state_of(model, opt), step=2)
                print("NO ERROR", flush=True)
            except ckpt.CorruptCheckpointError:
                pass
            after = flat_reference(model, opt)
            print(f"rank {rank} failed step 2, changed {[k for k in before if not torch.equal(before[k], after[k])]}")
            restore_and_compare(m, model, opt, os.path.join(root, "..", "reference1.pt"))
    elif mode == "odd_keys":
        # a key os.fsdecode gives for a file name's non-UTF-8 bytes, as a data loader's per-file state may hold
        name = os.fsdecode(b"\xff")
        with ckpt.CheckpointManager(root, collective_timeout=20) as m:
            m.save(1, {"files": {name: torch.ones(2), "n": 3}}).wait()
            target = {"files": {name: torch.zeros(2), "n": 0}}
            step = m.restore(target)
        print(f"restored {step}: {target['files'][name].tolist()} {target['files']['n']}", flush=True)
    elif mode in ("save", "kill"):
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(16, 32, generator=g)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        # the opt-in overlapped snapshot, whose deferred copies of this rank's shards the save below checks
        with ckpt.CheckpointManager(root, collective_timeout=20, snapshot="overlap") as m:
            if mode == "save":
                # one topology: the checkpoint group, the RNG state and a sampler all see this rank and world size
                rng = RNGState().state_dict()
                sampler = ckpt.ShuffledSampler(8, 2 * WORLD, seed=0)
                seen = {
                    (m.ranks.rank, m.ranks.world_size),
                    (rng["rank"], rng["world_size"]),
                    (sampler.rank, sampler.world_size),
                }
                assert seen == {(rank, WORLD)}, seen
                torch.manual_seed(1000 + rank)  # a distinct RNG stream per rank
                ref = flat_reference(model, opt)  # the state at the save (full_tensor() is a collective)
                h = m.save(2, state_of(model, opt))
                deferred = h._pending._versions if h._pending is not None else {}
                assert any(k.startswith("model/") for k in deferred) and any(k.startswith("opt/") for k in deferred)
                torch.save(torch.get_rng_state(), os.path.join(root, "..", f"rng{rank}.pt"))
                train(model, opt, g)  # a step right after the save: waits for the copy of this rank's shards
                h.wait()
                if rank == 0:
                    torch.save(ref, os.path.join(root, "..", "reference.pt"))
            else:
                m.save(1, state_of(model, opt)).wait()
                h = m.save(2, state_of(model, opt))
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                t0 = time.monotonic()
                try:
                    h.wait()
                    print("NO ERROR", flush=True)
                except ckpt.CheckpointWriteError as e:
                    print(f"error after {time.monotonic() - t0:.1f}s: {e}", flush=True)
                print(f"latest {m.latest_step()}", flush=True)
                try:  # the group broke with rank 1: the next save says so (not a closed pair's message)
                    m.save(3, state_of(model, opt)).wait()
                    print("NO ERROR", flush=True)
                except ckpt.CheckpointError as e:
                    print(f"next save: {type(e).__name__}: {e}", flush=True)
                os._exit(0)  # the dead peer would make process-group teardown hang
    else:
        with ckpt.CheckpointManager(f"{root}.empty") as m:  # nothing to resume: the fresh optimizer stays untouched
            assert m.restore(state_of(model, opt)) is None and not opt.state, opt.state
        with ckpt.CheckpointManager(root) as m:
            arena, asked = m._background.arena, []
            scratch = arena.scratch
            arena.scratch = lambda sizes: asked.extend(sizes) or scratch(sizes)
            state = state_of(model, opt)
            step = m.restore(state)
        # the caller's tensors are set aside in scratch (the model's shards, the table, the RNG states); the fresh
        # optimizer's state is read straight into tensors of the restore's own: nothing of the caller's to keep
        rng = state["rng"].state_dict()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        theirs = sum(t.numel() * t.element_size() for t in [*local, state["table"], rng["torch"]])
        theirs += rng["numpy"]["state"]["key"].nbytes
        assert sum(asked) <= theirs, f"restore asked for {sum(asked)} bytes of scratch; the caller's tensors: {theirs}"
        for p in model.parameters():  # state tensors shaped like a sharded parameter are sharded as it is
            for k, v in opt.state[p].items():
                like = hasattr(p, "placements") and v.shape == p.shape
                assert hasattr(v, "placements") == like and (not like or v.placements == p.placements), (k, v)
        ref = torch.load(os.path.join(root, "..", "reference.pt"))
        got = flat_reference(model, opt)
        saved_world = len([f for f in os.listdir(os.path.join(root, "..")) if f.startswith("rng")])
        expected_rng = torch.load(os.path.join(root, "..", f"rng{rank % saved_world}.pt"))
        got["rng"], ref["rng"] = torch.get_rng_state(), expected_rng  # rank i resumes rank i % saved_world's stream
        bad = [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]
        missing = sorted(set(got) ^ set(ref))
        print(f"rank {rank} restored {step}: {len(ref)} tensors, mismatched {bad}, missing {missing}", flush=True)
        if bad or missing:
            sys.exit(1)
    if WORLD > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    gc.freeze()  # the rank ends here: no final collections over torch's objects (~0.8 s a rank)
