"""Both command line tools on bad input: one line on stderr, a non-zero exit, never a traceback or a hang."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt
import ckpt.cli
import ettr.cli
from ettr import FakeClock, GoodputTracker


def _run(main, argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """A root with a committed step and crafted `_IN_PROGRESS` markers, an empty one, a file, and a goodput root."""
    base = tmp_path_factory.mktemp("roots")
    good = base / "good"
    with ckpt.CheckpointManager(good) as m:
        m.save(1, {"w": torch.arange(6.0).reshape(2, 3), "step": 1}).wait()
    for step, marker in ((7, "[1, 2]"), (8, '{"pid": "12", "host": 3, "time": "now", "lease": []}'), (9, "not json")):
        (good / f"step_0000000{step}").mkdir()
        (good / f"step_0000000{step}" / "_IN_PROGRESS").write_text(marker)
    (base / "empty").mkdir()
    (base / "file").write_text("not a root")
    (base / "unstarted" / "ettr").mkdir(parents=True)  # only the empty ledger of a process that died in start()
    (base / "unstarted" / "ettr" / "ledger-a1-rank0.jsonl").write_bytes(b"")
    goodput = base / "goodput"
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(goodput), attempt_id="a1", rank=0, job_id="job", clock=clock, flush_interval=0).start()
    for s in (1, 2):
        tr.step_begin(s)
        clock.advance(1.0)
        tr.step_end(s)
    tr.end()
    other = GoodputTracker(str(base / "unstarted1"), attempt_id="a1", rank=1, clock=clock).start()  # rank 1 ran
    other.end()
    (base / "unstarted1" / "ettr" / "ledger-a1-rank0.jsonl").write_bytes(b"")  # rank 0 died in start()
    return {k: str(base / k) for k in ("good", "empty", "file", "goodput", "unstarted", "unstarted1")}


CKPT_ERRORS = [  # argv (ROOT names a fixture root), exit status, text of the one line on stderr
    (["ls", "{missing}"], 1, "no such directory"),
    (["verify", "{missing}"], 1, "no such directory"),
    (["gc", "{missing}"], 1, "no such directory"),
    (["inspect", "{missing}"], 1, "no such directory"),
    (["explain", "{missing}", "--step", "1"], 1, "no such directory"),
    (["ls", "{file}"], 1, "not a directory"),
    (["ls", "foo://bucket/run"], 1, 'unsupported URL scheme "foo"'),
    # the root's trailing '/' was stripped with the scheme's: tensorstore's 'Parsing spec from url: "s3:/"'
    (["ls", "s3://"], 1, "s3://: an s3:// root names a bucket"),
    (["inspect", "gs:///"], 1, "gs://: a gs:// root names a bucket"),
    (["inspect", "{good}", "--step", "-1"], 2, "a step is never negative"),
    (["verify", "{good}", "--step", "-1"], 2, "a step is never negative"),
    (["explain", "{good}", "--step", "x"], 2, "not a step number"),
    (["rollback", "{good}", "--to", "1_0"], 2, "not a step number: '1_0'"),  # int() read it as 10
    (["inspect", "{good}", "--step", "5"], 1, "step 5 is not committed"),
    (["verify", "{good}", "--step", "5"], 1, "step 5 is not committed"),
    (["explain", "{good}", "--step", str(1 << 64)], 2, "a step is at most 2**63 - 1"),
    (["inspect", "{empty}"], 1, "no committed checkpoint"),
    (["gc", "{good}", "--bogus"], 2, "unrecognized arguments"),
    # a typo was taken as false: requests signed with whatever credentials the default chain found
    (["ls", "{good}", "--storage-option", "anonymous=ture"], 1, "storage option anonymous is true or false"),
    (["ls", "{good}", "--storage-option", "requester_pays="], 1, "(1, true, yes, on; 0, false, no, off), got ''"),
]


@pytest.mark.parametrize("argv, code, text", CKPT_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_ckpt_cli_bad_input_is_one_line_and_a_nonzero_exit(roots, tmp_path, capsys, argv, code, text):
    argv = [a.format(missing=str(tmp_path / "nope"), **roots) for a in argv]
    got, _, err = _run(ckpt.cli.main, argv, capsys)
    assert got == code and text in err and len(err.strip().splitlines()) == 1, (got, err)


def test_explain_of_a_step_it_cannot_explain_prints_nothing_on_stdout(tmp_path, capsys):
    """A step past what the sampler counts to printed the header line ('sampler ... from checkpoint step 3') on stdout
    before the error, so a script reading stdout got half an answer with exit 1. Now stdout stays empty."""
    from ckpt import ShuffledSampler

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(3, {"sampler": ShuffledSampler(100, 4, seed=1)})
    code, out, err = _run(ckpt.cli.main, ["explain", str(tmp_path), "--step", str(1 << 61)], capsys)
    assert code == 1 and out == "" and "is past 2**62" in err and err.count("\n") == 1, (out, err)


def test_explain_of_a_sampler_state_saved_by_a_newer_version_says_so(tmp_path, capsys):
    """A sampler state whose kind is a later version of a known sampler ('ckpt.ShuffledSampler/2') read as
    'no sampler state in step 3', as if the checkpoint held none; now the error names the kind and the ones read."""
    from ckpt import ShuffledSampler

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(3, {"sampler": ShuffledSampler(100, 4, seed=1)})
    path = tmp_path / "step_00000003" / "manifest.json"
    body = json.loads(path.read_bytes())["body"]
    body["tree"]["sampler"]["v"]["kind"] = "ckpt.ShuffledSampler/2"
    text = json.dumps(body, separators=(",", ":"))
    path.write_text(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}))
    code, out, err = _run(ckpt.cli.main, ["explain", str(tmp_path), "--step", "2"], capsys)
    assert code == 1 and out == "" and err.count("\n") == 1, (out, err)
    assert "sampler state of kind 'ckpt.ShuffledSampler/2', which this version of ckpt does not read" in err, err
    assert "(it reads ckpt.RandomWindowSampler/1, ckpt.ShuffledSampler/1)" in err, err


def test_a_step_directory_given_as_the_root_is_named_with_its_root(tmp_path, capsys):
    """`ckpt ls ROOT/step_00000100` said only "no checkpoints in ROOT/step_00000100"; ls, inspect and verify now name
    the directory's step and the root holding it."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(100, {"t": torch.ones(2)}).wait()
    step_dir = str(tmp_path / "step_00000100")
    hint = f"(step_00000100 is step 100's directory: its root is {tmp_path})"
    for command, want in (("ls", 0), ("inspect", 1), ("verify", 0)):
        code, out, err = _run(ckpt.cli.main, [command, step_dir], capsys)
        assert code == want and hint in out + err, (command, out, err)


def test_control_characters_of_a_root_reach_the_terminal_escaped(tmp_path, capsys):
    """A key holding a newline or an escape sequence (an imported file's tensor names, a crafted root) was printed
    as is by inspect: a forged line, a terminal recoloured or cleared; ls did so with a quarantined step's reason.
    Now such a character is shown escaped; other text (é) as it is."""
    import json

    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"model": {"w\n  fake: float32[9]": torch.ones(1), "\x1b[2Jé": torch.ones(1)}})
    (tmp_path / "_quarantine" / "step_00000009-1").mkdir(parents=True)
    record = {"reason": "bad\x1b[2J\nstep 10 ok", "time": 0}
    (tmp_path / "_quarantine" / "step_00000009-1" / "_DAMAGED").write_text(json.dumps(record))
    for argv in (["inspect", str(tmp_path)], ["ls", str(tmp_path)]):
        code, out, err = _run(ckpt.cli.main, argv, capsys)
        assert code == 0 and "\x1b" not in out and "\\x1b[2J" in out, out
    code, out, err = _run(ckpt.cli.main, ["inspect", str(tmp_path)], capsys)
    assert "  w\\n  fake: float32[9]: float32[1]" in out and "\\x1b[2Jé: float32[1]" in out, out
    assert len(out.splitlines()) == 4, out
    code, out, err = _run(ckpt.cli.main, ["ls", str(tmp_path)], capsys)
    assert "bad\\x1b[2J\\nstep 10 ok" in out and len(out.splitlines()) == 3, out


@pytest.mark.parametrize("command", [["rollback", "--to", "1"], ["gc"], ["ls"], ["verify", "-q"]])
def test_a_tier_named_twice_is_refused_naming_it(tmp_path, capsys, command):
    """`rollback ROOT --local ROOT` (the root given as its own local tier) failed 'ROOT is being written by ckpt gc:
    pid N' (its own lease, taken for the first), and ls, verify and gc covered the root twice. Now a root named
    twice (./ROOT, ROOT/ alike) is refused before anything is done."""
    with ckpt.CheckpointManager(tmp_path / "r") as m:
        for step in (1, 2):
            m.save(step, {"w": torch.ones(2)}).wait()
    root = str(tmp_path / "r")
    code, out, err = _run(ckpt.cli.main, [command[0], root, *command[1:], "--local", root + "/"], capsys)
    assert code == 1 and out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith(f"error: --local {root}/ is {root}, the durable root: name each tier once"), err
    assert ckpt.CheckpointManager(root).steps() == [1, 2]


def test_ckpt_cli_reads_crafted_markers_without_a_traceback(roots, capsys):
    code, out, err = _run(ckpt.cli.main, ["ls", roots["good"]], capsys)
    assert code == 0 and not err
    assert "1  committed" in out and all(f"{s}  incomplete" in out for s in (7, 8, 9))
    code, out, err = _run(ckpt.cli.main, ["gc", roots["good"], "--dry-run"], capsys)
    assert code == 0 and not err and all(f"would remove incomplete step {s}" in out for s in (7, 8, 9))
    code, out, _ = _run(ckpt.cli.main, ["ls", roots["empty"]], capsys)
    assert code == 0 and "no checkpoints" in out  # an existing empty root is not an error
    code, out, err = _run(ckpt.cli.main, ["ls", "memory://"], capsys)  # the whole store: was a parse error
    assert code == 0 and out == "no checkpoints in memory://\n", (out, err)


def test_special_files_planted_in_a_root_are_damage_or_ignored_never_a_hang_or_an_abort(tmp_path, capsys):
    """A FIFO as ``_LEASE`` hung `ckpt ls` (and `/dev/zero` there read without end); a FIFO as a quarantined step's
    record aborted the whole listing; a pack file replaced by a directory aborted `verify` at that step, leaving
    the later steps unchecked."""
    root = tmp_path / "ck"
    with ckpt.CheckpointManager(root) as m:
        for step in (1, 2, 3):
            m.save(step, {"w": torch.full((4,), float(step))}).wait()
    (pack_file,) = root.glob("step_00000002/*/packs/rank_00000/c/0")
    pack_file.unlink()
    pack_file.mkdir()
    (root / "_LEASE").unlink()
    os.mkfifo(root / "_LEASE")
    (root / "_quarantine" / "step_00000009-1").mkdir(parents=True)
    os.mkfifo(root / "_quarantine" / "step_00000009-1" / "_DAMAGED")
    code, out, err = _run(ckpt.cli.main, ["ls", str(root)], capsys)
    assert code == 0 and not err, err
    assert "3  committed" in out and "9  damaged" in out and "no readable _DAMAGED record" in out
    code, out, err = _run(ckpt.cli.main, ["verify", str(root)], capsys)
    assert code == 1 and not err, err
    assert "step 2: DAMAGED: pack file is a directory" in out and "step 3: ok" in out
    with pytest.raises(OSError, match="not a regular file .*: remove it"):
        with ckpt.CheckpointManager(root) as m:
            m.save(4, {"w": torch.zeros(4)})


def test_ls_lists_a_root_whose_manifest_or_quarantine_record_holds_a_time_no_calendar_has(tmp_path, capsys):
    """A well-signed manifest with time 2**53 (within the bounds the manifest accepts) or a quarantine record with
    -2**53 failed the whole `ls` with 'year 285428751 is out of range'; such a time is shown as unix seconds."""
    root = tmp_path / "ck"
    with ckpt.CheckpointManager(root) as m:
        for step in (1, 2):
            m.save(step, {"w": torch.zeros(2)}).wait()
    path = root / "step_00000001" / "manifest.json"
    body = json.loads(path.read_bytes())["body"] | {"time": 2**53}
    text = json.dumps(body, separators=(",", ":"))
    path.write_text(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}))
    (root / "_quarantine" / "step_00000009-1").mkdir(parents=True)
    (root / "_quarantine" / "step_00000009-1" / "_DAMAGED").write_text('{"reason": "x", "time": -9007199254740992}')
    code, out, err = _run(ckpt.cli.main, ["ls", str(root)], capsys)
    assert code == 0 and not err, err
    assert "9007199254740992 (unix time)" in out and "2  committed" in out
    assert "quarantined -9007199254740992 (unix time)" in out


ETTR_ERRORS = [
    (["report", "{goodput}", "--mttf", "0"], "must be a finite positive"),
    (["report", "{goodput}", "--window", "-5"], "must be a finite positive"),
    (["report", "{goodput}", "--window", "1e-300"], "must be at least 1e-06 s (a microsecond"),  # was an ETTR of 0
    # taken and ignored: only report prints a windowed ETTR, and the plot draws no advice
    (["advise", "{goodput}", "--window", "60"], "unrecognized arguments: --window 60"),
    (["plot", "{goodput}", "--window", "60"], "unrecognized arguments: --window 60"),
    (["plot", "{goodput}", "--mttf", "3600"], "unrecognized arguments: --mttf 3600"),
    (["report", "{missing}"], "nope: no such directory"),
    (["report", "{empty}"], "no ledgers in"),
    # the ledgers' own folder given as the root: it said only 'no ledgers in ROOT/ettr/ettr'
    (["report", "{goodput}/ettr"], "/ettr holds ledgers itself: give the checkpoint root, the folder above it"),
    # was "no ledgers to attribute (is ROOT/ettr/ empty?)", naming no folder, of one that is not empty
    (["report", "{unstarted}"], "unstarted/ettr holds a record: each one is empty (its attempt ended before"),
    # rank 0 died in start(), rank 1 ran: the error named no other rank to report instead
    (["report", "{unstarted1}"], "writing its start record); it holds ledgers of rank 1 too (--rank R)"),
    (["advise", "{file}"], "file: not a directory"),
    (["plot", "{goodput}", "-o", "/nonexistent/x.png"], "/nonexistent/x.png"),
    # matplotlib's "Format 'v2' is not supported (supported formats: ...)", after drawing, named no file
    (["plot", "{goodput}", "-o", "{goodput}/t.v2"], "/t.v2: no image format has the extension .v2; give one of"),
    # numpy's own 'error: expected non-negative integer' named no flag
    (["simulate", "--interval", "600", "--mttf", "20000", "--seed", "-1"], "--seed: must be a non-negative integer"),
]


@pytest.mark.parametrize("argv, text", ETTR_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_ettr_cli_bad_input_is_one_line_and_exit_2(roots, tmp_path, capsys, argv, text):
    argv = [a.format(missing=str(tmp_path / "nope"), **roots) for a in argv]
    code, _, err = _run(ettr.cli.main, argv, capsys)
    assert code == 2 and text in err and len(err.strip().splitlines()) == 1, (code, err)


def test_a_warning_of_the_ettr_cli_is_one_line_said_once(roots, tmp_path, capsys):
    """A root with an empty ledger beside a good one: report printed Python's warning format (the library's
    file:line, a line of its source) twice, once per read of the ledgers (attribution, stragglers)."""
    root = tmp_path / "goodput"
    shutil.copytree(roots["goodput"], root)
    (root / "ettr" / "ledger-zz-rank0.jsonl").write_bytes(b"")
    code, out, err = _run(ettr.cli.main, ["report", str(root)], capsys)
    assert code == 0 and "ETTR" in out
    assert (
        err
        == f"warning: {root}/ettr/ledger-zz-rank0.jsonl: an empty ledger (its attempt ended before writing its start record): left out of the report\n"
    )


SIMULATIONS = [  # each of these ran for hours or forever, or claimed a certainty it had not measured
    (["--interval", "600", "--mttf", "60"], "not simulated: with 600 s per segment"),
    (["--interval", "1", "--restart", "2000", "--mttf", "100"], "not simulated"),
    (["--interval", "3000", "--mttf", "600", "--segments", "1000000"], "not simulated"),
    (["--interval", "600", "--mttf", "0"], "--mttf: '0' must be a finite positive"),
    (["--interval", "600", "--mttf", "nan"], "must be a finite positive"),
    (["--interval", "600", "--mttf", "inf"], "must be a finite positive"),
    (["--interval", "-1", "--mttf", "60"], "--interval: '-1' must be a finite positive"),
    (["--interval", "inf", "--mttf", "60"], "must be a finite positive"),
    (["--interval", "60", "--mttf", "600", "--segments", "0"], "must be a positive integer"),
    # one segment (or one two-tier cycle) has no spread: its standard error read 0.0
    (["--interval", "60", "--mttf", "600", "--segments", "1"], "segments must be at least 2 (one gives no standard"),
    (
        ["--interval", "60", "--local-mttf", "600", "--node-mttf", "6000", "--persist-every", "5", "--segments", "9"],
        "--segments must be at least twice --persist-every (10), got 9",
    ),
]


def test_simulations_that_would_not_finish_are_refused_at_once():
    """In one subprocess, so that a regression times out instead of hanging the suite."""
    script = textwrap.dedent(f"""
        import sys
        import ettr.cli
        for argv in {[argv for argv, _ in SIMULATIONS]!r}:
            try:
                code = ettr.cli.main(["simulate", *argv])
            except SystemExit as e:
                code = e.code
            print(code, flush=True)
            print("--", file=sys.stderr, flush=True)
    """)
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert res.stdout.split() == ["2"] * len(SIMULATIONS), (res.stdout, res.stderr)
    errors = res.stderr.split("--\n")[:-1]
    for (argv, text), err in zip(SIMULATIONS, errors):
        assert text in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert "exact expected ETTR" in errors[0]


@pytest.mark.parametrize("tool, args", [("ckpt", ["inspect", "good"]), ("ettr", ["report", "goodput"])])
def test_a_reader_that_leaves_early_gets_no_traceback(roots, tool, args):
    """`python -m ckpt inspect ROOT | head -1`: the pipe closes before the tool writes."""
    argv = [roots.get(a, a) for a in args]
    p = subprocess.Popen(
        [sys.executable, "-m", tool, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1
    assert "Traceback" not in err and "Exception ignored" not in err and not err.strip(), err
