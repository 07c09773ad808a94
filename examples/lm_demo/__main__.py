"""`python -m examples.lm_demo`: train a reference run and a chaos run under torchrun, report goodput, compare weights.

With --local the chaos run checkpoints to two tiers; --compare adds the same chaos with one tier at the same durable
interval. Exit status 0 only when every chaos run's final weights are bitwise identical to the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import ettr

from .config import QUICK, add_tier_args, add_training_args, at_least, training_argv
from .corpus import write_corpus
from .model import HEADS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.lm_demo", description=__doc__)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"), help="where corpus, checkpoints and PNG go")
    parser.add_argument(
        "--chaos", type=at_least(0), default=3, help="SIGKILLs of the chaos run (torchrun restarts it each time)"
    )
    parser.add_argument("--corpus-mb", type=float, default=4.0, help="megabytes of standard-library source to train on")
    parser.add_argument("--quick", action="store_true", help=f"a tiny run for tests: {QUICK}, 1 kill")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="with --local: also run the chaos run with one tier, checkpointing every --every x --persist-every steps "
        "(the durable interval of the two-tier run), and compare their goodput",
    )
    add_training_args(parser)
    add_tier_args(parser)
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flag combinations that would not do what they say."""
    if args.local is None and (args.compare or args.node_loss):
        parser.error("--compare and --node-loss need --local DIR (two tiers)")
    if args.local is not None and args.local.resolve() == args.run_dir.resolve():
        parser.error(f"--local {args.local} is --run-dir: each run's local tier would be its durable root")
    if args.d_model % HEADS:
        parser.error(f"--d-model must be a multiple of {HEADS} (the attention heads), got {args.d_model}")
    if args.corpus_mb * 1e6 < args.context + 1:
        parser.error(
            f"--corpus-mb {args.corpus_mb} holds fewer bytes than one window (--context + 1 = {args.context + 1})"
        )
    if not 0 <= args.node_loss <= args.chaos:
        parser.error(
            f"--node-loss must name one of the {args.chaos} SIGKILL(s) (1..{args.chaos}), got {args.node_loss}"
        )


def _call(cmd: list[str]) -> int:
    """Run `cmd` to its end; if this process is stopped meanwhile (Ctrl-C, SIGTERM), stop it first (torchrun then
    stops its workers), so no run trains on, orphaned, into the run directory."""
    with subprocess.Popen(cmd) as child:
        try:
            return child.wait()
        except BaseException:
            child.terminate()
            child.wait()
            raise


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the demo as an exception (status 143), so a run in progress is stopped on the way out."""
    sys.exit(128 + signum)


def torchrun(
    args: argparse.Namespace, name: str, corpus: Path, kills: int, *, every: int | None = None, tiers: bool = False
) -> Path:
    """Run the worker under torch's elastic agent with `kills` restarts allowed, checkpointing every `every` steps
    (default --every), with two tiers if `tiers`; returns the run's checkpoint root (its durable tier)."""
    root = args.run_dir / name
    shutil.rmtree(root, ignore_errors=True)  # a fresh job: never resume a previous demo's checkpoints
    tier_argv = []
    if tiers:
        local = args.local / name
        shutil.rmtree(local, ignore_errors=True)
        tier_argv = [f"--local-tier={local}", f"--persist-every={args.persist_every}", f"--node-loss={args.node_loss}"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        f"--max-restarts={kills}",
        "--monitor-interval=0.2",
        f"--log-dir={os.devnull}",  # no per-run log folder: torchrun's default is a new temp dir it never removes
        "-m",
        "examples.lm_demo.worker",
        f"--root={root}",
        f"--corpus={corpus}",
        f"--name={name}",
        f"--chaos={kills}",
        *training_argv(argparse.Namespace(**{**vars(args), "every": every or args.every})),
        *tier_argv,
    ]
    print(f"\n$ torchrun {' '.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    code = _call(cmd)
    if code:
        sys.exit(f"{name} run failed: torchrun exited with status {code}")
    print(f"{name} run finished in {time.monotonic() - t0:.1f} s", flush=True)
    return root


def _summary(label: str, attribution: ettr.Attribution) -> str:
    """One line of the comparison: ETTR, lost seconds and restores per tier of a chaos run."""
    restores = ", ".join(f"{tier or 'one tier'} {n}" for tier, (n, _) in attribution.restores_per_tier.items())
    return (
        f"  {label:<46} ETTR {attribution.ettr:.3f}   lost {attribution.micros['lost'] / 1e6:6.2f} s   "
        f"restores: {restores or 'none'}"
    )


def main(argv: list[str] | None = None) -> int:
    """Corpus, reference run, chaos run(s), report, timeline PNG, determinism verdict."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = _parser()
    if "--quick" in (argv if argv is not None else sys.argv[1:]):
        parser.set_defaults(**QUICK, chaos=1, corpus_mb=0.25)
    args = parser.parse_args(argv)
    _check(parser, args)
    t0 = time.monotonic()
    corpus = args.run_dir / "corpus.bin"
    size = write_corpus(corpus, int(args.corpus_mb * 1e6))
    print(f"corpus: {size:,} bytes of the Python standard library's sources -> {corpus}", flush=True)
    reference = torchrun(args, "reference", corpus, 0)
    two_tiers = args.local is not None
    chaos = torchrun(args, "chaos", corpus, args.chaos, tiers=two_tiers)
    durable_every = args.every * args.persist_every
    runs = {"chaos": chaos}
    if args.compare:
        runs["chaos-one-tier"] = torchrun(args, "chaos-one-tier", corpus, args.chaos, every=durable_every)

    attribution = ettr.attribute_root(str(chaos))
    png = args.run_dir / "timeline.png"
    ettr.plot_timeline(attribution, str(png))
    expected = json.loads((reference / "final.json").read_text())
    got = {name: json.loads((root / "final.json").read_text()) for name, root in runs.items()}
    same = all(g == expected for g in got.values())
    how = (
        f"two tiers: local every {args.every} steps, durable every {durable_every}"
        + (f", SIGKILL {args.node_loss} lost the node" if args.node_loss else "")
        if two_tiers
        else "one tier"
    )
    print(
        f"\ngoodput of the chaos run ({args.chaos} SIGKILLs, restarted by torchrun; {how}), demo wall time "
        f"{time.monotonic() - t0:.1f} s:\n"
    )
    two_tier = ettr.TwoTierInputs() if two_tiers else None
    print(ettr.report_text(attribution, ettr.advise(attribution, two_tier=two_tier)))
    if args.compare:
        print(f"\nthe same chaos at the same durable interval ({durable_every} steps):")
        print(_summary(f"one tier, every {durable_every} steps", ettr.attribute_root(str(runs["chaos-one-tier"]))))
        print(_summary(f"two tiers, local every {args.every}, durable every {durable_every}", attribution))
    print(f"\nreference weights sha256 {expected['sha256']} after {expected['steps']} steps")
    for name, g in got.items():
        print(f"{'resumed' if name == 'chaos' else name:<9} weights sha256 {g['sha256']} after {g['steps']} steps")
    print(f"timeline: {png.resolve()}")
    print(f"deterministic: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
