"""`python -m ettr report|plot|advise|simulate`: goodput of the job whose checkpoints live in ROOT."""
from __future__ import annotations

import argparse
import json
import sys

from .attribution import attribute_root
from .ledger import LedgerError
from .model import advise, daly_interval, expected_ettr, seed_ettr, simulate, young_interval
from .report import plot_timeline, report_json, report_text


def _parser() -> argparse.ArgumentParser:
    """Subcommands and their options."""
    p = argparse.ArgumentParser(prog="python -m ettr", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("report", "seconds per category, per attempt, ETTR and advice"),
                        ("plot", "timeline PNG of attempts and categories"),
                        ("advise", "fitted costs and a recommended checkpoint interval")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("root", help="checkpoint root (path or fsspec URL)")
        s.add_argument("--rank", type=int, default=None, help="rank whose ledger to attribute (default: lowest)")
        s.add_argument("--window", type=float, default=3600.0, help="sliding ETTR window in seconds")
        s.add_argument("--mttf", type=float, default=None, help="MTTF in seconds instead of the one fitted")
        if name == "plot":
            s.add_argument("-o", "--output", default="timeline.png")
        else:
            s.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("simulate", help="Monte Carlo ETTR for an interval, beside the closed forms")
    s.add_argument("--interval", type=float, required=True, help="compute seconds between checkpoints")
    s.add_argument("--write", type=float, default=0.0, help="blocking seconds per checkpoint")
    s.add_argument("--restart", type=float, default=300.0, help="seconds per failure besides lost work")
    s.add_argument("--mttf", type=float, required=True, help="mean time to failure, seconds")
    s.add_argument("--segments", type=int, default=200_000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; bad ledgers exit with status 2 and the file:line."""
    args = _parser().parse_args(argv)
    if args.cmd == "simulate":
        sim = simulate(args.interval, args.write, args.restart, args.mttf, segments=args.segments, seed=args.seed)
        out = {
            "simulated": sim.ettr, "stderr": sim.stderr, "failures": sim.failures,
            "expected_exact": expected_ettr(args.interval, args.write, args.restart, args.mttf),
            "seed_model": seed_ettr(args.interval, args.write, args.restart, args.mttf),
            "young_interval": young_interval(args.write, args.mttf),
            "daly_interval": daly_interval(args.write, args.mttf),
        }
        print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k:<16}{v:.6g}" for k, v in out.items()))
        return 0
    try:
        a = attribute_root(args.root, rank=args.rank, window_s=args.window)
    except (LedgerError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    adv = advise(a, mttf_s=args.mttf)
    if args.cmd == "plot":
        plot_timeline(a, args.output)
        print(args.output)
    elif args.cmd == "report":
        print(report_json(a, adv) if args.json else report_text(a, adv))
    else:
        print(json.dumps({**adv.__dict__, "gain": adv.gain}, indent=2) if args.json else adv.text())
    return 0
