"""The snapshot's copy into the staging arena on several threads: large contiguous tensors are cut into pieces,
small ones grouped, copied meanwhile, and every byte lands where one serial copy would put it, whatever the dtype,
layout or size; a closed manager leaves no copy thread behind and gives its memory back; an arena that grows lets
the old one go first, and one that cannot be allocated is an error that says how many bytes, for what."""

import gc
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import ckpt
from ckpt.staging import StagingArena, copy, default_copy_threads
from test_ckpt_budget import _rss


class CountingPool(ThreadPoolExecutor):
    """A thread pool that counts the tasks it was given."""

    def __init__(self, workers: int):
        super().__init__(workers)
        self.tasks = 0

    def submit(self, fn, *args):
        self.tasks += 1
        return super().submit(fn, *args)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {  # the arena's pieces are 16 MiB
        "big": torch.randn(5 << 20, generator=g),  # 20 MiB: a piece and a short one
        "odd": torch.randint(0, 255, ((33 << 20) + 5,), dtype=torch.uint8, generator=g),  # 5 bytes past 2 pieces
        "bf16": torch.randn(700, 1500, generator=g).to(torch.bfloat16),
        "flags": torch.rand(2_000_001, generator=g) > 0.5,
        "cols": torch.randn(1024, 512, generator=g)[:, ::2],  # not contiguous: copied whole
        "scalar": torch.tensor(7.25),
        "empty": torch.empty(0, 4),
    }


def test_a_parallel_snapshot_copies_every_byte_where_a_serial_one_does():
    tensors = _tensors()
    arena = StagingArena(copy_threads=3)
    serial = StagingArena(copy_threads=1)
    wave = arena.plan(tensors)[0]
    got, _ = arena.stage(tensors, wave)
    want, _ = serial.stage(tensors, wave)
    assert [s.name for s in got] == list(tensors)
    for g, w in zip(got, want):
        assert g.host.tobytes() == w.host.tobytes(), g.name
        t = tensors[g.name]
        assert g.host.tobytes() == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), g.name


def test_pieces_cover_a_tensor_exactly_at_any_piece_size():
    src = torch.arange(10_007, dtype=torch.int64)
    with ThreadPoolExecutor(4) as pool:
        for piece in (1, 8, 4096, 80_055, 80_056, 1 << 20):
            dst = torch.zeros(src.nbytes, dtype=torch.uint8)
            copy([(dst, src)], pool, piece=piece)
            assert torch.equal(dst.view(torch.int64), src), piece


def test_copy_threads_share_the_cpus_among_the_node_ranks(monkeypatch):
    import os

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_copy_threads() == max(1, min(8, cpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus))
    assert default_copy_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "garbage")
    assert default_copy_threads() == max(1, min(8, cpus))


def test_many_small_tensors_are_copied_on_the_pool_in_groups_of_about_a_piece():
    # a model's tensors are mostly under a piece (a 1024-wide block's are 4-16 MiB): copied one after another on the
    # calling thread, they made most of a 2 GiB save's stall
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randn(256 * 1024, generator=g) for _ in range(64)]  # 1 MiB each
    dsts = [torch.zeros(s.nbytes, dtype=torch.uint8) for s in srcs]
    with CountingPool(2) as pool:
        copy(list(zip(dsts, srcs)), pool, piece=4 << 20)
    assert pool.tasks == 16
    for d, s in zip(dsts, srcs):
        assert torch.equal(d.view(torch.float32), s)


def _copy_threads() -> int:
    return sum(t.name.startswith("ckpt-copy") for t in threading.enumerate())


def test_closing_a_manager_stops_its_copy_threads(tmp_path):
    before = _copy_threads()
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.randn(1 << 20)})
        m.wait()
        assert _copy_threads() > before or default_copy_threads() == 1  # one CPU: the caller copies
    assert _copy_threads() == before


def test_a_closed_manager_gives_its_host_memory_back_without_the_garbage_collector(tmp_path):
    """The arena (and a restore's scratch and set-aside bytes) are freed at `close`: an evaluation loop that opens a
    manager per checkpoint must not hold one arena per manager until the collector finds their cycles."""
    nbytes = 96 << 20
    state = {"w": torch.ones(nbytes, dtype=torch.uint8)}
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, state).wait()
    into = {"w": torch.zeros(nbytes, dtype=torch.uint8)}
    gc.collect()
    gc.disable()
    try:
        before = _rss()
        for step in (2, 3, 4):
            with ckpt.CheckpointManager(tmp_path) as m:
                m.restore(into)
                m.save(step, state).wait()
        grown = _rss() - before
    finally:
        gc.enable()
    assert torch.equal(into["w"], state["w"])
    assert grown < nbytes, f"{grown / 2**20:.0f} MiB still held after three managers closed"


ADDRESS_LIMIT = os.path.join(os.path.dirname(__file__), "procs", "address_limit.py")


def test_host_memory_that_cannot_be_allocated_is_a_clear_error_and_loses_nothing(tmp_path):
    """Under an address-space limit (``ulimit -v``; the child lowers its own RLIMIT_AS) a save whose arena cannot
    grow, and a restore whose scratch cannot be allocated, raise a MemoryError naming the bytes asked for, what for
    and the cap, not a bare ``[Errno 12]``; nothing is committed, quarantined or applied, and the manager goes on."""
    out = subprocess.run([sys.executable, ADDRESS_LIMIT, str(tmp_path / "ck")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["big_save"].startswith("MemoryError: could not allocate 536870912 bytes (512.0 MiB)"), seen
    assert "staging arena" in seen["big_save"] and "max_staging_bytes" in seen["big_save"], seen
    assert seen["next_save"] is None and seen["steps"] == [1, 3]  # the next save (within the limit) commits
    assert seen["restore"].startswith("MemoryError: could not allocate 67108864 bytes (64.0 MiB)"), seen
    assert "restore's scratch" in seen["restore"] and "max_staging_bytes" in seen["restore"], seen
    assert seen["untouched"] and seen["steps_after_restore"] == [1, 3]  # nothing applied, nothing set aside
    assert seen["restored"] == 3 and seen["bitwise"]


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def test_an_arena_that_grows_lets_the_old_one_go_before_faulting_the_new_one_in():
    """A state that grows (an optimizer's state after its first step, `manager.reserve`) needs the new size of host
    memory, not the old arena plus the new one: a job near its memory limit would be killed by the growth."""
    old, new = 64 << 20, 96 << 20
    arena = StagingArena()
    arena.reserve([old])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from now
    before = _rss()
    arena.reserve([new])
    assert arena.capacity == new
    peak = _peak_rss() - before
    assert peak < (new - old) + (24 << 20), f"growing {old >> 20} -> {new >> 20} MiB took {peak >> 20} MiB more at peak"


def test_a_capped_arena_cuts_a_tensor_into_pieces_as_large_as_the_cap(tmp_path):
    """Past `max_staging_bytes` a tensor is cut by rows into pieces that fill the cap: rows of a few bytes (a 1-D
    vector) were cut into pieces of a thousandth of it (a 256 MB vector under a 16 MiB cap: 15,629 pieces and an 11x
    slower save), and rows that fit the cap only once aligned were refused. Saved and restored bitwise all the same."""
    cap = 1 << 20
    vec = torch.arange(3_000_000, dtype=torch.float32)  # rows of 4 bytes
    wide = torch.arange(40 * 1250, dtype=torch.float32).reshape(40, 1250)  # rows of 5,000 bytes, cap 8,192
    pieces = [p for wave in StagingArena(cap).plan({"v": vec}) for p in wave]
    assert len(pieces) == -(-vec.nbytes // cap) and all(n <= cap for _, _, n in pieces)
    assert [n for _, _, n in StagingArena(8192).plan({"w": wide})[0]] == [5000]
    state = {"v": vec, "w": wide}
    with ckpt.CheckpointManager(tmp_path, max_staging_bytes=8192) as m:
        m.save(1, state).wait()
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        assert m.restore(into) == 1
    assert all(torch.equal(into[k], v) for k, v in state.items())
