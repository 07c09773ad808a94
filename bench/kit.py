"""The bench kit: one state builder, the measurement helpers, and one adapter per peer behind one protocol.

Every benchmark in bench/ takes its state from `build_state` (a transformer-like model plus its Adam state, from a
seed) and its peers from `ADAPTERS`, so that every method is measured the same way. An adapter's `save(step)`
returns a `Handle`: the time `save` takes is the training stall, `Handle.wait()` returns once the step is durable
(every file fsync'd, the step committed). `restore(step)` loads a step into the adapter's live `model` / `optim`
(a benchmark may replace them between restores), `delete(step)` removes one (untimed). The hooks `fresh_start`,
`end_saves` and `end_restore` do nothing unless a peer needs them (ckpt does).
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Protocol

GIB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- state ----------------------------------------------------------------------------------------------


def build_model(size_gb: float, seed: int) -> Any:
    """A transformer-like model (embedding, N blocks, untied head) sized so that it plus Adam is ~size_gb."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    target_params = size_gb * GIB / 4 / 3  # fp32 params + exp_avg + exp_avg_sq
    d = 1024 if size_gb >= 1 else 512 if size_gb >= 0.25 else 256
    vocab = 32 * d
    layers = max(1, round((target_params - 2 * vocab * d) / (12 * d * d + 13 * d)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

    with torch.no_grad():
        return Model()


def build_state(size_gb: float, seed: int, shard: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """build_model + Adam after one step: ~size_gb in all.

    `shard(model)` (FSDP2 in the distributed mode) runs before the optimizer is made. Gradients are drawn
    whole and then sliced, so a sharded state holds exactly the values of the single-process one.
    """
    import torch

    model = build_model(size_gb, seed)
    if shard is not None:
        shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        g = torch.randn(p.shape, dtype=p.dtype)
        if is_dtensor(p):
            from torch.distributed.tensor import distribute_tensor

            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)  # local slice, no comms
        p.grad = g
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (without importing torch.distributed.tensor)."""
    return type(t).__name__ == "DTensor"


def state_tensors(model: Any, optim: Any) -> list:
    """Every tensor of the state (model params + optimizer state), in a fixed order."""
    import torch

    out = list(model.state_dict().values())
    for _, st in sorted(optim.state_dict()["state"].items()):
        out.extend(v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor))
    return out


def fingerprint(model: Any, optim: Any) -> list[float]:
    """A float64 sum of every tensor of the state; of the whole tensor for a DTensor (collective: all ranks call it)."""
    import torch

    return [
        float(torch.sum(t.full_tensor() if is_dtensor(t) else t, dtype=torch.float64))
        for t in state_tensors(model, optim)
    ]


def state_bytes(model: Any, optim: Any) -> int:
    """Bytes of the (global) state."""
    return sum(t.numel() * t.dtype.itemsize for t in state_tensors(model, optim))


def scramble(model: Any, optim: Any) -> None:
    """Zero every tensor of the state in place, so that a restore has to bring every value back."""
    import torch

    with torch.no_grad():
        for t in state_tensors(model, optim):
            t.zero_()


# -- measurement helpers --------------------------------------------------------------------------------


def proc_status(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def bytes_read() -> int:
    """Bytes this process has read through read()/pread()/preadv() so far (`rchar` of /proc/self/io): every file
    read, from the disk or the page cache alike; a gloo transfer (recvmsg) is not counted."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise KeyError("rchar")


class PeakRSS:
    """Peak RSS over a block: VmHWM after resetting it through clear_refs, plus a 2 ms sampler as fallback."""

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm = True
        except OSError:
            self._hwm = False
        self.peak = proc_status("VmRSS")
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, proc_status("VmRSS"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, proc_status("VmRSS"), proc_status("VmHWM") if self._hwm else 0)


def drop_caches() -> bool:
    """Sync, then drop the page cache; False when not allowed (not root): what follows reads a warm cache."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def fsync_path(path: str) -> None:
    """fsync a file or a directory by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed_save(adapter: Adapter, step: int) -> tuple[float, float]:
    """One save: (stall, durable) seconds, both from the call; the stall is the time `save` takes."""
    t0 = time.perf_counter()
    handle = adapter.save(step)
    stall = time.perf_counter() - t0
    handle.wait()
    return stall, time.perf_counter() - t0


# -- command-line values --------------------------------------------------------------------------------


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` (int or float) that must be > 0, so that a size, a count of repeats or of ranks
    that cannot work is refused with one line of usage instead of a traceback deep in a child process."""

    def parse(text: str) -> Any:
        expected = f"expected {'an integer' if kind is int else 'a number'} > 0, got {text!r}"
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(expected) from None
        if not value > 0:  # NaN too
            raise argparse.ArgumentTypeError(expected)
        return value

    return parse


def positives(kind: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse type: a comma list of `positive(kind)` values, kept as its text ('' is the empty list)."""
    one = positive(kind)

    def parse(text: str) -> str:
        for item in filter(None, text.split(",")):
            one(item)
        return text

    return parse


def names(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: a comma list of names from `allowed` (an --only list), kept as its text."""

    def parse(text: str) -> str:
        unknown = [n for n in text.split(",") if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: choose from {', '.join(allowed)}")
        return text

    return parse


# -- the adapter protocol -------------------------------------------------------------------------------


class Handle(Protocol):
    """A save as its adapter returns it (ckpt's SaveHandle is one)."""

    def done(self) -> bool:
        """Whether the save is durable (never blocks)."""

    def wait(self) -> None:
        """Block until the save is durable: every file fsync'd, the step committed; raises what the save raised."""


class Pending:
    """A Handle from two callables: `done()` polls the save, `wait()` blocks until it is durable."""

    def __init__(self, done: Callable[[], bool], wait: Callable[[], None]) -> None:
        self.done, self.wait = done, wait


DURABLE = Pending(lambda: True, lambda: None)  # what a save returns that is durable when it returns


class Adapter:
    """One peer, as every benchmark drives it: save / restore / delete of a model and its optimizer under `root`."""

    label = ""  # the peer's name in a report

    def __init__(self, root: str, model: Any, optim: Any) -> None:
        self.root, self.model, self.optim = root, model, optim

    def save(self, step: int) -> Handle:
        """Start saving the live state as `step`; the time this call takes is the training stall."""
        raise NotImplementedError

    def restore(self, step: int) -> None:
        """Load `step` into the live state (self.model / self.optim)."""
        raise NotImplementedError(f"{type(self).__name__} does not restore")

    def delete(self, step: int) -> None:
        """Remove a durable `step` (untimed)."""
        raise NotImplementedError

    def fresh_start(self) -> None:
        """A job's start, before its first save (ckpt: a restore that finds nothing)."""

    def end_saves(self) -> None:
        """Untimed, after the last save: what the saves held goes (a restore happens as in a fresh process)."""

    def end_restore(self) -> None:
        """Untimed, after each restore."""


class TorchSave(Adapter):
    """torch.save of both state dicts into one file, then the file and its directory fsync'd: durable on return."""

    label = "torch.save+fsync"

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step{step}.pt")

    def save(self, step: int) -> Handle:
        import torch

        p = self.path(step)
        torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict()}, p)
        fsync_path(p)
        fsync_path(self.root)
        return DURABLE

    def delete(self, step: int) -> None:
        os.remove(self.path(step))

    def restore(self, step: int) -> None:
        import torch

        sd = torch.load(self.path(step), map_location="cpu", weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])


class DcpSave(Adapter):
    """dcp.save of both state dicts into a FileSystemWriter (its defaults: sync_files=True, every file and
    .metadata fsync'd; thread_count=1), then the root directory fsync'd; dcp.load in place to restore."""

    label = "dcp.save"
    asynchronous = False
    group = None  # process group of the saves (None: the default one, or none at all in a single process)

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step{step}")

    def writer(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self.path(step), sync_files=True)

    def reader(self, step: int) -> Any:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(self.path(step))

    def commit(self) -> None:
        """After DCP's .metadata (its commit) is written: make the new step's directory entry durable."""
        fsync_path(self.root)

    def sd(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load(self, sd: dict) -> None:
        """After dcp.load filled `sd` in place (the live parameters): the optimizer's state goes back in."""
        self.optim.load_state_dict(sd["optim"])

    def save(self, step: int) -> Handle:
        import torch.distributed.checkpoint as dcp

        if not self.asynchronous:
            dcp.save(self.sd(), storage_writer=self.writer(step), process_group=self.group)
            self.commit()
            return DURABLE
        fut = dcp.async_save(self.sd(), storage_writer=self.writer(step), process_group=self.group)

        def wait() -> None:
            fut.result()
            self.commit()

        return Pending(fut.done, wait)

    def delete(self, step: int) -> None:
        shutil.rmtree(self.path(step))

    def restore(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        sd = self.sd()
        dcp.load(sd, storage_reader=self.reader(step))  # in place into the live parameter/optimizer tensors
        self.load(sd)


class DcpAsync(DcpSave):
    """dcp.async_save: the stall is the staging copy; durable once its future is done and the directory fsync'd."""

    label = "dcp.async_save"
    asynchronous = True


class DcpSaveFsdp(DcpSave):
    """DCP on an FSDP2 state, the standard way: get_state_dict -> dcp.save; dcp.load -> set_state_dict."""

    def sd(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)  # fresh optimizer: state initialised here
        return {"model": model_sd, "optim": optim_sd}

    def load(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class DcpAsyncFsdp(DcpSaveFsdp):
    """async_save on a gloo group of its own (as recommended: its collectives run in a background thread)."""

    label = "dcp.async_save"
    asynchronous = True

    def __init__(self, root: str, model: Any, optim: Any) -> None:
        import torch.distributed as dist

        super().__init__(root, model, optim)
        self.group = dist.new_group(backend="gloo")


def s3fs_options(endpoint: str) -> dict:
    """s3fs configured for the server from the standard AWS variables (no instance cache: fresh objects, fresh
    connections)."""
    return {
        "endpoint_url": endpoint,
        "key": os.environ["AWS_ACCESS_KEY_ID"],
        "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {"region_name": os.environ["AWS_REGION"]},
        "skip_instance_cache": True,
    }


class DcpS3fs(DcpSave):
    """dcp.save / dcp.load through FsspecWriter / FsspecReader on `root` (s3://bucket/prefix)/stepN: one file per
    rank, `thread_count` (DCP's default 1), `sync_files` off by default: an s3fs stream has no fileno, so DCP's
    fsync falls back to os.sync(), which on a loopback server would flush the server's own volume files (and every
    other process's dirty pages) to disk, a cost no remote store puts on the trainer. The .metadata object, written
    last, is DCP's commit: durable when dcp.save returns."""

    label = "dcp.save + s3fs"

    def __init__(self, root: str, model: Any, optim: Any, endpoint: str, thread_count: int = 1, sync_files=False):
        super().__init__(root, model, optim)
        self.endpoint, self.threads, self.sync = endpoint, thread_count, sync_files

    def path(self, step: int) -> str:
        return f"{self.root}/step{step}"

    def writer(self, step: int) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(
            self.path(step), thread_count=self.threads, sync_files=self.sync, **s3fs_options(self.endpoint)
        )

    def reader(self, step: int) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.path(step), **s3fs_options(self.endpoint))  # a new, uncached S3FileSystem

    def commit(self) -> None:
        """Nothing: an object store has no directory entry to fsync."""

    def delete(self, step: int) -> None:
        import s3fs

        s3fs.S3FileSystem(**s3fs_options(self.endpoint)).rm(self.path(step), recursive=True)


class DcpAsyncS3fs(DcpS3fs):
    """dcp.async_save through FsspecWriter: durable once its future is done."""

    label = "dcp.async_save + s3fs"
    asynchronous = True


class Ckpt(Adapter):
    """ckpt's CheckpointManager on `root` (a directory or a URL), made with `manager_options` (chunk_bytes,
    write_budget, snapshot, ...); a restore goes through a new manager, as in a fresh process."""

    label = "ckpt"

    def __init__(self, root: str, model: Any, optim: Any, **manager_options) -> None:
        import ckpt

        super().__init__(root, model, optim)
        self.options = manager_options
        self.m = ckpt.CheckpointManager(root, **manager_options)

    def state(self) -> dict:
        return {"model": self.model, "optim": self.optim}

    def fresh_start(self) -> None:
        assert self.m.restore(self.state()) is None  # a fresh job: the arena is reserved in the background

    def save(self, step: int) -> Handle:
        return self.m.save(step, self.state())

    def delete(self, step: int) -> None:
        from ckpt import catalog

        catalog.delete_step(self.m.storage, step)

    def end_saves(self) -> None:
        self.m.close()
        self.m = None  # the staging arena goes with it: a restore happens in a fresh process
        gc.collect()

    def restore(self, step: int) -> None:
        import ckpt

        self.m = ckpt.CheckpointManager(self.root, **self.options)
        got = self.m.restore(self.state())
        assert got == step, (got, step)

    def end_restore(self) -> None:
        """Untimed: close the restore's manager. After a restore it reserves (pre-faults) its staging arena in
        the background, off the training path; closing waits for that, which is no part of the restore."""
        self.end_saves()


class RawWrite(Adapter):
    """The floor of what writing the state costs, with no library: its bytes copied into a pre-touched buffer (the
    stall), then written by one thread at nice 0 as 64 MiB files, each with its crc32c computed, O_DIRECT pwrites of
    8 MiB and an fdatasync (the same system calls ckpt makes for a local root), then the directory fsync'd. It
    writes only: no restore."""

    label = "raw O_DIRECT write"
    CHUNK, PIECE = 64 << 20, 8 << 20

    def __init__(self, root: str, model: Any, optim: Any) -> None:
        import mmap

        import torch

        super().__init__(root, model, optim)
        self.tensors = state_tensors(model, optim)
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.nbytes = -(-nbytes // 4096) * 4096  # O_DIRECT: whole blocks
        self.buf = mmap.mmap(-1, self.nbytes)
        self.buf.madvise(mmap.MADV_HUGEPAGE)
        self.arena = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.arena.zero_()  # touched: the copy goes to warm memory, as into ckpt's reserved arena
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, step: int) -> Handle:
        import torch

        at = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.arena[at : at + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            at += n
        self.thread = threading.Thread(target=self._write, args=(step,))
        self.thread.start()
        return Pending(lambda: not self.thread.is_alive(), self._wait)

    def _write(self, step: int) -> None:
        import crc32c

        try:
            path = os.path.join(self.root, f"step{step}")
            os.makedirs(path)
            view = memoryview(self.buf)
            for i, at in enumerate(range(0, self.nbytes, self.CHUNK)):
                chunk = view[at : at + self.CHUNK]
                crc32c.crc32c(chunk)
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                try:
                    fd = os.open(os.path.join(path, str(i)), flags | os.O_DIRECT, 0o644)
                except OSError as e:
                    if e.errno != errno.EINVAL:  # EINVAL: no O_DIRECT on this filesystem
                        raise
                    fd = os.open(os.path.join(path, str(i)), flags, 0o644)
                try:
                    for p in range(0, len(chunk), self.PIECE):
                        os.pwrite(fd, chunk[p : p + self.PIECE], p)
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            fsync_path(path)
            fsync_path(self.root)
        except BaseException as e:
            self.error = e

    def _wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    def delete(self, step: int) -> None:
        shutil.rmtree(os.path.join(self.root, f"step{step}"))


ADAPTERS: dict[str, type[Adapter]] = {
    "torch_save": TorchSave,
    "dcp_save": DcpSave,
    "dcp_async": DcpAsync,
    "dcp_save_fsdp": DcpSaveFsdp,
    "dcp_async_fsdp": DcpAsyncFsdp,
    "dcp_s3fs": DcpS3fs,
    "dcp_async_s3fs": DcpAsyncS3fs,
    "ckpt": Ckpt,
    "raw": RawWrite,
}


def exit_on_sigterm() -> None:
    """Make SIGTERM (a `timeout`, a scheduler's kill) exit through SystemExit, as Ctrl-C does, so that the driver's
    `finally` removes its temporary directory and `run_ranks` ends the ranks it started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], ranks: int, what: str) -> dict:
    """`python <args>` as `ranks` processes under the env:// rendezvous on 127.0.0.1 (none for one process); the JSON
    row rank 0 prints last. A failed rank leaves its peers waiting in a collective: they are ended, and this exits
    naming `what` and every exit code."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if ranks > 1:
        env.update(WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(ranks)
    ]
    try:
        while None in (codes := [p.poll() for p in procs]) and not any(codes):
            time.sleep(0.2)
    finally:  # also when this process is leaving (SystemExit, KeyboardInterrupt): no rank outlives it
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.wait() for p in procs]
    out = procs[0].stdout.read()  # one short JSON line: it fits the pipe's buffer
    if any(codes):
        raise SystemExit(f"{what} failed with exit codes {codes}")
    return json.loads(out.strip().splitlines()[-1])
