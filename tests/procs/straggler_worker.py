"""One rank of the straggler test under torchrun (gloo on 127.0.0.1): STEPS steps of a small matmul, a sleep of
SLEEP seconds in each step of rank SLOW only, then an all_reduce inside a `collective_wait` span, where the other rank
waits for it. The rank's metrics (`metric_totals`, and the points of
`ettr.step_window.time` with their attributes) go to ROOT/otel-rank<r>.json at the end.

    torchrun --nproc-per-node=2 straggler_worker.py ROOT SLOW SLEEP STEPS WINDOW
"""

import json
import os
import sys
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from ettr import GoodputMetrics, GoodputTracker, metric_totals

root, slow, sleep, steps, window = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
reader = InMemoryMetricReader()
metrics = GoodputMetrics(MeterProvider(metric_readers=[reader]).get_meter("straggler"))
tracker = GoodputTracker(root, job_id="straggler", straggler_window=window, metrics=metrics).start()  # RANK: torchrun's

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.randn(64, 64)
for step in range(steps):
    with tracker.step(step):
        y = x @ x
        if rank == slow:
            time.sleep(sleep)
        with tracker.span("collective_wait"):
            dist.all_reduce(y)
dist.barrier()
tracker.end()
points = [  # the window gauge's points as a backend sees them: attributes and value
    {**p.attributes, "value": p.value}
    for rm in reader.get_metrics_data().resource_metrics
    for sm in rm.scope_metrics
    for m in sm.metrics
    if m.name == "ettr.step_window.time"
    for p in m.data.data_points
]
with open(os.path.join(root, f"otel-rank{rank}.json"), "w") as f:
    json.dump({**metric_totals(reader), "step_window_points": points}, f)
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
