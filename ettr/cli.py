"""`python -m ettr report|plot|advise|simulate`: goodput of the job whose checkpoints live in ROOT."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable

import ckpt.storage_args as storage_args

from .advice import TwoTierInputs, advise
from .attribution import Attribution, attribute_root
from .formulas import (
    TwoTierCosts,
    check_seconds,
    check_window,
    daly_interval,
    expected_ettr,
    optimal_two_tier,
    seed_ettr,
    two_tier_ettr,
    young_interval,
)
from .ledger import LedgerError
from .report import plot_timeline, report_json, report_text
from .simulate import simulate, simulate_two_tier
from .stragglers import WINDOW_STEPS, stragglers_root


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (`--help` has the usage), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _checked(check: Callable[[str, float], float]):
    """An argparse type: a number `check` (name, value) takes, its refusal a usage error naming the text given."""

    def parse(text: str) -> float:
        try:
            return check("the value", float(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).replace("the value", repr(text), 1)) from None

    return parse


def _seconds(positive: bool):
    """An argparse type: a finite (positive or non-negative) number of seconds."""
    return _checked(functools.partial(check_seconds, positive=positive))


def _integer(positive: bool):
    """An argparse type: a positive (a count) or non-negative (a seed: numpy's generators take no negative one)
    integer."""
    least, what = (1, "positive") if positive else (0, "non-negative")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {text!r}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    """Subcommands and their options."""
    p = _Parser(prog="python -m ettr", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("report", "seconds per category, per attempt, ETTR and advice"),
        ("plot", "timeline PNG of attempts and categories"),
        ("advise", "fitted costs and a recommended checkpoint interval"),
    ):
        s = sub.add_parser(name, help=help_, parents=[storage_args.parser()])
        s.add_argument("root", help="checkpoint root: a path, or an object-store URL (s3://bucket/path, gs://...)")
        s.add_argument("--rank", type=int, default=None, help="rank whose ledger to attribute (default: lowest)")
        if name == "report":  # the one output with the windowed ETTR: plot and advise would take it and ignore it
            s.add_argument(
                "--window", type=_checked(check_window), default=3600.0, help="sliding ETTR window in seconds"
            )
        else:
            s.set_defaults(window=3600.0)
        if name != "plot":  # the plot draws no advice
            s.add_argument(
                "--mttf", type=_seconds(True), default=None, help="MTTF in seconds instead of the one fitted"
            )
        if name == "plot":
            s.add_argument(
                "-o",
                "--output",
                default="timeline.png",
                help="file to write, format by extension (none: PNG); a directory: DIR/timeline.png (default %(default)s)",
            )
        else:
            s.add_argument("--json", action="store_true", help="machine-readable output")
            _two_tier_flags(s)
        if name == "report":
            s.add_argument(
                "--straggler-window",
                type=_integer(True),
                default=WINDOW_STEPS,
                help=f"steps per window in which the slowest rank is named (default {WINDOW_STEPS})",
            )
    s = sub.add_parser("simulate", help="Monte Carlo ETTR for an interval, beside the closed forms")
    s.add_argument("--interval", type=_seconds(True), required=True, help="compute seconds between checkpoints")
    s.add_argument("--write", type=_seconds(False), default=0.0, help="blocking seconds per checkpoint")
    s.add_argument("--restart", type=_seconds(False), default=300.0, help="seconds per failure besides lost work")
    s.add_argument("--mttf", type=_seconds(True), help="mean time to failure, seconds (one tier)")
    g = s.add_argument_group("two tiers (--local-mttf and --node-mttf instead of --mttf; --restart: durable)")
    g.add_argument("--local-mttf", type=_seconds(True), help="MTTF of failures the local tier survives, seconds")
    g.add_argument("--node-mttf", type=_seconds(True), help="MTTF of node losses (the local tier is lost), seconds")
    g.add_argument("--local-restart", type=_seconds(False), help="seconds per local-class failure (default --restart)")
    g.add_argument("--persist-every", type=_integer(True), help="every K-th save is persisted (default 1)")
    g.add_argument("--persist-cost", type=_seconds(False), help="seconds of training per persist (default 0)")
    s.add_argument("--segments", type=_integer(True), default=200_000)
    s.add_argument("--seed", type=_integer(False), default=0, help="random seed, a non-negative integer (default 0)")
    s.add_argument("--json", action="store_true")
    return p


def _two_tier_flags(s: argparse.ArgumentParser) -> None:
    """The two-tier plan's inputs: each overrides what the ledger tells (docs/goodput.md, two tiers)."""
    g = s.add_argument_group("two tiers (default: fitted from the ledger where it can tell)")
    g.add_argument("--local-write", type=_seconds(False), help="seconds training stalls per local save")
    g.add_argument("--persist-cost", type=_seconds(False), help="seconds of training each persist costs (default 0)")
    g.add_argument("--local-read", type=_seconds(False), help="seconds per restore from the local tier")
    g.add_argument("--durable-read", type=_seconds(False), help="seconds per restore from the durable tier")
    g.add_argument("--local-mttf", type=_seconds(True), help="MTTF of failures the local tier survives, seconds")
    g.add_argument("--node-mttf", type=_seconds(True), help="MTTF of node losses (the local tier is lost), seconds")


def _two_tier_inputs(args: argparse.Namespace, a: Attribution) -> TwoTierInputs | None:
    """The flags as TwoTierInputs; for `report`, None unless a flag is given or the ledger names tiers."""
    inputs = TwoTierInputs(
        args.local_write, args.persist_cost, args.local_read, args.durable_read, args.local_mttf, args.node_mttf
    )
    if args.cmd == "report" and inputs == TwoTierInputs() and set(a.restores_per_tier) <= {None}:
        return None
    return inputs


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; any error (a bad ledger: its file:line) is one line on stderr and exit status 2."""
    args = _parser().parse_args(argv)
    try:
        # warnings (an empty ledger left out, a wall clock that went back) as lines of their own, each once (report
        # reads the ledgers twice), and only beside an output: an error is the one line to read
        with warnings.catch_warnings(record=True) as caught:
            text = _run(args)
        for line in dict.fromkeys(f"warning: {w.message}" for w in caught):
            print(line, file=sys.stderr)
        print(text)
        sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is handled below
    except BrokenPipeError:  # the reader left (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (LedgerError, ValueError, OSError, ImportError) as err:  # ImportError: plot's extra, matplotlib
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> str:
    """The output of one subcommand."""
    if args.cmd == "simulate" and (args.local_mttf or args.node_mttf):
        return _simulate_two_tier(args)
    if args.cmd == "simulate":
        if args.mttf is None:
            raise ValueError("simulate needs --mttf (one tier), or --local-mttf and --node-mttf (two tiers)")
        given = [f"--{k.replace('_', '-')}" for k in _TWO_TIER_ONLY if getattr(args, k) is not None]
        if given:  # else a one-tier run was simulated as if they had been taken
            raise ValueError(
                f"{', '.join(given)}: two-tier flags, and --mttf simulates one tier; give --local-mttf and "
                "--node-mttf instead of --mttf to simulate two tiers"
            )
        sim = simulate(args.interval, args.write, args.restart, args.mttf, segments=args.segments, seed=args.seed)
        out = {
            "simulated": sim.ettr,
            "stderr": sim.stderr,
            "failures": sim.failures,
            "expected_exact": expected_ettr(args.interval, args.write, args.restart, args.mttf),
            "seed_model": seed_ettr(args.interval, args.write, args.restart, args.mttf),
            "young_interval": young_interval(args.write, args.mttf),
            "daly_interval": daly_interval(args.write, args.mttf),
        }
        return json.dumps(out, indent=2) if args.json else "\n".join(f"{k:<16}{v:.6g}" for k, v in out.items())
    a = attribute_root(
        args.root, rank=args.rank, window_s=args.window, storage_options=storage_args.options(args) or None
    )
    if args.cmd == "plot":
        return plot_timeline(a, args.output)  # the path written: an existing directory gets timeline.png inside
    adv = advise(a, mttf_s=args.mttf, two_tier=_two_tier_inputs(args, a))
    if args.cmd == "report":
        s = stragglers_root(args.root, window=args.straggler_window, storage_options=storage_args.options(args) or None)
        return report_json(a, adv, s) if args.json else report_text(a, adv, s)
    return json.dumps(adv.to_dict(), indent=2) if args.json else adv.text()


_TWO_TIER_ONLY = ("local_restart", "persist_every", "persist_cost")  # simulate's flags that only two tiers take


def _simulate_two_tier(args: argparse.Namespace) -> str:
    """`simulate` with two tiers: the given plan simulated beside its exact form, the optimal pair, the best one tier."""
    if args.mttf is not None or not (args.local_mttf and args.node_mttf):
        raise ValueError("two tiers need --local-mttf and --node-mttf, and not --mttf (that is the one-tier MTTF)")
    local_restart = args.restart if args.local_restart is None else args.local_restart
    costs = TwoTierCosts(
        args.write, args.persist_cost or 0.0, local_restart, args.restart, args.local_mttf, args.node_mttf
    )
    k = args.persist_every or 1
    if args.segments < 2 * k:  # cycles of K segments: fewer than two gives no standard error
        raise ValueError(f"--segments must be at least twice --persist-every ({2 * k}), got {args.segments}")
    sim = simulate_two_tier(args.interval, k, costs, cycles=args.segments // k, seed=args.seed)
    plan = optimal_two_tier(costs)
    out = {
        "simulated": sim.ettr,
        "stderr": sim.stderr,
        "failures": sim.failures,
        "expected_exact": two_tier_ettr(args.interval, k, costs),
        "optimal_interval": plan.interval_s,
        "optimal_persist_every": plan.persist_every,
        "optimal_ettr": plan.ettr,
        "single_interval": plan.single_interval_s,
        "single_ettr": plan.single_ettr,
        "gain": plan.gain,
    }
    return json.dumps(out, indent=2) if args.json else "\n".join(f"{k:<22}{v:.6g}" for k, v in out.items())
