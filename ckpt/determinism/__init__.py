"""Deterministic restart: every RNG captured (`rng`), data order as a pure function of a sample counter (`data`),
built on keyed permutations (`permutation`) and derived seeds (`seeding`). Nothing here writes checkpoints."""
