"""A token file for the examples that read one: tokens.bin, 65,536 uint16 byte-level tokens."""

import numpy as np

np.random.default_rng(0).integers(0, 256, 65_536, dtype=np.uint16).tofile("tokens.bin")
