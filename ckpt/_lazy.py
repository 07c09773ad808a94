"""Heavy modules bound at import time but loaded at their first use: ``from ._lazy import torch`` in a module whose
torch-free functions the CLI calls (`store.verify_array`) keeps ``ckpt ls|inspect|gc|verify`` from importing torch,
numpy or tensorstore (~1 s of a call that otherwise reads a few JSON files and checksums bytes)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """A stand-in for the module `name`: the first attribute read imports it; every read is the module's own."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{' (loaded)' if self._module is not None else ''}>"


numpy = LazyModule("numpy")
tensorstore = LazyModule("tensorstore")
torch = LazyModule("torch")
