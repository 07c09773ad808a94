"""`python -m ckpt ls|inspect|verify|gc|rollback|explain|export|import`: look at a checkpoint root, take weights
out, bring checkpoints in, roll a run back, without writing Python.

``ls``, ``inspect``, ``verify``, ``gc`` and ``rollback`` of a local root read JSON and bytes only: they import
neither torch nor numpy nor tensorstore (tests/test_cli_imports.py); ``explain``, ``export`` and ``import`` load
them when they run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import warnings
from typing import Any, NamedTuple, NoReturn

from . import catalog, layout, lease, storage_args
from . import tree as tree_mod
from .errors import CheckpointError, StepNotFoundError, described
from .layout import read_manifest
from .storage import Storage, open_storage

EXPORT_FORMATS = ("safetensors", "torch", "hf")  # exporter.FORMATS, named here so that --help needs no torch


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (`--help` has the usage), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _printable(text: str) -> str:
    """`text` with its control characters escaped (``\\n``, ``\\x1b``): a key or reason read from a root forges no
    line and sends the terminal no escape sequence."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _when(t: float) -> str:
    """`t` as a local date and time; as unix seconds where no calendar has it (a crafted manifest's 2**53 failed
    the whole `ls`)."""
    try:
        return datetime.datetime.fromtimestamp(t).isoformat(" ", "seconds")
    except (ValueError, OverflowError, OSError):
        return f"{t:.0f} (unix time)"


class _Tier(NamedTuple):
    """A root a command covers: the line that heads its part, the root, and the root whose lease covers it when it
    is another (a peer replica: the local tier it lies in, whose writer receives into it)."""

    heading: str
    root: Storage
    writer: Storage | None = None


def _tiers(storage: Storage, args: argparse.Namespace) -> list[_Tier]:
    """The roots a command covers, each with the line that heads its part: the root alone (no heading), or with
    ``--local DIR`` (a rank's local tier, repeatable) the durable root, each local tier and each peer replica in it."""
    if not getattr(args, "local", None):
        return [_Tier("", storage)]
    out = [_Tier(f"durable tier {storage.url}", storage)]
    named = {storage.url: "the durable root"}  # a root covered twice: rollback would meet its own lease
    for path in args.local:
        local = _open(path, args.storage_options)
        if local.url in named:
            raise ValueError(f"--local {path} is {local.url}, {named[local.url]}: name each tier once")
        named[local.url] = f"--local {path}"
        out.append(_Tier(f"local tier {local.url}", local))
        for rank in layout.replica_ranks(local):
            replica = open_storage(os.path.join(local.url, layout.replica_root(rank)))
            out.append(_Tier(f"replica of rank {rank} in {local.url}", replica, local))
    return out


def _each_tier(command: Any, *, with_writer: bool = False) -> Any:
    """Run a one-root command on every root of `_tiers`, each part under its heading; exit status: the worst.
    `with_writer`: the command also takes the root whose lease covers that root (`_Tier.writer`)."""

    def run(storage: Storage, args: argparse.Namespace) -> int:
        code = 0
        for tier in _tiers(storage, args):
            if tier.heading:
                print(f"== {tier.heading}")
            extra = {"writer": tier.writer} if with_writer else {}
            code = max(code, command(tier.root, args, **extra))
        return code

    return run


def cmd_ls(storage: Storage, args: argparse.Namespace) -> int:
    """One line per step: its state, two sizes each labelled with what it measures, its time (or a remark).

    ``on disk``: the bytes of the step's files (chunk padding, checksums, zarr.json and the manifest included), where
    the root lists sizes cheaply; an object store shows ``-`` (sizing would read every object). ``tensors``: the
    bytes of the tensors the manifest lists (what `inspect` and `verify` report), for committed steps."""
    rows: list[tuple[int, str, str, str, str]] = []  # step, state, on disk, tensors, time or remark
    holder = lease.live_holder(storage)
    cheap = storage.cheap_sizes

    def on_disk(path: str) -> str:
        return _human(storage.size(path)) if cheap else "-"

    for e in catalog.entries(storage):
        when, tensors = "", "-"
        if e.committed:
            try:
                manifest = read_manifest(storage, e.step)
                when = _when(manifest.time)
                tensors = _human(sum(a.nbytes for a in manifest.arrays.values()))
            except StepNotFoundError:  # deleted since it was listed (another process's retention)
                continue
            except CheckpointError as err:
                when = f"DAMAGED: {_printable(str(err))}"
        state = (
            "committed" if e.committed else ("in progress" if holder and e.owner == holder.get("id") else "incomplete")
        )
        rows.append((e.step, state, on_disk(layout.step_dir(e.step)), tensors, when))
    for q in catalog.quarantined(storage):
        when = f"quarantined {_when(q.time)}" if q.time is not None else "quarantined"
        rows.append((q.step, "damaged", on_disk(q.path), "-", f"{when} in {q.path}: {_printable(q.reason)}"))
    if not rows:
        print(f"no checkpoints in {storage.url}{layout.step_dir_hint(storage)}")
        return 0
    print(f"{'step':>10}  {'state':<12} {'on disk':>10} {'tensors':>10}  time")
    for step, state, disk, tensors, when in sorted(rows, key=lambda r: r[0]):
        print(f"{step:>10}  {state:<12} {disk:>10} {tensors:>10}  {when}")
    return 0


def _pick_step(storage: Storage, step: int | None) -> int:
    return step if step is not None else layout.newest_committed(storage)


_BRANCHES = (tree_mod.MAPPING, tree_mod.STATE, tree_mod.PER_RANK)  # shown entry by entry; the rest on one line


def _tree_lines(tree: Any, arrays: dict, indent: str = "") -> list[str]:
    """The entries of a branch, one line each (a branch's own entries indented below it)."""
    node = tree_mod.node_of(tree)
    if node.kind == tree_mod.STATE:  # an object's state_dict: its entries
        return _tree_lines(node.children[0][1], arrays, indent)
    quote = not all(isinstance(k, str) for k, _ in node.children)  # tell "1" from 1 where keys are mixed
    return [
        line
        for k, sub in node.children
        for line in _entry_lines(
            f"rank {k}" if node.kind == tree_mod.PER_RANK else repr(k) if quote else k, sub, arrays, indent
        )
    ]


def _entry_lines(label: str, tree: Any, arrays: dict, indent: str) -> list[str]:
    node = tree_mod.node_of(tree)
    label = _printable(label)
    if node.kind == tree_mod.TENSOR:
        a = arrays[node.name]
        where = f"array {node.name}" if a.places is None else _places(a)
        return [f"{indent}{label}: {a.dtype}{list(a.shape)}  ({_human(a.nbytes)}, {where})"]
    if node.kind in _BRANCHES:
        kind = f" <{_printable(node.name)}>" if node.kind == tree_mod.STATE else ""
        return [f"{indent}{label}:{kind}"] + _tree_lines(tree, arrays, indent + "  ")
    text = tree_mod.shown(tree)
    return [f"{indent}{label}: {text if len(text) < 100 else text[:97] + '...'}"]


def _places(a: Any) -> str:
    """Where a placed array's boxes are: its one place, else how many boxes in how many packs."""
    if len(a.places) == 1:
        return f"in pack {a.places[0][0]} at byte {a.places[0][1]}"
    return f"{len(a.places)} boxes in {len({p for p, _ in a.places})} packs"


def cmd_inspect(storage: Storage, args: argparse.Namespace) -> int:
    m = read_manifest(storage, _pick_step(storage, args.step))
    if args.json:
        print(json.dumps(m.to_json(), indent=1))
        return 0
    total = sum(a.nbytes for a in m.arrays.values())
    packed = sum(a.places is not None for a in m.arrays.values())
    packs = f" ({packed} placed in {len(m.packs)} pack{'s' * (len(m.packs) != 1)})" if m.packs else ""
    print(
        f"step {m.step}  world_size {m.world_size}  {len(m.arrays)} arrays{packs}, {_human(total)} of tensors  "
        f"versions {m.versions}"
    )
    if m.metadata:
        print(f"metadata: {json.dumps(m.metadata)}")
    print("\n".join(_tree_lines(m.tree, m.arrays)))
    return 0


def cmd_verify(storage: Storage, args: argparse.Namespace) -> int:
    steps = [args.step] if args.step is not None else layout.committed_steps(storage)
    if not steps:
        print(layout.nothing_committed(storage))
        return 0
    bad = 0
    if args.step is not None and not layout.is_committed(storage, args.step):  # not damage: nothing to check
        committed = layout.committed_steps(storage)
        if args.local:  # `_verify_tiers` found it in another tier (a local-only step of persist_every)
            print(f"step {args.step}: not committed in this tier (committed: {committed})")
            return 0
        raise StepNotFoundError(f"step {args.step} is not committed in {storage.url} (committed: {committed})")
    from tqdm import tqdm

    for step in steps:
        total = 0
        try:
            total = read_manifest(storage, step).nbytes_here()
            with tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"verify step {step}",
                disable=args.quiet or None,
                file=sys.stderr,
            ) as bar:
                problems: list[CheckpointError] = list(catalog.verify(storage, step, on_bytes=bar.update))
        except StepNotFoundError:  # its manifest went: deleted meanwhile, as checked below
            problems = []
        except CheckpointError as e:
            problems = [e]
        if not layout.is_committed(storage, step):  # files missing: a live writer's retention deleted the step
            print(f"step {step}: deleted while it was being verified (a live writer's retention): not checked")
            continue
        for p in problems:
            print(f"step {step}: DAMAGED: {_printable(str(p))}")
        if problems:
            bad += 1
        else:
            print(f"step {step}: ok ({_human(total)} of tensors checked)")
    return 1 if bad else 0


def _verify_tiers(storage: Storage, args: argparse.Namespace) -> int:
    """`verify` on every tier. With ``--step`` and ``--local``, a tier without the step says so and the others are
    verified (with persist_every=2 an odd step is in the local tier only); a step no tier holds is the error."""
    if args.step is not None and args.local:
        held = [(tier.root.url, layout.committed_steps(tier.root)) for tier in _tiers(storage, args)]
        if not any(args.step in steps for _, steps in held):
            where = "; ".join(f"{url}: {steps}" for url, steps in held)
            raise StepNotFoundError(f"step {args.step} is not committed in any tier: {where}")
    return _each_tier(cmd_verify)(storage, args)


def _sampler_states(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """(key path, decoded state) of every sampler state saved in a checkpoint tree (JSON-only subtrees)."""
    node = tree_mod.node_of(tree)
    if node.kind in (tree_mod.STATE, tree_mod.PER_RANK):  # an object's state_dict; the first rank's entry
        return [found for _, sub in node.children[:1] for found in _sampler_states(sub, path)]
    if node.kind != tree_mod.MAPPING:
        return []
    if not tree_mod.tensor_refs(tree):
        from .determinism import data
        from .state import decode

        decoded = decode(tree, lambda *_: None)
        if data.names_a_sampler(decoded):  # a newer version's too: explain says it cannot read it
            return [(path, decoded)]
    return [found for k, sub in node.children for found in _sampler_states(sub, f"{path}.{k}" if path else str(k))]


def _explaining(storage: Storage, step: int) -> int:
    """The checkpoint whose sampler state trained `step`: the earliest at or after it (a `skip()` made at a later
    resume changes the batches from that resume on, and the checkpoints after it carry it), else the newest."""
    steps = layout.committed_steps(storage)
    if not steps:
        raise StepNotFoundError(layout.nothing_committed(storage))
    return next((s for s in steps if s >= step), steps[-1])


def cmd_explain(storage: Storage, args: argparse.Namespace) -> int:
    m = read_manifest(storage, _explaining(storage, args.step) if args.checkpoint is None else args.checkpoint)
    found = [(k, v) for k, v in _sampler_states(m.tree) if args.key is None or k == args.key]
    if not found:
        print(f"error: no sampler state{f' at key {args.key!r}' if args.key else ''} in step {m.step}", file=sys.stderr)
        return 1
    if len(found) > 1:
        print(
            f"error: several sampler states ({', '.join(k for k, _ in found)}): choose one with --key", file=sys.stderr
        )
        return 1
    key, saved = found[0]
    from .determinism import data

    explanation = data.format_explanation(data.explain(saved, args.step))  # an error leaves stdout empty
    print(f"sampler {key!r} from checkpoint step {m.step}")
    print(explanation)
    return 0


def cmd_gc(storage: Storage, args: argparse.Namespace, writer: Storage | None = None) -> int:
    """Remove leftovers of crashed saves (never a live save: `writer`, the root whose lease covers this one when it is
    another, a replica's local tier), other saves' data directories, quarantined steps."""
    incomplete = args.incomplete or args.force or not args.damaged
    removed = 0
    gone: set[int] = set()  # the incomplete steps removed (or that would be)
    if args.dry_run:
        for e in catalog.garbage(storage, force=args.force, writer=writer) if incomplete else []:
            print(f"would remove incomplete step {e.step}")
            gone.add(e.step)
            removed += 1
        for step, d in catalog.stale_data(storage) if incomplete else []:
            print(
                f"would remove another save's data {layout.data_path(step, d)} (committed step {step} does not use it)"
            )
            removed += 1
        for q in catalog.quarantined(storage) if args.damaged else []:
            print(f"would remove damaged step {q.step} ({q.path})")
            removed += 1
    else:
        for step in catalog.collect_garbage(storage, force=args.force, writer=writer) if incomplete else []:
            print(f"removed incomplete step {step}")
            gone.add(step)
            removed += 1
        for step, d in catalog.collect_stale_data(storage, force=args.force) if incomplete else []:
            print(f"removed another save's data {layout.data_path(step, d)} (committed step {step} does not use it)")
            removed += 1
        for q in catalog.collect_damaged(storage) if args.damaged else []:
            print(f"removed damaged step {q.step} ({q.path})")
            removed += 1
    kept = [e.step for e in catalog.entries(storage) if not e.committed and e.step not in gone] if incomplete else []
    if kept:
        _say_kept(storage, kept, writer)
    elif not removed:
        print("nothing to remove")
    return 0


def _say_kept(storage: Storage, kept: list[int], writer: Storage | None) -> None:
    """Why gc left incomplete steps: the live writer of the root (of `writer`, when its lease covers this one) may
    still be writing them. gc beside an object store's writer said "nothing to remove" while `ls` listed them."""
    root = writer or storage
    print(
        f"kept incomplete step {', '.join(str(s) for s in kept)}: {root.url} is being written by "
        f"{lease.describe(lease.live_holder(root))}, whose saves may still be writing it; gc removes it once no "
        "writer holds the root (--force removes it now: only when that writer is dead)"
    )


def cmd_rollback(storage: Storage, args: argparse.Namespace) -> int:
    """Delete the committed steps after ``--to``, newest first, in the root and every ``--local`` tier (with its
    replicas), so a run resumed from it can save them again; refused before anything is deleted when nothing would
    be left to resume or the step it resumes from is damaged."""
    tiers = _tiers(storage, args)
    roots = [tier.root for tier in tiers]
    heading = {id(tier.root): f" from the {tier.heading}" if tier.heading else "" for tier in tiers}
    victims = (catalog.roll_back_plan if args.dry_run else catalog.roll_back)(roots, args.to)
    for root, step in victims:
        print(f"{'would remove' if args.dry_run else 'removed'} committed step {step}{heading[id(root)]}")
    if not victims:
        print(f"no committed step after {args.to}")
    return 0


def _step(text: str) -> int:
    """A checkpoint step number on the command line: a non-negative integer."""
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):  # int() also takes '1_0', ' 3', '٣'
        raise argparse.ArgumentTypeError(f"not a step number: {text!r}")
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is never negative: {value}")
    if value >= layout.STEP_LIMIT:
        raise argparse.ArgumentTypeError(f"a step is at most 2**63 - 1, got {value}")
    return value


def _one_line(e: Exception) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def cmd_export(storage: Storage, args: argparse.Namespace) -> int:
    from . import exporter

    try:
        step = exporter.export(
            args.root,
            args.output,
            format=args.format,
            step=args.step,
            keys=args.keys.split(",") if args.keys is not None else None,  # --keys "": an empty key, refused
            max_shard_size=args.max_shard_size,
            config=args.config,
            progress=False if args.quiet else None,
            storage_options=args.storage_options,
        )
    except (KeyError, ValueError, TypeError, FileExistsError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    print(f"exported step {step} of {storage.url} to {args.output} ({args.format})")
    return 0


def cmd_import(storage: Storage, args: argparse.Namespace) -> int:
    from . import importers

    try:
        kind = importers.import_checkpoint(
            args.src, args.root, step=args.step, key=args.key, storage_options=args.storage_options
        )
    except (KeyError, ValueError, TypeError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    print(f"imported {args.src} ({kind}) as step {args.step} of {storage.url}")
    return 0


def _warning_line(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> str:
    """A warning as a command line tool says it: one line, without Python's file, line and source."""
    return f"warning: {message}\n"


def _training_step(text: str) -> int:
    """A step number as training logs it and checkpoints name it: an integer from 1."""
    step = _step(text)
    if step < 1:
        raise argparse.ArgumentTypeError(f"steps count from 1 (step N trains on the N-th global batch), got {step}")
    return step


def _open(root: str, storage_options: dict[str, str]) -> Storage:
    """The root's storage; a local root must be an existing directory (a typo is not an empty root)."""
    storage = open_storage(root, storage_options)
    storage.check_root()
    return storage


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m ckpt", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    local_help = "a rank's local tier (the manager's local=): shown beside the durable root, with its peer replicas"
    store = [storage_args.parser()]
    s = sub.add_parser("ls", parents=store, help="steps, sizes, committed or not, time")
    s.add_argument("root")
    s.add_argument("--local", action="append", metavar="DIR", help=local_help + "; repeatable")
    s = sub.add_parser("inspect", parents=store, help="the state tree with dtypes and shapes")
    s.add_argument("root")
    s.add_argument("--step", type=_step)
    s.add_argument("--json", action="store_true", help="the whole manifest as JSON")
    s = sub.add_parser("verify", parents=store, help="read every chunk and check every checksum; exit 1 on damage")
    s.add_argument("root")
    s.add_argument("--step", type=_step)
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.add_argument("--local", action="append", metavar="DIR", help=local_help + ", verified too; repeatable")
    s = sub.add_parser("gc", parents=store, help="remove incomplete steps left by crashed saves (never a live save)")
    s.add_argument("root")
    s.add_argument("--force", action="store_true", help="also remove steps that look in progress")
    s.add_argument("--damaged", action="store_true", help="remove quarantined (damaged) steps instead")
    s.add_argument("--incomplete", action="store_true", help="with --damaged: incomplete steps too")
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("--local", action="append", metavar="DIR", help=local_help + ", collected too; repeatable")
    s = sub.add_parser(
        "rollback",
        parents=store,
        help="delete the committed steps after --to, newest first, to resume from it (no live writer)",
    )
    s.add_argument("root")
    s.add_argument("--to", type=_step, required=True, help="the step to resume from: every later one is removed")
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("--local", action="append", metavar="DIR", help=local_help + ", rolled back too; repeatable")
    s = sub.add_parser(
        "explain", parents=store, help="the samples that formed a step's global batch, from a saved sampler state"
    )
    s.add_argument("root")
    s.add_argument(
        "--step",
        type=_training_step,
        required=True,
        help="the training step to explain, numbered from 1 as in training logs and checkpoint names "
        "(the checkpoint of step N holds the state after step N's batch)",
    )
    s.add_argument(
        "--checkpoint",
        type=_step,
        help="checkpoint to read the sampler state from (default: the earliest at or after --step, which holds the "
        "state that trained it: a skip() at a later resume is not in it; else the newest)",
    )
    s.add_argument("--key", help="key path of the sampler in the state, when there are several")
    s = sub.add_parser(
        "export",
        parents=store,
        help="weights out: safetensors shards, one torch.save file, or a folder for from_pretrained",
    )
    s.add_argument("root")
    s.add_argument("--step", type=_step, help="default: the newest committed step")
    s.add_argument("--format", required=True, help=f"one of {', '.join(EXPORT_FORMATS)}")
    s.add_argument("--keys", help="comma list of dotted keys to export (default: model)")
    s.add_argument("--max-shard-size", help="safetensors/hf: largest shard (default 5GB)")
    s.add_argument("--config", help="hf: the model's config.json (default: the one the HF integration stored)")
    s.add_argument("-o", "--output", required=True, help="file (torch) or folder (safetensors, hf) to create")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s = sub.add_parser(
        "import",
        parents=store,
        help="checkpoints in: a torch.save file, a DCP folder, safetensors or an HF folder becomes a committed step",
    )
    s.add_argument("src")
    s.add_argument("root")
    s.add_argument("--step", type=_step, required=True, help="the step number to commit it as")
    s.add_argument(
        "--key",
        help="put the whole source under this top-level key (default: weights under 'model', "
        "a dict of entries as its own keys)",
    )
    args = p.parse_args(argv)
    handler = {
        "ls": _each_tier(cmd_ls),
        "inspect": cmd_inspect,
        "verify": _verify_tiers,
        "gc": _each_tier(cmd_gc, with_writer=True),
        "rollback": cmd_rollback,
        "explain": cmd_explain,
        "export": cmd_export,
        "import": cmd_import,
    }[args.cmd]
    try:
        args.storage_options = storage_args.options(args)
        storage = (open_storage if args.cmd == "import" else _open)(args.root, args.storage_options)
        code = handler(storage, args)
        sys.stdout.flush()  # here, not at exit: a reader gone (`| head`) is handled below
        return code
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except Exception as e:  # a command line tool answers in one line, never with a traceback
        known = isinstance(e, (CheckpointError, OSError, ValueError))
        print(f"error: {e if known and str(e) else described(e)}", file=sys.stderr)
        return 1


def run() -> NoReturn:
    """The `ckpt` command (and `python -m ckpt`): `main` (warnings as one line each), then exit without the
    interpreter's final collections over torch's objects (gc.freeze: ~0.4 s of a 1.7 s call); `main` itself is for
    callers that go on."""
    warnings.formatwarning = _warning_line
    code = main()
    gc.freeze()
    sys.exit(code)
