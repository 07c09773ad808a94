"""`ckpt ls|inspect|gc|rollback|verify` read JSON and bytes: in a fresh interpreter they import neither torch nor
numpy (nor tensorstore, which imports numpy), through either entry point (`python -m ckpt`, the `ckpt` console script), on a
real root a CheckpointManager wrote (a training state: model, optimizer, RNG, sampler; packed and chunked arrays)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt
import ckpt.cli
import ckpt.exporter

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "tensorstore")

# the child runs one command as the entry point would, then reports what it imported (after the command's output)
CHILD = """
import json, runpy, sys
entry, argv = sys.argv[1], sys.argv[2:]
sys.argv = ["ckpt", *argv]
try:
    if entry == "-m":
        runpy.run_module("ckpt", run_name="__main__", alter_sys=True)
    else:  # the console script: pyproject's [project.scripts] ckpt = "ckpt.cli:run"
        from ckpt.cli import run
        run()
except SystemExit as e:
    code = e.code
print("MODULES " + json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Two committed steps of a small training state."""
    root = tmp_path_factory.mktemp("cli") / "root"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = ckpt.ShuffledSampler(100, global_batch_size=10, seed=0)
    state = {"model": model, "optim": optim, "rng": ckpt.RNGState(), "sampler": sampler, "note": "x"}
    with ckpt.CheckpointManager(root) as m:
        for step in (1, 2):
            model(torch.randn(3, 64)).sum().backward()
            optim.step()
            sampler.advance()
            m.save(step, state).wait()
    return root


def _run(entry: str, argv: list[str]) -> tuple[int, str, list[str]]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, entry, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    out, _, report = proc.stdout.rpartition("MODULES ")
    assert report, (proc.stdout, proc.stderr)
    result = json.loads(report)
    return result["code"], out, result["heavy"]


@pytest.mark.parametrize("entry", ["-m", "script"])
@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["inspect"],
        ["inspect", "--step", "1"],
        ["inspect", "--json"],
        ["verify"],
        ["verify", "-q", "--step", "2"],
        ["gc", "--dry-run"],
        ["gc"],
        ["rollback", "--to", "1", "--dry-run"],
    ],
    ids=" ".join,
)
def test_reading_a_root_imports_neither_torch_nor_numpy(root, entry, command):
    if command[0] == "gc":
        (root / "step_00000003").mkdir(exist_ok=True)  # a save that died before its first file
    code, out, heavy = _run(entry, [command[0], str(root), *command[1:]])
    assert code == 0, out
    assert heavy == [], f"`ckpt {' '.join(command)}` imported {heavy}"
    expected = {
        "ls": "committed",
        "inspect": "model",
        "verify": "ok",
        "gc": "incomplete step 3",
        "rollback": "would remove committed step 2",
    }[command[0]]
    assert expected in out, out


def test_commands_that_need_tensors_still_load_them(root, tmp_path):
    code, out, heavy = _run("-m", ["export", str(root), "--format", "safetensors", "-o", str(tmp_path / "w"), "-q"])
    assert code == 0 and "exported step 2" in out and "torch" in heavy, out


def test_the_package_root_keeps_its_public_api():
    """`import ckpt` stays torch-free and every public name loads from it; --help lists the exporter's formats."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ckpt; print('torch' in sys.modules); ckpt.CheckpointManager; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert proc.stdout.split() == ["False", "True"], proc.stderr
    assert all(getattr(ckpt, name) is not None for name in ckpt.__all__)
    assert ckpt.cli.EXPORT_FORMATS == ckpt.exporter.FORMATS


def test_the_dtype_sizes_a_reader_uses_are_numpys():
    from ckpt import format as fmt

    assert {n: fmt.dtype_itemsize(n) for n in fmt._DTYPE_NAMES} == {
        n: fmt.numpy_dtype(n).itemsize for n in fmt._DTYPE_NAMES
    }
