"""`python -m ettr report|plot|advise|simulate`: goodput of the job whose checkpoints live in ROOT."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .attribution import attribute_root
from .ledger import LedgerError
from .model import advise, check_seconds, daly_interval, expected_ettr, seed_ettr, simulate, young_interval
from .report import plot_timeline, report_json, report_text


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (`--help` has the usage), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _seconds(positive: bool):
    """An argparse type: a finite (positive or non-negative) number of seconds."""

    def parse(text: str) -> float:
        try:
            return check_seconds("the value", float(text), positive=positive)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).replace("the value", repr(text), 1)) from None

    return parse


def _count(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _storage_option(text: str) -> tuple[str, str]:
    """An argparse type: KEY=VALUE."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _store_parser() -> argparse.ArgumentParser:
    """The object-store options of `python -m ckpt` (same names, same meaning): ckpt's storage validates them."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("object stores (s3://, gs://; default: the standard AWS_* variables)")
    g.add_argument("--endpoint", help="S3 endpoint URL, e.g. http://127.0.0.1:8333 (default: AWS_ENDPOINT_URL)")
    g.add_argument("--region", help="S3 region (default: AWS_REGION)")
    g.add_argument("--timeout", type=float, help="seconds one storage request may take, retries included (default 30)")
    g.add_argument(
        "--storage-option",
        dest="options",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        help="any storage option of ckpt.storage (see docs/checkpointing.md); repeatable",
    )
    return p


def _options_of(args: argparse.Namespace) -> dict[str, object] | None:
    """The storage options given on the command line (None: none, the environment alone)."""
    options: dict[str, object] = dict(args.options)
    for key in ("endpoint", "region", "timeout"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    return options or None


def _parser() -> argparse.ArgumentParser:
    """Subcommands and their options."""
    p = _Parser(prog="python -m ettr", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("report", "seconds per category, per attempt, ETTR and advice"),
        ("plot", "timeline PNG of attempts and categories"),
        ("advise", "fitted costs and a recommended checkpoint interval"),
    ):
        s = sub.add_parser(name, help=help_, parents=[_store_parser()])
        s.add_argument("root", help="checkpoint root: a path, or an object-store URL (s3://bucket/path, gs://...)")
        s.add_argument("--rank", type=int, default=None, help="rank whose ledger to attribute (default: lowest)")
        s.add_argument("--window", type=_seconds(True), default=3600.0, help="sliding ETTR window in seconds")
        s.add_argument("--mttf", type=_seconds(True), default=None, help="MTTF in seconds instead of the one fitted")
        if name == "plot":
            s.add_argument("-o", "--output", default="timeline.png")
        else:
            s.add_argument("--json", action="store_true", help="machine-readable output")
    s = sub.add_parser("simulate", help="Monte Carlo ETTR for an interval, beside the closed forms")
    s.add_argument("--interval", type=_seconds(True), required=True, help="compute seconds between checkpoints")
    s.add_argument("--write", type=_seconds(False), default=0.0, help="blocking seconds per checkpoint")
    s.add_argument("--restart", type=_seconds(False), default=300.0, help="seconds per failure besides lost work")
    s.add_argument("--mttf", type=_seconds(True), required=True, help="mean time to failure, seconds")
    s.add_argument("--segments", type=_count, default=200_000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; any error (a bad ledger: its file:line) is one line on stderr and exit status 2."""
    args = _parser().parse_args(argv)
    try:
        print(_run(args))
        sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is handled below
    except BrokenPipeError:  # the reader left (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (LedgerError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> str:
    """The output of one subcommand."""
    if args.cmd == "simulate":
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
    a = attribute_root(args.root, rank=args.rank, window_s=args.window, storage_options=_options_of(args))
    adv = advise(a, mttf_s=args.mttf)
    if args.cmd == "plot":
        plot_timeline(a, args.output)
        return args.output
    if args.cmd == "report":
        return report_json(a, adv) if args.json else report_text(a, adv)
    return json.dumps({**adv.__dict__, "gain": adv.gain}, indent=2) if args.json else adv.text()
