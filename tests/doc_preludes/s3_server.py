"""A real S3 server (SeaweedFS) for docs/object_stores.md, started once per doc run, with a bucket `checkpoints` and
the standard AWS variables pointing at it (so the doc's commands see them too); stopped when the run ends."""

import atexit
import os

if "CKPT_DOC_S3_ENDPOINT" not in os.environ:
    from seaweed import SeaweedServer  # tests/ is on sys.path: doc_blocks.py runs from there

    _server = SeaweedServer()
    _server.start()
    atexit.register(_server.close)
    _server.make_bucket("checkpoints")
    os.environ.update(_server.env())
    os.environ["CKPT_DOC_S3_ENDPOINT"] = _server.endpoint
