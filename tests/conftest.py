"""Suite-wide plugins: `require_extras` (CKPT_REQUIRE_EXTRAS=1 turns a skip for a missing optional framework into a
failure), and the S3 server's fixtures."""

import itertools
import multiprocessing

import pytest

pytest_plugins = ["require_extras"]
_BUCKETS = itertools.count()

# The files that take longest, longest first (their seconds in a `--durations=0` run on 2 cores: 150, 127, 96, ...).
# Two workers each run whole files (`--dist loadfile`), handed out in collection order; xdist's default order (most
# tests first) left the few-test, long end-to-end files for last, and one worker ran them while the other had
# nothing left. Long files first, short ones filling the gaps: ~20 s less wall time. Only the order changes.
LONGEST_FIRST = (
    "test_cluster.py", "test_docs.py", "test_hf.py", "test_demo.py", "test_lightning.py", "test_loop.py",
    "test_determinism_e2e.py", "test_object_store_faults.py", "test_ckpt_crash.py", "test_distributed.py",
    "test_stale_writer.py", "test_ckpt_safety.py", "test_ckpt_roundtrip.py", "test_lightning_ddp.py", "test_hf_ddp.py",
    "test_ckpt_writers.py", "test_tiers_distributed.py", "test_ettr_e2e.py", "test_shared_manifest.py",
)  # fmt: skip


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist: hand files out in the order collection leaves them
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The files of LONGEST_FIRST first, in its order; every other file after them, as collected (a stable sort:
    each file's tests stay together and in their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (SeaweedFS) for the whole session, on free ports in a temp dir; torn down afterwards."""
    from seaweed import SeaweedServer

    server = SeaweedServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, request):
    """A fresh bucket on the session's S3 server, with the standard AWS variables pointing at it."""
    import re

    name = "t-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + f"-{next(_BUCKETS)}"
    s3_server.make_bucket(name)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return name


@pytest.fixture
def no_child_left():
    """Whatever a test did or failed, no child process of `multiprocessing` outlives it (a `hold` child of the
    writer tests sleeps 600 s)."""
    yield
    for p in multiprocessing.active_children():
        p.kill()
        p.join(30)
