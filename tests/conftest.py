"""Suite-wide plugins: `require_extras` (CKPT_REQUIRE_EXTRAS=1 turns a skip for a missing optional framework into a
failure), the order of the files, and the S3 server's fixtures."""

import itertools
import multiprocessing

import pytest

pytest_plugins = ["require_extras"]
_BUCKETS = itertools.count()

# The files that take longest (15-110 s each with two workers), longest first: scripts/test.sh's two workers take
# whole files in collection order, so these start first and the workers end together, not one after the other.
_SLOWEST = (
    "test_cluster.py", "test_docs.py", "test_determinism_e2e.py", "test_lightning.py", "test_demo.py",
    "test_distributed.py", "test_hf.py", "test_loop.py", "test_stale_writer.py", "test_ckpt_crash.py",
    "test_object_store_faults.py", "test_ckpt_safety.py", "test_ckpt_roundtrip.py", "test_ettr_report.py",
    "test_tiers_distributed.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first, each file's tests still together and in their order."""
    first = {name: i for i, name in enumerate(_SLOWEST)}
    items.sort(key=lambda item: first.get(item.path.name, len(_SLOWEST)))


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
