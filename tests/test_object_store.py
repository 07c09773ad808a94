"""Object-store roots against a real S3 server (SeaweedFS, the session's `s3_server`): configuration from the AWS
variables or `storage_options`, bounded failures, the commit, retention, verify and the `ckpt` commands."""

import os
import re
import time

import pytest
import tensorstore as ts
import torch

import ckpt
from ckpt import catalog, cli, layout, lease
from ckpt.storage import kvstore_spec, open_storage
from ckpt.storage.spec import context as spec_context
from step_paths import pack_path

AWS_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
)
# A bound far above the timeouts the tests configure: a hang fails the test instead of stalling the suite.
HANG_S = 30.0


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
        "opt": {"m": torch.randn(5, 5, generator=g).double(), "step": step, "lr": 0.1 * step},
        "zero": torch.zeros(3),
    }


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
        else:
            assert a[k] == b[k] and type(a[k]) is type(b[k]), k


def _without_aws_env(monkeypatch):
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)


def test_s3_root_from_the_aws_variables_saves_restores_keeps_and_verifies_bitwise(s3_bucket, capfd):
    root = f"s3://{s3_bucket}/run/a"
    with ckpt.CheckpointManager(root, keep_last=2) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step), metadata={"loss": 1.0 / step})
        m.wait()
        assert m.steps() == [2, 3]  # retention deleted step 1 through the store
        target = _state(0)
        assert m.restore(target) == 3
        _assert_equal(target, _state(3))
        assert m.restore(target, step=2) == 2
        _assert_equal(target, _state(2))
    storage = open_storage(root)
    assert layout.step_dirs(storage) == [2, 3]  # nothing of step 1 left, no leftovers
    files = storage.list_files(layout.step_dir(3))
    assert layout.MANIFEST in files and layout.IN_PROGRESS not in files
    assert not list(catalog.verify(storage, 3))
    loaded = ckpt.load(root, keys=["model"])
    _assert_equal(loaded["model"], _state(3)["model"])
    assert lease.live_holder(storage) is None  # released at close
    # keys in the environment name their source: tensorstore's default chain would print errors about ~/.aws/config
    assert ".aws/config" not in capfd.readouterr().err


def test_storage_options_configure_a_root_without_any_aws_variable(s3_server, s3_bucket, monkeypatch):
    _without_aws_env(monkeypatch)
    from seaweed import ACCESS_KEY, SECRET_KEY

    options = {
        "endpoint": s3_server.endpoint,
        "region": "us-east-1",
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY,
        "timeout": 10,
    }
    root = f"s3://{s3_bucket}/explicit"
    with ckpt.CheckpointManager(root, storage_options=options) as m:
        m.save(5, _state(5)).wait()
    _assert_equal(ckpt.load(root, storage_options=options), _state(5))


def test_the_spec_takes_options_first_then_the_standard_variables(monkeypatch):
    _without_aws_env(monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    spec = kvstore_spec("s3://bucket/some/path")
    assert (spec["bucket"], spec["path"], spec["endpoint"], spec["aws_region"]) == (
        "bucket",
        "some/path/",
        "http://s3-only:2",
        "eu-west-3",
    )
    assert spec["aws_credentials"] == {"type": "default"}
    monkeypatch.setenv("AWS_PROFILE", "team")
    assert kvstore_spec("s3://bucket")["aws_credentials"] == {"type": "profile", "profile": "team"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert kvstore_spec("s3://bucket")["aws_credentials"] == {"type": "environment"}
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    spec = kvstore_spec("s3://bucket", {"endpoint": "https://explicit:3", "region": "us-west-2", "anonymous": "true"})
    assert (spec["endpoint"], spec["aws_region"], spec["aws_credentials"]) == (
        "https://explicit:3",
        "us-west-2",
        {"type": "anonymous"},
    )
    assert kvstore_spec("s3://bucket", {"profile": "p"})["aws_credentials"] == {"type": "profile", "profile": "p"}
    # every wait is bounded: tensorstore's default (32 retries, up to 32 s apart) would retry for many minutes, and
    # each attempt at a store that stopped answering costs a whole stall: 3 attempts, their backoff in half the timeout
    retries = kvstore_spec("s3://bucket", {"timeout": 4})["s3_request_retries"]
    assert retries == {"max_retries": 2, "initial_delay": "0.4s", "max_delay": "1s"}
    assert "gcs_request_retries" in kvstore_spec("gs://bucket/p")
    for spec in (
        kvstore_spec("gs://bucket/p"),
        kvstore_spec("s3://bucket", {"host_header": "h", "requester_pays": "1"}),
    ):
        ts.KvStore.Spec(spec)  # tensorstore takes every spec built here


def test_the_first_object_store_root_sets_curl_stall_limits_from_its_timeout_for_its_open_only(monkeypatch):
    """tensorstore reads its curl settings once, when its first HTTP kvstore opens: the first root's timeout (whole
    seconds) becomes the stall and connect limits, unless the user set them; the environment is given back after."""
    from ckpt.storage import spec as spec_mod

    names = ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS")
    names += ("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES",)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", "7")  # the user's own
    monkeypatch.setattr(spec_mod, "_curl_made", [])  # as in a process that opened no object-store root yet
    with spec_mod.curl_timeouts("memory", 2.5):  # no HTTP: nothing set, and the first S3 root still to come
        assert "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS" not in os.environ
    with spec_mod.curl_timeouts("s3", 2.5):
        assert [os.environ.get(n) for n in names] == ["3", "7", "1"]
    assert [os.environ.get(n) for n in names] == [None, "7", None]  # children get the environment as it was
    with spec_mod.curl_timeouts("s3", 60):  # the transport is made: a later root changes nothing
        assert "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS" not in os.environ


@pytest.mark.parametrize(
    "options, message",
    [
        ({"endpiont": "http://x"}, "unknown storage option(s) endpiont"),
        ({"timeout": "soon"}, "timeout must be a number"),
        ({"timeout": 0}, "timeout must be positive"),
        ({"access_key_id": "k"}, "go together"),
        ({"endpoint": "127.0.0.1:9000"}, "http:// or https://"),
    ],
)
def test_bad_storage_options_are_named(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kvstore_spec("s3://bucket/x", options)


def test_s3_only_options_are_refused_for_other_stores():
    with pytest.raises(ValueError, match="apply to s3:// roots only"):
        kvstore_spec("gs://bucket/x", {"endpoint": "http://x"})


def _fails_fast(call):
    t0 = time.monotonic()
    with pytest.raises(ckpt.StorageError) as info:
        call()
    assert time.monotonic() - t0 < HANG_S, "a failure must come within the configured timeout, not hang"
    return info.value


def test_an_unreachable_endpoint_fails_fast_naming_the_endpoint(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    root = f"s3://{s3_bucket}/x"
    err = _fails_fast(lambda: ckpt.CheckpointManager(root, storage_options={"timeout": 2}))
    assert err.endpoint == "http://127.0.0.1:9" and err.bucket == s3_bucket
    assert "http://127.0.0.1:9" in str(err) and "cannot be reached" in str(err) and root in str(err)
    err = _fails_fast(lambda: ckpt.load(root, storage_options={"timeout": 2}))
    assert "cannot be reached" in str(err)


def test_bad_credentials_fail_fast_saying_to_check_them(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    err = _fails_fast(lambda: open_storage(f"s3://{s3_bucket}/x", {"timeout": 2}))
    assert "refused the credentials" in str(err) and "AWS_SECRET_ACCESS_KEY" in str(err)


def test_an_access_key_without_its_secret_is_refused_naming_the_missing_variable(s3_bucket, monkeypatch, capfd):
    """AWS_ACCESS_KEY_ID alone (a secret not exported): the default chain went on to ~/.aws and instance metadata,
    printed their errors, then sent unsigned requests, and the store's refusal read as wrong credentials. botocore
    refuses it (PartialCredentialsError); so does the root, before any request, naming the missing variable."""
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    missing = "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"
    with pytest.raises(ValueError, match=missing):
        kvstore_spec(f"s3://{s3_bucket}/x")
    assert cli.main(["ls", f"s3://{s3_bucket}/x", "--timeout", "2"]) == 1
    err = capfd.readouterr().err
    assert missing in err and "refused" not in err, err
    from seaweed import ACCESS_KEY, SECRET_KEY

    options = {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}  # given keys need no variable
    assert open_storage(f"s3://{s3_bucket}/x", options).list_dirs() == []
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)  # a secret alone is passed over, as botocore does
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.setenv("AWS_PROFILE", "team")
    assert kvstore_spec(f"s3://{s3_bucket}/x")["aws_credentials"] == {"type": "profile", "profile": "team"}


def test_a_missing_bucket_fails_when_the_root_is_opened_naming_the_bucket(s3_bucket, capsys):
    root = f"s3://{s3_bucket}-missing/x"
    err = _fails_fast(lambda: ckpt.CheckpointManager(root, storage_options={"timeout": 2}))
    assert err.bucket == f"{s3_bucket}-missing" and f"bucket '{s3_bucket}-missing' does not exist" in str(err)
    assert cli.main(["ls", root]) == 1  # not "no checkpoints": the bucket is not there
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("path, segment", [("x//y", "an empty"), ("x/./y", "a '.'"), ("x/../y", "a '..'")])
def test_a_root_path_with_an_empty_or_dot_segment_is_refused_before_any_request(s3_bucket, capsys, path, segment):
    """SeaweedFS stores x//y/k as x/y/k and lists nothing under x//y/: every save there succeeded and no step was
    ever seen (steps() [], restore None: a resumed run started afresh); curl resolves '..' after signing (a
    'refused the credentials' error). Such a root is refused, naming the segment, by the manager, load and the CLI."""
    root = f"s3://{s3_bucket}/{path}"
    for call in (lambda: ckpt.CheckpointManager(root), lambda: ckpt.load(root)):
        with pytest.raises(ValueError, match=f"may not have {segment} segment"):
            call()
    assert cli.main(["ls", root]) == 1 and "may not have" in capsys.readouterr().err
    with ckpt.CheckpointManager(f"s3://{s3_bucket}//x/y/") as m:  # slashes around the path are no segment: x/y
        m.save(1, _state(1))
        m.wait()
    assert ckpt.load(f"s3://{s3_bucket}/x/y", keys=["opt"])["opt"]["step"] == 1


@pytest.mark.parametrize(
    "root, meant",
    [("s3:bkt/run", "s3://bkt/run"), ("gs:/bkt/run", "gs://bkt/run"), ("memory:x", "memory://x"), ("file:ck", "ck")],
)
def test_a_url_missing_its_slashes_is_refused_not_taken_for_a_directory(tmp_path, monkeypatch, capsys, root, meant):
    """`s3:bkt/run` (no '//') was the directory 's3:bkt/run' under the working directory: every save landed there
    and the bucket never saw one. The one parser of roots refuses it, saying what was meant, for the manager, load,
    the CLI and ettr's ledger (the same storage stack); './s3:bkt/run' still names that directory."""
    from ettr import GoodputTracker, attribute_root

    monkeypatch.chdir(tmp_path)
    message = f"{root!r} looks like a URL missing its '//': did you mean {meant!r}?"
    calls = (
        lambda: ckpt.CheckpointManager(root),
        lambda: ckpt.load(root),
        lambda: GoodputTracker(root),
        lambda: attribute_root(root),
    )
    for call in calls:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    assert cli.main(["ls", root]) == 1 and message in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # nothing made under the working directory
    with ckpt.CheckpointManager(f"./{root}") as m:  # a directory of that name, asked for as one
        m.save(1, _state(1))
    assert (tmp_path / root / layout.step_dir(1)).is_dir()


@pytest.mark.parametrize(
    "root, meant", [("S3://bkt/run", "s3://bkt/run"), ("s3a://bkt/run", "s3://bkt/run"), ("GS://b/r", "gs://b/r")]
)
def test_a_scheme_tensorstore_opens_under_another_spelling_names_the_one_meant(capsys, root, meant):
    """Hadoop's s3a:// and an upper-case S3:// failed with tensorstore's 'unsupported URL scheme', naming no fix."""
    message = f"did you mean {meant!r}?"
    with pytest.raises(ValueError, match=re.escape(message)):
        ckpt.CheckpointManager(root)
    assert cli.main(["ls", root]) == 1 and message in capsys.readouterr().err


def _s3_bytes_read() -> int:
    """Bytes this process has read from S3 so far (tensorstore's own counter)."""
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/bytes_read")
    return sum(v.get("value", 0) for m in found for v in m.get("values", []))


def _cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ckpt_commands_work_on_an_s3_root_from_the_variables_or_from_options(
    s3_server, s3_bucket, capsys, monkeypatch, tmp_path
):
    from ckpt import RandomWindowSampler

    sampler = RandomWindowSampler(10_000, 16, 8, global_batch_size=4, seed=3, rank=0, world_size=1)
    it = iter(sampler)
    for _ in range(5):
        next(it)
    root = f"s3://{s3_bucket}/cli"
    with ckpt.CheckpointManager(root) as m:
        m.save(5, {"data": {"sampler": sampler}, **_state(5)}).wait()
    storage = open_storage(root)
    storage.write_atomic(f"{layout.step_dir(9)}/arrays/x/c/0", b"half a save")  # a crashed save's leftover

    read_before = _s3_bytes_read()
    code, out, err = _cli(capsys, "ls", root)
    assert code == 0, err
    assert _s3_bytes_read() - read_before < 64 * 33 * 4, "ls downloaded the tensors to size them"
    assert "8.5 KiB" in out  # the committed step's tensors, from its manifest
    assert "committed" in out and "incomplete" in out and " 5 " in f" {out} " and " 9 " in f" {out} "
    code, out, err = _cli(capsys, "inspect", root)
    assert code == 0 and "model" in out and "float32" in out, err
    code, out, err = _cli(capsys, "verify", root, "-q")
    assert code == 0, err
    code, out, err = _cli(capsys, "explain", root, "--step", "7")
    assert code == 0 and sampler.explain(7).batch_hash in out, err

    from seaweed import ACCESS_KEY, SECRET_KEY

    _without_aws_env(monkeypatch)  # the same through command-line options
    opts = ["--endpoint", s3_server.endpoint, "--region", "us-east-1", "--timeout", "10"]
    opts += ["--storage-option", f"access_key_id={ACCESS_KEY}", "--storage-option", f"secret_access_key={SECRET_KEY}"]
    code, out, err = _cli(capsys, "gc", root, *opts)
    assert code == 0 and "removed incomplete step 9" in out, err
    options = {"endpoint": s3_server.endpoint, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}
    assert layout.step_dirs(open_storage(root, options)) == [5]
    code, out, err = _cli(capsys, "ls", root, *opts)
    assert code == 0 and "incomplete" not in out and "committed" in out, err
    code, out, err = _cli(capsys, "export", root, "--format", "torch", "-o", str(tmp_path / "w.pt"), "-q", *opts)
    assert code == 0, err
    exported = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(exported["w"], _state(5)["model"]["w"]) and torch.equal(exported["b"], _state(5)["model"]["b"])

    code, out, err = _cli(capsys, "ls", root, "--endpoint", "http://127.0.0.1:9", "--timeout", "1")
    assert code == 1 and "cannot be reached" in err and "http://127.0.0.1:9" in err
    code, out, err = _cli(capsys, "ls", root, "--storage-option", "nonsense=1")
    assert code == 1 and "unknown storage option" in err


def _second_step_damaged(root: str):
    """Steps 1 and 2 saved to `root`, then a byte of step 2's pack flipped (the small tensors' pack), as a torn or
    bit-flipped object would read: (the root's storage, the damaged object's path)."""
    with ckpt.CheckpointManager(root) as m:
        m.save(1, _state(1))
        m.save(2, _state(2))
    storage = open_storage(root)
    pack = pack_path(storage, 2, layout.pack_name(0))
    path = next(f"{pack}/{f}" for f in storage.list_files(pack) if f.startswith("c/"))
    data = bytearray(storage.read(path))
    data[100] ^= 0xFF
    storage.write_atomic(path, bytes(data))
    return storage, path


def _restored_from_step_1(root: str, **options):
    """Restore `root` into a fresh state: it must fall back to step 1 (step 2 damaged), bitwise, with a warning.
    (the committed steps then, the warnings' messages)."""
    with ckpt.CheckpointManager(root, **options) as m:
        target = _state(0)
        with pytest.warns(RuntimeWarning) as warned:
            assert m.restore(target) == 1
        _assert_equal(target, _state(1))
        return m.steps(), [str(w.message) for w in warned]


def test_gc_beside_a_live_writer_of_an_s3_root_names_the_incomplete_steps_it_keeps_and_why(s3_bucket, capsys):
    """A dead writer's leftover beside the live writer of an object store: gc rightly removed nothing, and said
    "nothing to remove" while `ls` listed the step incomplete. It names the step, the root and its writer."""
    root = f"s3://{s3_bucket}/kept"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, _state(1)).wait()
        kv = ts.KvStore.open(kvstore_spec(root)).result()  # a writer killed mid-save, its lease since taken over
        kv.write("step_00000009/_IN_PROGRESS", b'{"pid": 1, "host": "gone", "time": 1, "lease": "dead"}').result()
        kv.write("step_00000009/w-dead/packs/rank_00000/c/0", b"half").result()
        for dry in ([], ["--dry-run"]):
            assert cli.main(["gc", *dry, root]) == 0
            out = capsys.readouterr().out
            assert "nothing to remove" not in out, out
            assert f"kept incomplete step 9: {root}/ is being written by a writer: pid {os.getpid()}" in out, out
        assert [e.step for e in catalog.entries(m.storage) if not e.committed] == [9]
    assert cli.main(["gc", root]) == 0  # the writer is gone: the leftover goes
    assert capsys.readouterr().out == "removed incomplete step 9\n"
    assert layout.step_dirs(open_storage(root)) == [1]


def test_a_damaged_object_is_detected_named_set_aside_and_the_previous_step_restored(s3_bucket, capsys):
    root = f"s3://{s3_bucket}/damaged"
    storage, path = _second_step_damaged(root)

    assert cli.main(["verify", root, "--step", "2", "-q"]) == 1
    assert f"{root}/{path}" in capsys.readouterr().out
    steps, warned = _restored_from_step_1(root)
    assert any("step 2 is damaged" in w for w in warned) and steps == [1]
    assert [q.step for q in catalog.quarantined(storage)] == [2]  # moved aside through the store, for inspection


def test_a_damaged_step_holding_stray_objects_is_still_set_aside_and_the_previous_step_restored(s3_bucket, caplog):
    """An object no checkpoint writes (`.DS_Store`, a note with spaces) in a damaged step: its quarantine copied it
    as an 'unsafe array path' and failed, and with it the restore (CorruptCheckpointError, no fallback). It moves
    with the rest now; a key no request can address as written (an empty, '.' or '..' segment) is left out, named."""
    root = f"s3://{s3_bucket}/stray"
    storage, path = _second_step_damaged(root)
    kv = ts.KvStore.open(kvstore_spec(root)).result()  # objects put by hand, as `aws s3 cp` or a Finder would
    for stray in ("step_00000002/.DS_Store", "step_00000002/zz notes (1).txt"):
        kv.write(stray, b"not a checkpoint file").result()

    steps, warned = _restored_from_step_1(root)
    assert any(re.search("step 2 is damaged.*quarantined to", w) for w in warned) and steps == [1]
    (moved,) = catalog.quarantined(storage)
    assert moved.step == 2 and {".DS_Store", "zz notes (1).txt"} <= set(storage.list_files(moved.path))

    memory = open_storage("memory://stray-dots")  # S3 servers refuse such keys (SeaweedFS); AWS and GCS hold them
    kv = ts.KvStore.open(memory.kvstore_spec(""), context=spec_context()).result()  # the store's own context
    for key in ("src/a", "src/b/../../a", "src/.DS_Store"):
        kv.write(key, b"x").result()
    memory.move_tree("src", "dst")
    assert memory.list_files("dst") == [".DS_Store", "a"] and memory.list_files("src") == []
    assert "src/b/../../a is not copied" in caplog.text


def test_a_quarantine_whose_delete_is_cut_short_leaves_no_committed_step_and_the_step_is_saved_again(s3_bucket):
    """An object store has no rename: a quarantine copies the damaged step aside, then deletes it. Its delete cut short
    (the store gone at that moment) left the step committed, damaged as before, and the resumed run's save of that
    step failed ("step 2 is already committed"). The manifest goes first now: what is left is an uncommitted leftover
    that the next save of the step does not mind and gc removes, beside a whole copy in the quarantine."""
    root = f"s3://{s3_bucket}/cut-short"
    storage, _ = _second_step_damaged(root)
    step_files = set(storage.list_files(layout.step_dir(2)))
    with ckpt.CheckpointManager(root) as m:
        delete_tree = m.storage.delete_tree

        def store_gone_during_the_delete(path: str) -> None:  # fault injection on the real store
            if path == layout.step_dir(2):
                raise OSError("the store went away in the middle of the delete")
            delete_tree(path)

        m.storage.delete_tree = store_gone_during_the_delete
        target = _state(0)
        with pytest.warns(RuntimeWarning, match="step 2 is damaged"):
            assert m.restore(target) == 1
        m.storage.delete_tree = delete_tree
        assert layout.committed_steps(storage) == [1]
        (moved,) = catalog.quarantined(storage)
        assert set(storage.list_files(moved.path)) == step_files  # a whole copy (no _DAMAGED: the move failed)
        m.save(2, _state(2)).wait()  # the resumed run saves step 2 again
    assert cli.main(["gc", root]) == 0  # the cut-short leftover: the old data directory of step 2
    with ckpt.CheckpointManager(root) as m:
        target = _state(0)
        assert m.restore(target) == 2
    _assert_equal(target, _state(2))
    assert not list(catalog.verify(storage, 2))


def test_a_damaged_step_that_cannot_be_set_aside_is_named_and_the_previous_step_restored(s3_bucket, caplog):
    """A reader whose credentials may not write (an evaluation job's): the quarantine of a damaged step is refused by
    the store (a `StorageError`, no OSError). The restore used to fail with it; it falls back to the previous step and
    says which step is damaged, in which file, and why it stayed in place."""
    from seaweed import READ_ONLY_KEY, READ_ONLY_SECRET

    root = f"s3://{s3_bucket}/read-only"
    storage, path = _second_step_damaged(root)

    options = {"access_key_id": READ_ONLY_KEY, "secret_access_key": READ_ONLY_SECRET, "timeout": 5}
    _, warned = _restored_from_step_1(root, storage_options=options)
    (message,) = [w for w in warned if "is damaged" in w]
    assert "step 2 is damaged" in message and f"{root}/{path}" in message  # the step and the damaged file
    assert "could not be quarantined" in message and "refused the credentials" in message  # why it stayed
    assert "falling back to the previous committed step" in message
    assert "could not quarantine damaged step 2" in caplog.text
    assert layout.committed_steps(storage) == [1, 2] and not catalog.quarantined(storage)  # nothing moved


def test_a_second_writer_of_an_s3_root_is_refused_saying_when_the_lease_frees_the_root(s3_bucket):
    """The refusal named the holder alone: a job restarted on another node after its writer was SIGKILLed read that a
    writer (a pid long dead) held the root, with nothing saying that the lease ends by itself, nor when."""
    root = f"s3://{s3_bucket}/two"
    with ckpt.CheckpointManager(root, lease_ttl=40) as first:
        first.save(1, _state(1))
        first.wait()
        second = ckpt.CheckpointManager(root, lease_ttl=40)
        with pytest.raises(ckpt.LeaseHeldError) as info:
            second.save(1, _state(2))
        message = str(info.value)
        assert f"pid {os.getpid()}" in message and "a holder that died frees the root then" in message
        left = int(message.split("its lease expires at ")[1].split("(in ")[1].split(" s)")[0])
        assert 0 < left <= 40
        second.close()
    target = _state(0)
    with ckpt.CheckpointManager(root) as reader:
        assert reader.restore(target) == 1
    _assert_equal(target, _state(1))  # the refused writer committed nothing over the first one's step
