"""Suite-wide plugins: `require_extras` (CKPT_REQUIRE_EXTRAS=1 turns a skip for a missing optional framework into a
failure), and the S3 server's fixtures."""

import itertools
import multiprocessing

import pytest

pytest_plugins = ["require_extras"]
_BUCKETS = itertools.count()


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
