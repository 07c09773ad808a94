"""One writer per root: a lease taken at a manager's first save and held until `close()`.

Local roots: ``ROOT/_LEASE`` locked with ``flock(LOCK_EX)`` on a descriptor held for the lease's life. The
kernel drops the lock when its holder dies, so a SIGKILLed writer's lease is free at once, and two live
writers can never both hold it. ``ROOT/_GC_LOCK`` makes the start of a save (clearing leftovers, writing its
``_IN_PROGRESS`` marker) and ``gc``'s deletions mutually exclusive, so gc never removes a save in flight.

Object stores (``memory://``, ``s3://``...): a ``_LEASE`` object with an expiry, created and renewed by a
heartbeat thread with conditional writes (the write succeeds only if the object is still at the
generation the writer last saw), and taken over only once expired. A writer that loses it stops committing.

The file or object names the holder (id, role, host, pid, since): errors, ``ckpt ls`` and gc read it.
Readers (restore, ls, inspect, verify, explain) never take the lease.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import stat
import threading
import time
import uuid
import weakref
from typing import Any, Iterator

from .errors import LeaseHeldError
from .layout import GC_LOCK, LEASE
from .storage import Storage, UnsafeFileError, makedirs_durable, open_regular

TTL_S = 60.0  # object stores: a lease not renewed for this long is free
_HOLDER_BYTES = 1 << 16  # a holder record is a few hundred bytes of JSON
WAIT_FOR_GC_S = 60.0  # a writer waits this long for a running `ckpt gc` to finish before giving up

_live: "weakref.WeakSet[FileLease]" = weakref.WeakSet()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep its parent's lock alive after the parent dies."""
    for lease in list(_live):
        lease._close_fd()


os.register_at_fork(after_in_child=_forget_in_child)


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unknown process (its lease names no holder yet)"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    role = "ckpt gc" if holder.get("role") == "gc" else "a writer"
    return f"{role}: pid {holder.get('pid')} on host {holder.get('host')}, since {when} (lease {holder.get('id')})"


def _parse(data: bytes | None) -> dict[str, Any] | None:
    try:
        holder = json.loads(data) if data else None
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _until(holder: dict[str, Any] | None) -> str:
    """When an object-store lease frees the root, for the writer it refuses: a holder that died (SIGKILL, a lost node)
    cannot release it, and nothing else says that waiting is enough, or for how long."""
    end = _expires(holder)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end))
    return (
        f"its lease expires at {when} (in {max(end - time.time(), 0):.0f} s) unless its holder renews it: a holder "
        "that died frees the root then, and the next writer takes it over"
    )


def _expires(holder: dict[str, Any] | None) -> float:
    """When an object-store lease ends (0: unreadable, i.e. free)."""
    value = holder.get("expires") if holder else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _local_pid_dead(holder: dict[str, Any] | None) -> bool:
    """The holder is a process of this host that no longer exists (its record is stale)."""
    if not holder or holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False


def _new_holder(role: str) -> dict[str, Any]:
    return {
        "id": uuid.uuid4().hex,
        "role": role,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.time(),
    }


class FileLease:
    """The lease of a local root: an exclusive flock on ``ROOT/_LEASE`` held through an open descriptor."""

    exclusive = True  # no other writer of the root lives while it is held: a save may clear any leftover

    def __init__(self, storage: Storage, role: str, ttl: float):
        """`ttl` is for leases that expire; a flock lasts as long as its descriptor."""
        self._fd: int | None = None  # first: `__del__` releases whatever was taken, even when this fails
        root = storage.local_path("")  # a root whose lease_kind is "flock" has a directory here
        self.root, self.holder = root, _new_holder(role)
        try:
            makedirs_durable(root)
            path = os.path.join(root, LEASE)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            mode = os.fstat(self._fd).st_mode
            if not stat.S_ISREG(mode):
                raise UnsafeFileError(errno.EINVAL, f"not a regular file (mode {stat.filemode(mode)}): remove it", path)
        except NotADirectoryError:
            if os.path.lexists(root):
                raise NotADirectoryError(f"the checkpoint root {root} is not a directory") from None
            raise NotADirectoryError(
                f"the checkpoint root {root} cannot be created: a part of its path is not a directory"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._close_fd()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = current_holder_local(root)
            raise LeaseHeldError(f"{root} is being written by {describe(holder)}", holder=holder) from None
        data = json.dumps(self.holder).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        _live.add(self)

    @property
    def id(self) -> str:
        return self.holder["id"]

    def check(self) -> float:
        """Raise unless this writer still holds the root; returns how long it may go on writing (inf).

        A flock cannot be lost while its descriptor is open, but the file can be: once ``_LEASE`` is removed or
        replaced (by hand, by a clean-up script), another writer locks the new file, so the lock is ours only while
        the path still names the file we locked.
        """
        if self._fd is None:
            raise LeaseHeldError(f"the lease on {self.root} was released")
        path = os.path.join(self.root, LEASE)
        try:
            same = os.path.samestat(os.fstat(self._fd), os.stat(path))
        except FileNotFoundError:  # no other writer to name: the file (or the whole root) was removed
            gone = "" if os.path.isdir(self.root) else f", and so was the root {self.root} itself"
            raise LeaseHeldError(f"the lease file {path} was removed while this writer held it{gone}") from None
        if not same:
            raise LeaseHeldError(
                f"the lease file {path} was removed or replaced while this writer held it; now held by "
                f"{describe(current_holder_local(self.root))}"
            )
        return math.inf

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Held while a save clears leftovers of its step and marks itself in progress (excludes gc)."""
        with gc_lock(self.root):
            yield

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # a clean end leaves no holder's name behind
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # a manager dropped without close()
        self.release()

    @staticmethod
    def live_holder(storage: Storage) -> dict[str, Any] | None:
        """The holder named in ``_LEASE`` if its process is alive (other hosts: assumed alive)."""
        holder = FileLease.recorded(storage)
        return None if holder is None or _local_pid_dead(holder) else holder

    @staticmethod
    def recorded(storage: Storage) -> dict[str, Any] | None:
        """The holder ``_LEASE`` names, alive or not."""
        return current_holder_local(storage.local_path(""))

    @staticmethod
    @contextlib.contextmanager
    def beside_writer(storage: Storage) -> Iterator[dict[str, Any] | None]:
        """Hold ``_GC_LOCK`` (no save of the live writer starts meanwhile) and yield the record of the root's writer,
        read under the lock: the writer of any save marked so far."""
        root = storage.local_path("")
        with gc_lock(root):
            yield current_holder_local(root) or {}


def current_holder_local(root: str) -> dict[str, Any] | None:
    """What ``ROOT/_LEASE`` says about its holder (the last one, if nobody holds it now)."""
    try:  # a FIFO or a device planted there is no holder: never block on it, nor read a device's endless bytes
        with open(open_regular(os.path.join(root, LEASE)), "rb") as f:
            return _parse(f.read(_HOLDER_BYTES))
    except OSError:
        return None


@contextlib.contextmanager
def gc_lock(root: str) -> Iterator[None]:
    """``ROOT/_GC_LOCK``, held exclusively by gc while it deletes, and by a writer while it starts a save."""
    makedirs_durable(root)
    fd = os.open(os.path.join(root, GC_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class KvLease:
    """The lease of an object-store root: a ``_LEASE`` object with an expiry, renewed by a heartbeat thread."""

    exclusive = False  # a writer that lost it (paused, partitioned) may still be writing: leave its files alone

    def __init__(self, storage: Storage, role: str, ttl: float):
        """`storage` has conditional writes (`read_versioned`, `write_if`: see `storage.KvStorage`)."""
        self.storage, self.ttl, self.holder = storage, ttl, _new_holder(role)
        self._lost: str | None = None
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None  # first: `__del__` releases only what was taken
        for _ in range(100):  # each round either wins or sees a newer generation: bounded by contention
            data, gen = storage.read_versioned(LEASE)
            current = _parse(data)
            if data is not None and _expires(current) > time.time():
                raise LeaseHeldError(
                    f"{storage.url} is being written by {describe(current)}; {_until(current)}", holder=current
                )
            self.holder["expires"] = time.time() + ttl
            new = storage.write_if(LEASE, json.dumps(self.holder).encode(), gen)
            if new is not None:
                self._gen = new
                break
        else:
            raise LeaseHeldError(f"could not take the lease on {storage.url}: other writers keep changing it")
        self._thread = threading.Thread(  # holds the lease weakly: a manager dropped without close() lets it go
            target=_beat, args=(weakref.ref(self), self._stop, ttl / 4), name="ckpt-lease", daemon=True
        )
        self._thread.start()

    @property
    def id(self) -> str:
        return self.holder["id"]

    def _renew(self) -> bool:
        """One heartbeat: extend the expiry. False once the lease is released or lost (the heartbeat stops)."""
        with self._lock:
            if self._stop.is_set():
                return False
            holder = dict(self.holder, expires=time.time() + self.ttl)
            try:
                new = self.storage.write_if(LEASE, json.dumps(holder).encode(), self._gen)
            except Exception:  # a transient store error: try again at the next beat; the expiry decides
                return True
            if new is None:
                try:
                    data, gen = self.storage.read_versioned(LEASE)
                except Exception:  # as above: the next beat tries again
                    return True
                current = _parse(data) or {}
                if current.get("id") == self.id and _expires(current):  # an earlier renewal of its own, whose answer
                    self._gen, self.holder = gen, current  # timed out (a stalled store), applied later: still held
                    return True
                self._lost = f"the lease on {self.storage.url} was taken over by {describe(current)}"
                return False
            self._gen, self.holder = new, holder
            return True

    def check(self) -> float:
        """Raise if this writer may no longer write: the lease was taken over, or it expired unrenewed.

        Returns the seconds within which a write must be done: until the expiry, less a margin of ttl/8 for
        clocks that differ between hosts (at least ttl/8, as this passes only with ttl/4 left).
        """
        if self._lost is not None:
            raise LeaseHeldError(self._lost)
        left = self.holder["expires"] - time.time()
        if left < self.ttl / 4:  # renewed every ttl/4: this one is overdue
            raise LeaseHeldError(f"the lease on {self.storage.url} expired (not renewed for {self.ttl:.0f} s)")
        return left - self.ttl / 8

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """gc never deletes beside a live object-store writer, so starting a save needs no exclusion."""
        yield

    def release(self) -> None:
        if self._thread is None:  # never taken
            return
        self._stop.set()
        with self._lock:
            if self._lost is None:
                with contextlib.suppress(Exception):
                    self.storage.write_if(LEASE, None, self._gen)
            self._lost = self._lost or "released"
        if threading.current_thread() is not self._thread:  # `__del__` may run on the heartbeat's last beat
            self._thread.join()

    def __del__(self) -> None:  # a manager dropped without close()
        self.release()

    @staticmethod
    def live_holder(storage: Storage) -> dict[str, Any] | None:
        """The lease object, if not expired."""
        holder = KvLease.recorded(storage)
        return holder if _expires(holder) > time.time() else None

    @staticmethod
    def recorded(storage: Storage) -> dict[str, Any] | None:
        """The holder the lease object names, expired or not."""
        return _parse(storage.read(LEASE))

    @staticmethod
    @contextlib.contextmanager
    def beside_writer(storage: Storage) -> Iterator[dict[str, Any] | None]:
        """Nothing keeps a live writer's saves from starting (nor one that lost the lease from writing): yields None."""
        yield None


def _beat(lease: "weakref.ref[KvLease]", stop: threading.Event, period: float) -> None:
    """The heartbeat thread of a `KvLease`: renews it every `period` until it is released, lost or dropped."""
    while not stop.wait(period):
        held = lease()
        if held is None or not held._renew():
            return
        del held  # referenced only while it renews: dropped meanwhile, it is released by `__del__`


Lease = FileLease | KvLease
_KINDS: dict[str, type[Lease]] = {"flock": FileLease, "conditional": KvLease}


def lease_class(storage: Storage) -> type[Lease]:
    """The lease this root's backend supports (its `lease_kind`)."""
    return _KINDS[storage.lease_kind]


def acquire(storage: Storage, *, role: str = "writer", wait_for_gc: float = WAIT_FOR_GC_S, ttl: float = TTL_S) -> Lease:
    """Take the root's lease, or raise `LeaseHeldError` naming the live holder.

    A `ckpt gc` holds the lease only while it deletes leftovers: a writer waits up to `wait_for_gc` for it.
    """
    deadline = time.monotonic() + wait_for_gc
    kind = lease_class(storage)
    while True:
        try:
            return kind(storage, role, ttl)
        except LeaseHeldError as e:
            # gc is brief; a record naming a dead local process is being replaced by its new holder right now
            transient = e.holder is None or e.holder.get("role") == "gc" or _local_pid_dead(e.holder)
            if not transient or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def live_holder(storage: Storage) -> dict[str, Any] | None:
    """Who holds the root's lease now, as far as a reader can tell without taking it (None: nobody)."""
    return lease_class(storage).live_holder(storage)


def recorded_holder(storage: Storage) -> dict[str, Any] | None:
    """Who the root's lease record names, whether or not that process is alive (this host may not see its pid)."""
    return lease_class(storage).recorded(storage)
