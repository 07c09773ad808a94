"""Entry point of `python -m ckpt`."""

from .cli import main

raise SystemExit(main())
