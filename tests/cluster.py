"""A cluster on one machine: each node a network namespace with a hostname (UTS) and a tmpfs (mount) of its own.

A node is a long-lived process, the init of a pid namespace, in the node's network namespace, with its own mount
and UTS namespaces: its hostname is ``node<i>``, its ``/etc/hosts`` names every node, and a tmpfs of its own is
mounted on the same path on every node (``Cluster.nvme``, empty on the host), which is where the local tiers go; its
``/etc/resolv.conf`` names no reachable server, so a name lookup fails at once instead of waiting for the host's.
Commands run inside a node through ``nsenter``. The nodes' ``eth0`` are veth pairs whose other ends are ports of a
bridge in a third namespace; every address is link-local (169.254.S.i/24), assigned by the harness inside the
namespaces it created. Nothing of the host's own interfaces or routes is touched. The durable root is a host
directory, which every node sees.

Node loss is `Node.kill`: SIGKILL to the namespace's init kills every process of the node, and its tmpfs goes with
its mount namespace; `Node.boot` starts a replacement with an empty one. `Node.link(False)` takes the node's bridge
port down (a partition); `Node.delay` adds netem delay to its eth0 where the kernel has netem.

Names start with `PREFIX` and the creating process's pid, so a killed run's leftovers never collide with a new
run and `cleanup_stale` removes them. `Job` runs a torchrun job on every node; `node_loss` and `faults` are the
scenarios of `tests/test_cluster.py`. Run as a script (``scripts/cluster.sh [node-loss] [faults] [slow]``) it builds
two nodes, runs the scenarios and prints their figures.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import doc_blocks

# a node's init: reaps the processes orphaned inside it (a killed torchrun's workers), until it is killed
REPO = Path(__file__).resolve().parents[1]
INIT = "import os, time  # ckcl node init\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(0.05)\n"
DOC = Path(__file__).resolve().parents[1] / "docs" / "checkpointing.md"
PREFIX = "ckcl"  # every namespace this harness makes: ckcl<pid>x<hex>-<role>
TMPFS_SIZE = "256m"
SLOW_MBIT = 8  # the slow NIC where the kernel has no netem: what the slow node sends, limited to 1 MB/s


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, its output captured; a failure raises with the command and its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def missing() -> str | None:
    """What this process lacks to build a cluster (the reason a test skips), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "not root: creating network, mount and UTS namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    ns = f"{PREFIX}{os.getpid()}probe{secrets.token_hex(2)}"
    try:
        _sh("ip", "netns", "add", ns)
    except RuntimeError as e:
        return f"`ip netns add` is not permitted here: {e}"
    try:
        _sh("ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "--pid", "--fork", "true")
    except RuntimeError as e:
        return f"unshare --mount --uts --pid is not permitted here: {e}"
    finally:
        _sh("ip", "netns", "del", ns, check=False)
    return None


def netem_missing() -> str | None:
    """Why `tc qdisc ... netem` cannot delay a link here, or None when it can (probed in a namespace of our own)."""
    if shutil.which("tc") is None:
        return "no `tc` on PATH"
    ns = f"{PREFIX}{os.getpid()}probe{secrets.token_hex(2)}"
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer", "name", "d1")
        done = _sh(
            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "d0", "root", "netem", "delay", "1ms", check=False
        )
        if done.returncode != 0:
            return f"the kernel has no netem qdisc (sch_netem): `tc qdisc add ... netem` says {done.stderr.strip()!r}"
        return None
    finally:
        _sh("ip", "netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete the namespaces (and kill the processes in them) that a killed harness run left: those whose creating
    process is gone. Returns their names."""
    removed = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        digits = name[len(PREFIX) :].split("x", 1)[0].split("probe", 1)[0]
        if digits.isdigit() and _alive(int(digits)):
            continue
        for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _sh("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _pid_ns(pid: int) -> str | None:
    """The pid namespace of a live process (None for one gone or a zombie: it holds nothing any more)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return os.readlink(f"/proc/{pid}/ns/pid")
    except (OSError, IndexError):
        return None


class Node:
    """One node: a network namespace (eth0 at `addr`), and while booted an init holding its hostname and tmpfs."""

    def __init__(self, cluster: Cluster, index: int):
        self.cluster, self.index = cluster, index
        self.name = f"node{index}"
        self.ns = f"{cluster.id}-n{index}"
        self.addr = cluster.address(index)
        self.port = f"p{index}"  # its bridge port, in the bridge's namespace
        self.boots = 0
        self._holder: subprocess.Popen | None = None  # `unshare`, the parent of the node's init
        self.init: int | None = None  # the host pid of the node's init (pid 1 of its pid namespace)

    def boot(self) -> None:
        """Start the node (again, after a `kill`): a fresh hostname, /etc/hosts and an empty tmpfs on `nvme`."""
        assert self.init is None, f"{self.name} is running"
        c = self.cluster
        script = (
            f"hostname {self.name} && mount -t tmpfs -o size={TMPFS_SIZE} tmpfs {shlex.quote(str(c.nvme))} && "
            f"mount --bind {shlex.quote(str(c.hosts))} /etc/hosts && "
            f"mount --bind {shlex.quote(str(c.resolv))} /etc/resolv.conf && exec {shlex.quote(sys.executable)} -S -c {shlex.quote(INIT)}"
        )
        argv = ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts", "--pid", "--fork"]
        self._holder = subprocess.Popen([*argv, "sh", "-c", script], start_new_session=True)
        deadline = time.monotonic() + 30
        while True:  # ready once the init has exec'd the reaper (hostname and mounts done)
            kids = _children(self._holder.pid)
            if kids and INIT.encode() in Path(f"/proc/{kids[0]}/cmdline").read_bytes():
                self.init = kids[0]
                break
            if self._holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not boot (exit {self._holder.poll()})")
            time.sleep(0.01)
        self.boots += 1

    def run(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` inside the node (its network, mounts, hostname and pid namespace), output appended to `log`."""
        assert self.init is not None, f"{self.name} is down"
        enter = ["nsenter", "-t", str(self.init), "-m", "-u", "-n", "-p", f"--wd={os.getcwd()}", "--"]
        with open(log, "ab") as out:
            return subprocess.Popen(
                [*enter, *argv], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )

    def pids(self) -> list[int]:
        """Host pids of every process of the node but its init."""
        ns = _pid_ns(self.init) if self.init else None
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.init and ns is not None and _pid_ns(int(entry)) == ns:
                out.append(int(entry))
        return out

    def signal(self, signum: int, pids: list[int] | None = None) -> None:
        """Send `signum` to the given processes of the node (default: all but its init)."""
        for pid in self.pids() if pids is None else pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def host_pid(self, pid: int) -> int:
        """The host's pid of the node's process `pid` (as the process itself sees it, inside the node)."""
        for p in self.pids():
            try:
                status = Path(f"/proc/{p}/status").read_text()
            except OSError:
                continue
            ids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if ids and int(ids[-1]) == pid:
                return p
        raise LookupError(f"{self.name} has no process {pid}")

    def kill_jobs(self) -> None:
        """SIGKILL every process of the node but its init: the node stays up, its tmpfs with it."""
        deadline = time.monotonic() + 30
        while pids := self.pids():
            self.signal(signal.SIGKILL, pids)
            assert time.monotonic() < deadline, f"{self.name}: processes {pids} survive SIGKILL"
            time.sleep(0.01)

    def kill(self) -> None:
        """Node loss: SIGKILL every process of the node at once (its init first); its tmpfs is gone with it."""
        if self.init is None:
            return
        os.kill(self.init, signal.SIGKILL)  # the kernel kills every process of the pid namespace
        self._holder.wait(30)
        self.init = self._holder = None

    def path(self, inside: str | os.PathLike) -> Path:
        """A path as the node sees it (its tmpfs included), reachable from the host while the node is up."""
        assert self.init is not None, f"{self.name} is down"
        return Path(f"/proc/{self.init}/root") / Path(inside).relative_to("/")

    def link(self, up: bool) -> None:
        """Take the node's link (its bridge port) down, or bring it back up: a partition of this node."""
        _sh("ip", "-n", self.cluster.bridge_ns, "link", "set", self.port, "up" if up else "down")

    def delay(self, ms: int | None) -> None:
        """Delay every packet the node sends by `ms` ms (netem on its eth0); None removes the delay (or the rate)."""
        tc = ["ip", "netns", "exec", self.ns, "tc", "qdisc"]
        if ms is None:
            _sh(*tc, "del", "dev", "eth0", "root", check=False)
        else:
            _sh(*tc, "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms")

    def qdisc(self) -> str:
        """`tc -s qdisc` of the node's eth0: what its delay or rate limit did (packets sent, held, dropped)."""
        return _sh("ip", "netns", "exec", self.ns, "tc", "-s", "qdisc", "show", "dev", "eth0").stdout

    def rate(self, mbit: int) -> None:
        """Limit what the node sends to `mbit` Mbit/s (a token bucket on its eth0; `delay(None)` removes it): a slow
        NIC where the kernel has no netem."""
        tc = ["ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", "eth0", "root"]
        _sh(*tc, "tbf", "rate", f"{mbit}mbit", "burst", "32kbit", "latency", "400ms")


class Cluster:
    """`nodes` nodes on one bridge, in namespaces named after this process; `with Cluster(dir) as c:` builds them,
    boots them and tears everything down at the end, whatever happened."""

    def __init__(self, workdir: Path, nodes: int = 2):
        self.id = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.subnet = random.Random(self.id).randrange(1, 255)  # 169.254.S.0/24
        self.workdir = Path(workdir)
        self.nvme = self.workdir / "nvme"  # every node's tmpfs is mounted here, in its own mount namespace
        self.hosts = self.workdir / "hosts"
        self.resolv = self.workdir / "resolv.conf"  # no name server but the node's own: a lookup fails at once
        self.bridge_ns = f"{self.id}-br"
        self.nodes = [Node(self, i) for i in range(nodes)]

    def address(self, index: int) -> str:
        """Node `index`'s link-local address."""
        return f"169.254.{self.subnet}.{index + 1}"

    def __enter__(self) -> Cluster:
        cleanup_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self.nvme.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{self.address(n.index)} {n.name}\n" for n in self.nodes)
        self.hosts.write_text(f"127.0.0.1 localhost\n{names}")
        self.resolv.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        b = self.bridge_ns
        _sh("ip", "netns", "add", b)
        _sh("ip", "-n", b, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", b, "link", "set", "br0", "up")
        for n in self.nodes:
            _sh("ip", "netns", "add", n.ns)
            _sh("ip", "-n", b, "link", "add", n.port, "type", "veth", "peer", "name", "eth0", "netns", n.ns)
            _sh("ip", "-n", b, "link", "set", n.port, "master", "br0")
            _sh("ip", "-n", b, "link", "set", n.port, "up")
            _sh("ip", "-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", "eth0")
            _sh("ip", "-n", n.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", n.ns, "link", "set", "lo", "up")
        for n in self.nodes:
            n.boot()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every node and delete every namespace of this cluster."""
        for n in self.nodes:
            try:
                n.kill()
            except Exception:
                pass
        for ns in [n.ns for n in self.nodes] + [self.bridge_ns]:
            for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _sh("ip", "netns", "del", ns, check=False)

    def torchrun(self, node: Node, run_id: str, script: str, args: list[str], log: Path) -> subprocess.Popen:
        """Start on `node` the torchrun line of docs/checkpointing.md, as written: the c10d rendezvous at node 0's
        address (node 0 hosts the store), this node's link-local address as its own, gloo over its eth0."""
        env = {
            "NODE0_ADDR": self.nodes[0].addr,
            "NODE_ADDR": node.addr,
            "IS_HOST": str(int(node.index == 0)),
            "RUN_ID": run_id,
            "MAX_RESTARTS": "0",  # the harness is the scheduler: it starts the job again
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),  # examples/
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(log.parent),  # torchrun's torchelastic_* folders, which it leaves, beside the log
        }
        return node.run(["bash", "-c", torchrun_line(), "torchrun", script, *args], log, env)


def torchrun_line() -> str:
    """The command docs/checkpointing.md tells every node of a two-node job to run."""
    blocks = doc_blocks.parse(DOC)
    return next(b.code for b in blocks if b.skip and b.skip.startswith("run on both nodes by tests/cluster.py"))


WORKER = str(Path(__file__).parent / "procs" / "cluster_worker.py")
FAULTS = str(Path(__file__).parent / "procs" / "cluster_faults.py")
LINE = re.compile(r"^rank (\d+) (resumed|step|done) (\S+)(?: (?:tier|loss) (\S+))?$", re.M)


class Job:
    """One training job of `procs/cluster_worker.py` on every node of `cluster`, started again after each loss: its
    durable root is ``WORKDIR/NAME/durable`` (the host's), its local tiers ``NVME/NAME/{rank}`` (each node's tmpfs),
    its run id NAME (torchrun's ``--rdzv-id``, which ckpt and ettr take from TORCHELASTIC_RUN_ID)."""

    def __init__(
        self,
        cluster: Cluster,
        name: str,
        *,
        script: str = WORKER,
        args: list[str] | None = None,
        steps: int = 24,
        every: int = 2,
        persist_every: int = 3,
        timeout: float = 10.0,
    ):
        """A job of `script` (default: the training worker with `steps`, `every`, `persist_every` and `timeout`, its
        collective_timeout); `args`: other flags of `script`, after --root and --local-tier."""
        self.cluster, self.name, self.script = cluster, name, script
        self.nproc = 2  # ranks per node: the documented torchrun line's --nproc-per-node
        self.dir = cluster.workdir / name
        self.root = self.dir / "durable"
        self.local = cluster.nvme / name
        self.dir.mkdir(parents=True, exist_ok=True)
        if args is None:
            corpus = cluster.workdir / "corpus.bin"
            args = [f"--corpus={corpus}", f"--steps={steps}", f"--every={every}"]
            args += [f"--persist-every={persist_every}", f"--timeout={timeout}"]
        self.args = [f"--root={self.root}", f"--local-tier={self.local}/{{rank}}", *args]
        self.attempt = 0
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def world(self) -> int:
        return self.nproc * len(self.cluster.nodes)

    def log_path(self, node: int, attempt: int | None = None) -> Path:
        return self.dir / f"attempt{self.attempt if attempt is None else attempt}-node{node}.log"

    def launch(self) -> None:
        """Start an attempt: torchrun on every node that is up (booting those that are down)."""
        self.attempt += 1
        self.procs = {}
        for n in self.cluster.nodes:
            if n.init is None:
                n.boot()
            self.procs[n.index] = self.cluster.torchrun(n, self.name, self.script, self.args, self.log_path(n.index))

    def text(self, attempt: int | None = None) -> str:
        """Every node's log of an attempt (default: the current one)."""
        return "".join(
            self.log_path(n.index, attempt).read_text() if self.log_path(n.index, attempt).exists() else ""
            for n in self.cluster.nodes
        )

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def wait_for(self, pattern: str, timeout: float = 120.0) -> "re.Match[str]":
        """The first match of `pattern` in the current attempt's logs (fails once the job ended without it)."""
        return wait_for(self.text, pattern, timeout, self.running)

    def wait(self, timeout: float = 120.0) -> dict[int, int]:
        """Each node's torchrun exit status once the attempt ends."""
        return {i: p.wait(timeout) for i, p in self.procs.items()}

    def records(self, attempt: int | None = None) -> dict:
        """What the workers said: {"resumed": {rank: (step, tier)}, "loss": {(rank, step): hex}, "done": {rank}}."""
        out: dict = {"resumed": {}, "loss": {}, "done": set()}
        for rank, what, a, b in LINE.findall(self.text(attempt)):
            if what == "resumed":
                out["resumed"][int(rank)] = (int(a), None if b == "None" else b)
            elif what == "step":
                out["loss"][(int(rank), int(a))] = b
            else:
                out["done"].add(int(rank))
        return out

    def inventory(self, rank: int) -> dict:
        """What rank `rank`'s local tier holds as `ckpt.tiers.Tiers.inventory` says it, read from its node's tmpfs
        (nothing when the node is down)."""
        from ckpt import layout
        from ckpt.storage import LocalStorage

        node = self.cluster.nodes[rank // self.nproc]
        if node.init is None or not node.path(self.local / str(rank)).exists():
            return {"local": [], "replica": {}}
        own = LocalStorage(str(node.path(self.local / str(rank))))
        replicas = {
            str(r): layout.committed_steps(LocalStorage(os.path.join(own.root, layout.replica_root(r))))
            for r in layout.replica_ranks(own)
        }
        return {"local": layout.committed_steps(own), "replica": replicas}

    def expected_restore(self) -> tuple[int, dict[int, str | None]]:
        """The step the next attempt must resume from and the tier each rank reads it from, by the tiers' own
        restore order over what survives: the local tiers of the nodes up, their replicas, the durable root (step 0,
        no tier: nothing survives)."""
        from ckpt import layout, tiers
        from ckpt.storage import open_storage
        from ckpt.target import DURABLE, PEER

        durable = layout.committed_steps(open_storage(str(self.root))) if self.root.exists() else []
        order = tiers.restore_order(durable, [self.inventory(r) for r in range(self.world)])
        if not order:
            return 0, {r: None for r in range(self.world)}
        source = order[0]
        names = {
            r: DURABLE if source.tier == DURABLE else PEER if r in source.heal else source.tier
            for r in range(self.world)
        }
        return source.step, names


def node_loss(
    job: Job, rng: random.Random, losses: list[tuple[int, ...]], say: Callable[[str], None] = print
) -> list[dict]:
    """Run `job` through node losses: for each entry of `losses` (the nodes lost at once), wait for an event of the
    current attempt (a step after its resume committed in the local tier of every node up, or, when every node is
    lost, a durable commit after its resume), then for 0-2 more steps chosen by `rng` and a random 0-50 ms; SIGKILL
    every process of those nodes (their tmpfs goes with them), end the job on the others (the scheduler ends the
    job; their tmpfs stays), start a replacement with an empty local tier, relaunch and check that every rank resumed
    from the step and tier the surviving copies allow. Returns one record per loss."""
    from ckpt import layout
    from ckpt.storage import open_storage

    out = []
    job.launch()
    for lost in losses:
        start = int(job.wait_for(r"rank 0 resumed (\d+)").group(1))
        everyone = len(lost) == len(job.cluster.nodes)

        def committed() -> str:  # the event: every rank's newest commit in the tier that will survive is new
            if everyone:
                newest = [max(layout.committed_steps(open_storage(str(job.root))), default=0)]
            else:  # each rank's own copy and its peer's replica of it
                inventories = [job.inventory(r) for r in range(job.world)]
                newest = [max(inv["local"], default=0) for inv in inventories]
                newest += [
                    max((s for inv in inventories for s in inv["replica"].get(str(r), ())), default=0)
                    for r in range(job.world)
                ]
            return "committed" if min(newest) > start else ""

        wait_for(committed, "committed", 120, job.running)
        now = max(int(s) for s in re.findall(r"rank 0 step (\d+)", job.text()))
        job.wait_for(rf"rank 0 step {now + rng.randint(0, 2)} ")
        time.sleep(rng.uniform(0, 0.05))  # the instant: random, after the event
        for n in lost:
            job.cluster.nodes[n].kill()
        killed = time.monotonic()
        for n in job.cluster.nodes:
            if n.index not in lost:
                n.kill_jobs()
        step, tiers = job.expected_restore()
        last = max(int(s) for s in re.findall(r"rank 0 step (\d+)", job.text()))
        job.launch()
        for r in range(job.world):
            job.wait_for(rf"rank {r} resumed ")
        resumed = time.monotonic() - killed
        got = job.records()["resumed"]
        record = {"lost": list(lost), "last_step": last, "expected": (step, tiers), "got": got, "resumed_s": resumed}
        say(
            f"lost node(s) {list(lost)} after step {last}: resumed from step {step}, tiers "
            f"{sorted(set(tiers.values()))}, job running again {resumed:.1f} s after the kill"
        )
        out.append(record)
    return out


def faults(job: Job, cases: list[str], node: int = 1, say: Callable[[str], None] = print) -> dict[str, dict]:
    """Run `procs/cluster_faults.py` through `cases` (save, persist, replicate: node `node`'s link goes down while
    every rank holds at that case's gate; sigstop: the last rank of node `node` is stopped before a save): let the
    ranks on, wait until every rank failed, check that no tier holds the step partly, bring the link back (continue
    the rank), wait for the next save's commit. Returns per case each rank's failure (seconds after its gate, type,
    message), the seconds from the fault until every rank had failed, and what each tier holds."""
    from ckpt import layout
    from ckpt.storage import open_storage

    gates = job.dir / "gates"
    gates.mkdir(exist_ok=True)
    job.launch()
    victim = job.cluster.nodes[node]
    out = {}
    for k, case in enumerate(cases, start=1):
        step = 10 * k + 2
        pids = {r: int(job.wait_for(rf"rank {r} gate {case} pid (\d+)").group(1)) for r in range(job.world)}
        if case == "persist":  # the step is in the peer's replica already: only the persist is in flight
            for r in range(job.world):
                job.wait_for(rf"replicated step {step}: sent to rank \d+, \d+ bytes of rank {r}'s kept")
        stopped = None
        if case == "sigstop":
            stopped = job.nproc * node + job.nproc - 1
            pid = victim.host_pid(pids[stopped])
            os.kill(pid, signal.SIGSTOP)
        else:
            victim.link(False)
        began = time.monotonic()
        (gates / case).touch()
        failures = {}
        for r in range(job.world):
            if r != stopped:
                found = job.wait_for(rf"rank {r} case {case} (?:failed after (\S+) s: (\w+): (.*)|did not fail)")
                assert found.group(1), f"rank {r} did not fail in case {case}"
                failures[r] = (float(found.group(1)), found.group(2), found.group(3))
        detected = time.monotonic() - began
        durable = layout.committed_steps(open_storage(str(job.root)))
        inventories = [job.inventory(r) for r in range(job.world)]
        if case == "sigstop":
            os.kill(pid, signal.SIGCONT)
            found = job.wait_for(rf"rank {stopped} case {case} (?:failed after (\S+) s: (\w+): (.*)|did not fail)")
            failures[stopped] = (float(found.group(1) or "nan"), found.group(2), found.group(3))
        else:
            victim.link(True)
        (gates / f"{case}-after").touch()
        for r in range(job.world):
            job.wait_for(rf"rank {r} case {case} committed {step + 1}")
        out[case] = {
            "step": step,
            "failures": failures,
            "detected_s": detected,
            "durable": durable,
            "inventories": inventories,
            "after": layout.committed_steps(open_storage(str(job.root))),
        }
        slowest = max(f[0] for f in failures.values() if f[0] == f[0])
        say(f"{case}: every rank failed {detected:.1f} s after the fault (slowest rank {slowest:.1f} s after its gate)")
    assert job.wait() == {n.index: 0 for n in job.cluster.nodes}, job.text()[-4000:]
    return out


def replication_seconds(text: str) -> list[float]:
    """The seconds each replication of a job's log spent moving bytes: ckpt's INFO line ``replicated step N: ... in
    S s (W s of it waiting for the peers)``, S less W."""
    pattern = r"replicated step \d+: .* in ([0-9.]+) s \(([0-9.]+) s of it waiting"
    return [float(s) - float(w) for s, w in re.findall(pattern, text)]


def replication_bytes(text: str) -> list[int]:
    """The bytes each replication of a job's log received (the same INFO line)."""
    return [int(b) for b in re.findall(r"replicated step \d+: sent to rank \d+, (\d+) bytes", text)]


def wait_for(
    read: Callable[[], str], pattern: str, timeout: float, alive: Callable[[], bool] = lambda: True
) -> "re.Match[str]":
    """The first match of the regular expression `pattern` in `read()`, polled until found; fails after `timeout`
    seconds or once `alive()` says the processes that would write it are gone."""
    deadline = time.monotonic() + timeout
    while True:
        text = read()
        found = re.search(pattern, text)
        if found:
            return found
        assert alive(), f"the job ended before saying {pattern!r}:\n{text[-4000:]}"
        assert time.monotonic() < deadline, f"never said {pattern!r} in {timeout} s:\n{text[-4000:]}"
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    """Build two nodes, run the scenarios asked for and print their figures; everything is torn down at the end."""
    import argparse
    import json
    import statistics
    import tempfile

    parser = argparse.ArgumentParser(prog="scripts/cluster.sh", description=main.__doc__)
    parser.add_argument("scenarios", nargs="*", default=["node-loss", "faults", "slow"], help="node-loss faults slow")
    parser.add_argument("--seed", type=int, default=None, help="the random instants of the node losses")
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and roots here (default: a temp dir)")
    args = parser.parse_args(argv)
    reason = missing()
    if reason:
        print(f"cannot build a cluster here: {reason}", file=sys.stderr)
        return 2
    seed = random.randrange(1 << 16) if args.seed is None else args.seed
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cluster-"))
    from examples.lm_demo.corpus import write_corpus

    write_corpus(work / "corpus.bin", 100_000)
    with Cluster(work) as c:
        print(f"nodes {[(n.name, n.addr) for n in c.nodes]}, work dir {work}, seed {seed}", flush=True)
        reference = Job(c, "reference")
        reference.launch()
        assert reference.wait() == {0: 0, 1: 0}, reference.text()[-4000:]
        fast = replication_seconds(reference.text())
        print(f"replication, no delay: median {statistics.median(fast):.3f} s over {len(fast)}", flush=True)
        if "node-loss" in args.scenarios:
            job = Job(c, "chaos")
            node_loss(job, random.Random(seed), [(1,), (0,), (0, 1), (0, 1)])
            assert job.wait() == {0: 0, 1: 0}, job.text()[-4000:]
            same = (job.root / "final.json").read_text() == (reference.root / "final.json").read_text()
            report = json.loads(
                subprocess.run(
                    [sys.executable, "-m", "ettr", "report", str(job.root), "--json"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            for tier, t in report["restores_per_tier"].items():
                print(
                    f"restore from the {tier} tier: {t['restores']} restores, {t['seconds'] / t['restores']:.3f} s each"
                )
            print(
                f"lost {report['seconds']['lost']:.1f} s, downtime {report['seconds']['downtime']:.1f} s; "
                f"final weights bitwise the reference's: {same}",
                flush=True,
            )
        if "faults" in args.scenarios:
            job = Job(c, "faults", script=FAULTS, args=[f"--gates={work / 'faults' / 'gates'}", "--timeout=5"])
            faults(job, ["save", "persist", "replicate", "sigstop"])
        if "slow" in args.scenarios:
            reason = netem_missing()
            if reason:
                print(f"slow link: no 50 ms delay ({reason}); node 1 limited to {SLOW_MBIT} Mbit/s instead", flush=True)
            job = Job(c, "slow", steps=8)
            if reason:
                c.nodes[1].rate(SLOW_MBIT)
            else:
                c.nodes[1].delay(50)
            try:
                job.launch()
                assert job.wait() == {0: 0, 1: 0}, job.text()[-4000:]
            finally:
                c.nodes[1].delay(None)
            slow = replication_seconds(job.text())
            how = f"limited to {SLOW_MBIT} Mbit/s" if reason else "delayed 50 ms"
            print(
                f"replication, node 1 {how}: median {statistics.median(slow):.3f} s over {len(slow)}, saves committed"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
