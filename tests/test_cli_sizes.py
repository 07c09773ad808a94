"""One number per quantity in the CLI: `ls` labels its two sizes (`on disk`: the step's files; `tensors`: the bytes of
the tensors its manifest lists), and `inspect` and `verify` say that theirs is the tensors' bytes, the same figure."""

from __future__ import annotations

import os
import re

import torch

import ckpt
from ckpt import cli


def _out(capsys, *argv: str) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def _du(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_each_size_says_what_it_measures(tmp_path, capsys):
    root = tmp_path / "root"
    state = {"w": torch.randn(64, 48), "b": torch.randn(48), "step": 1}  # 12,480 bytes of float32
    with ckpt.CheckpointManager(root) as m:
        m.save(1, state).wait()
    (root / "step_00000002").mkdir()  # a crashed save's leftover: files, no tensors
    tensors = cli._human(64 * 48 * 4 + 48 * 4)

    ls = _out(capsys, "ls", str(root)).splitlines()
    assert re.fullmatch(r" +step  state +on disk +tensors  time", ls[0]), ls[0]
    step1 = re.fullmatch(r" +1  committed +(\S+ \S+) +(\S+ \S+)  \S+ \S+", ls[1])
    assert step1 and step1.groups() == (cli._human(_du(root / "step_00000001")), tensors), ls[1]
    assert step1.group(1) != step1.group(2)  # padding, checksums, zarr.json and the manifest are on disk too
    assert re.fullmatch(r" +2  incomplete +0 B +-  ", ls[2]), ls[2]

    assert f"arrays (2 placed in 1 pack), {tensors} of tensors" in _out(capsys, "inspect", str(root))
    assert _out(capsys, "verify", "-q", str(root)) == f"step 1: ok ({tensors} of tensors checked)\n"


def test_a_root_without_cheap_sizes_shows_no_disk_size_rather_than_another_number(capsys):
    root = "memory://cli-sizes"
    with ckpt.CheckpointManager(root) as m:
        m.save(3, {"w": torch.zeros(1000)}).wait()
    ls = _out(capsys, "ls", root).splitlines()
    assert re.fullmatch(r" +3  committed +- +3\.9 KiB  \S+ \S+", ls[1]), ls


def test_ls_sizes_a_step_whose_files_vanish_or_dangle(tmp_path, capsys):
    """`ls` failed with FileNotFoundError on a file gone between listing and sizing (beside a live writer whose
    retention deletes steps: 27 of 5,714 runs) and on a dangling link in a step; such a file is not followed."""
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, {"w": torch.zeros(4)}).wait()
    os.symlink(tmp_path / "gone", root / "step_00000001" / "dangling")
    (root / "step_00000002").mkdir()
    os.symlink(tmp_path / "gone", root / "step_00000002" / "dangling")
    ls = _out(capsys, "ls", str(root)).splitlines()
    assert re.fullmatch(r" +1  committed .*", ls[1]) and re.fullmatch(r" +2  incomplete .*", ls[2]), ls
