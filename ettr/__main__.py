"""Entry point for `python -m ettr`."""

import sys

from .cli import main

sys.exit(main())
