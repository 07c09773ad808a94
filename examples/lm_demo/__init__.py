"""The main demo: a byte-level causal LM on the Python standard library's source, crashed and resumed under torchrun."""
