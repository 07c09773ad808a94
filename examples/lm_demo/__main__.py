"""`python -m examples.lm_demo`: train a reference run and a chaos run under torchrun, report goodput, compare weights.

Exit status 0 only when the chaos run's final weights are bitwise identical to the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ettr

from .config import QUICK, add_training_args, training_argv
from .corpus import write_corpus


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.lm_demo", description=__doc__)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"), help="where corpus, checkpoints and PNG go")
    parser.add_argument(
        "--chaos", type=int, default=3, help="SIGKILLs of the chaos run (torchrun restarts it each time)"
    )
    parser.add_argument("--corpus-mb", type=float, default=4.0, help="megabytes of standard-library source to train on")
    parser.add_argument("--quick", action="store_true", help=f"a tiny run for tests: {QUICK}, 1 kill")
    add_training_args(parser)
    return parser


def torchrun(args: argparse.Namespace, name: str, corpus: Path, kills: int) -> Path:
    """Run the worker under torch's elastic agent with `kills` restarts allowed; returns the run's checkpoint root."""
    root = args.run_dir / name
    shutil.rmtree(root, ignore_errors=True)  # a fresh job: never resume a previous demo's checkpoints
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        f"--max-restarts={kills}",
        "--monitor-interval=0.2",
        "-m",
        "examples.lm_demo.worker",
        f"--root={root}",
        f"--corpus={corpus}",
        f"--name={name}",
        f"--chaos={kills}",
        *training_argv(args),
    ]
    print(f"\n$ torchrun {' '.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    code = subprocess.call(cmd)
    if code:
        sys.exit(f"{name} run failed: torchrun exited with status {code}")
    print(f"{name} run finished in {time.monotonic() - t0:.1f} s", flush=True)
    return root


def main(argv: list[str] | None = None) -> int:
    """Corpus, reference run, chaos run, report, timeline PNG, determinism verdict."""
    parser = _parser()
    if "--quick" in (argv if argv is not None else sys.argv[1:]):
        parser.set_defaults(**QUICK, chaos=1, corpus_mb=0.25)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    corpus = args.run_dir / "corpus.bin"
    size = write_corpus(corpus, int(args.corpus_mb * 1e6))
    print(f"corpus: {size:,} bytes of the Python standard library's sources -> {corpus}", flush=True)
    reference = torchrun(args, "reference", corpus, 0)
    chaos = torchrun(args, "chaos", corpus, args.chaos)

    attribution = ettr.attribute_root(str(chaos))
    png = args.run_dir / "timeline.png"
    ettr.plot_timeline(attribution, str(png))
    expected, got = (json.loads((root / "final.json").read_text()) for root in (reference, chaos))
    same = expected == got
    print(
        f"\ngoodput of the chaos run ({args.chaos} SIGKILLs, restarted by torchrun), demo wall time "
        f"{time.monotonic() - t0:.1f} s:\n"
    )
    print(ettr.report_text(attribution, ettr.advise(attribution)))
    print(f"\nreference weights sha256 {expected['sha256']} after {expected['steps']} steps")
    print(f"resumed   weights sha256 {got['sha256']} after {got['steps']} steps")
    print(f"timeline: {png.resolve()}")
    print(f"deterministic: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
