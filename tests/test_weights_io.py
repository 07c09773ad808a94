"""Weights in and out: `ckpt.load` reads only what it is asked for; export to safetensors / torch / hf and import
from torch.save / DCP / safetensors / HF folders round-trip bitwise, tied weights included; the CLI fails in one
line; no code from an imported checkpoint runs."""

import json
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import cli
from ckpt.errors import CorruptCheckpointError
from ckpt.layout import read_manifest
from ckpt.storage import open_storage
from step_paths import data_dir


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and _bits(a[k]) == _bits(b[k]), k


class Tied(torch.nn.Module):
    """A tiny LM whose output layer shares the input embedding (as GPT-2 with tie_word_embeddings), and buffers of
    other dtypes."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(50, 8)
        self.norm = torch.nn.LayerNorm(8).to(torch.bfloat16)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("mask", torch.rand(5) > 0.5)


def _trained(seed: int = 0):
    model = Tied(seed)
    optim = torch.optim.AdamW(model.parameters())
    model.head(model.embed(torch.tensor([1, 2, 3]))).sum().backward()
    optim.step()
    return model, optim


def _io() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


# -- ckpt.load ------------------------------------------------------------------------------------------------


def test_load_reads_only_the_chunks_of_the_selected_tensor(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(12)},  # 1 MiB each
        "optim": {"big": torch.randn(1024, 1024, generator=g)},
    }
    with ckpt.CheckpointManager(tmp_path, chunk_bytes=256 << 10) as m:  # 4 chunks per layer, 16 for "big"
        m.save(1, state)
    ckpt.load(tmp_path, keys=["model.layer0.weight"])  # imports and caches warm
    want = state["model"]["layer5.weight"]
    before = _io()
    got = ckpt.load(tmp_path, keys=["model.layer5.weight"])
    read = _io() - before
    assert list(got) == ["model"] and list(got["model"]) == ["layer5.weight"]
    assert _bits(got["model"]["layer5.weight"]) == _bits(want)
    assert read <= 1.1 * want.numel() * 4, f"read {read} bytes for a tensor of {want.numel() * 4}"

    before = _io()  # a region: only the chunks that hold rows 256..384 (64 rows per chunk: chunks 4 and 5 of 16)
    part = ckpt.load(tmp_path, keys=["optim.big"], region=(slice(256, 384), slice(10, 20)))["optim"]["big"]
    read = _io() - before
    assert _bits(part) == _bits(state["optim"]["big"][256:384, 10:20])
    assert 2 * (256 << 10) <= read <= 1.1 * 2 * (256 << 10), read


def test_load_gives_plain_values_tied_weights_tied_and_names_a_missing_key(tmp_path):
    model, optim = _trained()
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(3, {"model": model, "optim": optim, "rng": ckpt.RNGState(), "meta": {"epoch": 2, "betas": (0.9, 0.99)}})
    full = ckpt.load(tmp_path)
    assert list(full) == ["model", "optim", "rng", "meta"] and full["meta"] == {"epoch": 2, "betas": (0.9, 0.99)}
    _same(dict(full["model"]), dict(model.state_dict()))
    assert full["model"]["embed.weight"].data_ptr() == full["model"]["head.weight"].data_ptr()
    moved = ckpt.load(tmp_path, keys=["model"], device="meta")["model"]  # device= moves after the verified read
    assert moved["embed.weight"].is_meta and moved["embed.weight"] is moved["head.weight"]
    saved = optim.state_dict()
    assert full["optim"]["param_groups"] == saved["param_groups"]
    _same(full["optim"]["state"][0], saved["state"][0])

    part = ckpt.load(tmp_path, keys=["optim.state.0.exp_avg", "meta.epoch"])
    assert part == {"optim": {"state": {0: part["optim"]["state"][0]}}, "meta": {"epoch": 2}}
    assert _bits(part["optim"]["state"][0]["exp_avg"]) == _bits(saved["state"][0]["exp_avg"])
    with pytest.raises(
        KeyError,
        match=r"'model.embed.bias' is not in checkpoint step 3: no 'embed.bias' under model \(it has \[.*'embed.weight'",
    ):
        ckpt.load(tmp_path, keys=["model.embed.bias"])
    with pytest.raises(ValueError, match="part of one tensor"):
        ckpt.load(tmp_path, keys=["model"], region=(slice(0, 1),))


def test_load_falls_back_from_a_damaged_newest_step_and_leaves_the_root_alone(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"w": torch.ones(64)})
        m.save(2, {"w": torch.full((64,), 2.0)})
    chunk = Path(data_dir(tmp_path, 2)) / "packs" / "rank_00000" / "c" / "0"  # w is small: packed, at offset 0
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=r"step 2 is damaged.*crc32c.*loading the previous"):
        assert torch.equal(ckpt.load(tmp_path)["w"], torch.ones(64))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step_00000001",
        "step_00000002",
    ]  # nothing moved
    with pytest.raises(CorruptCheckpointError, match=str(chunk)):
        ckpt.load(tmp_path, step=2)


# -- export ---------------------------------------------------------------------------------------------------


def test_export_safetensors_loads_bitwise_ties_as_hf_and_shards_with_an_index(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    model, optim = _trained()
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(5, {"model": model, "optim": optim})
    ckpt.export(tmp_path / "root", tmp_path / "st", format="safetensors")
    assert sorted(os.listdir(tmp_path / "st")) == ["model.safetensors"]
    got = load_file(tmp_path / "st" / "model.safetensors")
    expected = dict(model.state_dict())
    del expected["head.weight"]  # tied: stored once under its first name, the alias recorded
    _same(got, expected)
    with safe_open(tmp_path / "st" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "ckpt.ties": "1", "head.weight": "embed.weight"}
    fresh = Tied(seed=1)
    load_model(fresh, tmp_path / "st" / "model.safetensors")  # safetensors' own loader re-ties
    _same(dict(fresh.state_dict()), dict(model.state_dict()))

    ckpt.export(tmp_path / "root", tmp_path / "shards", format="safetensors", max_shard_size="1KB")
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # buffers, the embedding, the norm
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    merged = {}
    for name in files:
        merged.update(load_file(tmp_path / "shards" / name))
    _same({k: merged[k] for k in expected}, expected)


@pytest.mark.parametrize("kw", [{}, {"pack_bytes": 0}], ids=["placed", "array"])
def test_export_safetensors_streams_a_tensor_in_bands(tmp_path, monkeypatch, kw):
    from safetensors.torch import load_file

    from ckpt import exporter

    big = torch.randn(1000, 33).to(torch.float16)
    with ckpt.CheckpointManager(tmp_path / "root", chunk_bytes=8 << 10, **kw) as m:
        m.save(1, {"model": {"big": big, "scalar": torch.tensor(1.5, dtype=torch.float64)}})
    monkeypatch.setattr(exporter, "_BAND_BYTES", 16 << 10)  # bands of 2 chunks or segments, each read on its own
    info = read_manifest(open_storage(tmp_path / "root"), 1).arrays["model/big"]
    rows = 224 if kw else 248  # 2 chunks of 112 rows; 2 x the 124 whole rows of an 8 KiB segment
    assert [box[0] for box in exporter.bands(info)] == [(a, min(a + rows, 1000)) for a in range(0, 1000, rows)]
    ckpt.export(tmp_path / "root", tmp_path / "st", format="safetensors")
    _same(
        load_file(tmp_path / "st" / "model.safetensors"), {"big": big, "scalar": torch.tensor(1.5, dtype=torch.float64)}
    )


def test_export_torch_loads_with_weights_only_bitwise_with_ties(tmp_path):
    model, optim = _trained()
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(5, {"model": model, "optim": optim, "step": 5})
    ckpt.export(tmp_path / "root", tmp_path / "model.pt", format="torch")
    sd = torch.load(tmp_path / "model.pt", weights_only=True)
    _same(dict(sd), dict(model.state_dict()))
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    fresh = Tied(seed=1)
    fresh.load_state_dict(sd)
    _same(dict(fresh.state_dict()), dict(model.state_dict()))

    ckpt.export(tmp_path / "root", tmp_path / "all.pt", format="torch", keys=["model", "optim", "step"])
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert list(everything) == ["model", "optim", "step"] and everything["step"] == 5
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    fresh_optim.load_state_dict(everything["optim"])
    _same(fresh_optim.state_dict()["state"][0], optim.state_dict()["state"][0])


def test_export_hf_loads_with_from_pretrained_and_equal_logits(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from ckpt.exporter import model_config_metadata

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
    ).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(2, {"model": model}, metadata=model_config_metadata(model))
    ckpt.export(tmp_path / "root", tmp_path / "hf", format="hf")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is GPT2LMHeadModel and loaded.lm_head.weight is loaded.transformer.wte.weight
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert _bits(loaded(ids).logits) == _bits(model(ids).logits)

    with ckpt.CheckpointManager(tmp_path / "plain") as m:  # saved without the config: --config gives it
        m.save(2, {"model": model})
    with pytest.raises(ValueError, match="holds no model config.*--config"):
        ckpt.export(tmp_path / "plain", tmp_path / "hf2", format="hf")
    (tmp_path / "config.json").write_text(json.dumps(model_config_metadata(model)["hf_config"]))
    ckpt.export(tmp_path / "plain", tmp_path / "hf2", format="hf", config=tmp_path / "config.json", keys=["model"])
    with torch.no_grad():
        assert _bits(GPT2LMHeadModel.from_pretrained(tmp_path / "hf2")(ids).logits) == _bits(model(ids).logits)


def test_hf_trainer_steps_export_to_from_pretrained_without_flags(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from integrations.hf import CkptTrainer

    torch.manual_seed(0)
    ds = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (8, 8))]
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        save_steps=2,
        max_steps=2,
        disable_tqdm=True,
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=4,
    )
    CkptTrainer(model=model, args=args, train_dataset=ds).train()
    assert cli.main(["export", str(tmp_path / "out" / "ckpt"), "--format", "hf", "-o", str(tmp_path / "hf"), "-q"]) == 0
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert _bits(loaded(ids).logits) == _bits(model.eval()(ids).logits)


def test_cli_errors_are_one_line_and_leave_nothing(tmp_path, capsys):
    model, _ = _trained()
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": model, "epoch": 3})
    root, out = str(tmp_path / "root"), tmp_path / "out"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    cases = [
        (["--format", "onnx"], "unknown export format 'onnx' (choose from safetensors, torch, hf)"),
        (["--format", "safetensors", "--keys", "optim"], "key 'optim' is not in checkpoint step 1"),
        (["--format", "torch", "--keys", "model.embed.weight.x"], "no 'x' under model.embed.weight"),
        (["--format", "safetensors", "--max-shard-size", "lots"], "not a size: 'lots'"),
        (["--format", "safetensors", "--max-shard-size", "1.5"], "not a whole number of bytes: '1.5'"),
        (["--format", "safetensors", "--keys", "model,"], "hold an empty key"),  # exported the whole state
        (["--format", "safetensors", "--keys", "epoch"], "no tensor is under ['epoch'] in step 1"),  # an empty file
        # taken and ignored: one unsharded file, a folder without config.json
        (["--format", "torch", "--max-shard-size", "1GB"], "max_shard_size applies to formats safetensors and hf"),
        (["--format", "safetensors", "--config", root], "config applies to format hf (its config.json), not"),
    ]
    for extra, message in cases:
        assert cli.main(["export", root, "-o", str(out), *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert cli.main(["export", root, "--format", "safetensors", "-o", str(tmp_path / "full")]) == 1
    err = capsys.readouterr().err
    assert "already exists and is not empty" in err and err.count("\n") == 1
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["full", "root"]  # no output, no temporary left behind
    assert cli.main(["import", str(tmp_path / "nothing.pt"), root, "--step", "2"]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    export = [sys.executable, "-m", "ckpt", "export", root, "--format", "safetensors", "-q", "--keys", "model,epoch"]
    res = subprocess.run(
        [*export, "-o", str(out)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert res.returncode == 0 and res.stderr.startswith("warning: 1 values that are not tensors"), res.stderr
    assert res.stderr.count("\n") == 1, res.stderr  # not Python's file:line and source line


def test_export_to_a_missing_folder_is_an_error_naming_it_and_makes_no_folders(tmp_path, capsys):
    """`-o a/b/c` made a/ and a/b/ (a mkdir -p the docs never promised: a typo in a path became a tree), where
    `ettr plot -o` refused: now export refuses too, in one line naming the folder, and makes nothing."""
    model, _ = _trained()
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": model})
    root = str(tmp_path / "root")
    (tmp_path / "file").write_text("not a folder")
    for fmt in ("safetensors", "torch", "hf"):
        for out, parent, what in (
            (tmp_path / "a" / "b" / "c", tmp_path / "a" / "b", "no such folder"),
            (tmp_path / "file" / "c", tmp_path / "file", "not a folder"),
        ):
            assert cli.main(["export", root, "--format", fmt, "-o", str(out)]) == 1  # checked before the step is read
            err = capsys.readouterr().err
            assert err.startswith(f"error: {parent}: {what} (the parent of the output {out})"), err
            assert err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["file", "root"]
    assert cli.main(["export", root, "--format", "torch", "-o", str(tmp_path / "w.pt"), "-q"]) == 0  # a folder there


def test_export_into_the_checkpoint_root_is_refused(tmp_path, capsys):
    """`-o ROOT/step_00000009` exported fine and the next `ckpt gc` deleted it as an abandoned save: an output inside
    the root (through a symlinked path too) is refused in one line naming both, before anything is written."""
    model, _ = _trained()
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, {"model": model})
    (tmp_path / "link").symlink_to(root)
    for out in (root / "step_00000009", root / "exports", tmp_path / "link" / "exported"):
        assert cli.main(["export", str(root), "--format", "safetensors", "-o", str(out), "-q"]) == 1
        err = capsys.readouterr().err
        assert err == f"error: the output {out} is inside the checkpoint root {root}: export it outside the root\n"
        assert not os.path.lexists(out) and not [n for n in os.listdir(root) if n.startswith(".")]
    assert cli.main(["export", str(root), "--format", "safetensors", "-o", str(tmp_path / "out"), "-q"]) == 0


def test_export_beside_what_a_killed_export_with_the_same_pid_left(tmp_path):
    """The temporary output was `.OUT.tmp-<pid>`: a killed export leaves it, and a pid repeats (a container's
    process has the same one every run), so the next export failed 'File exists (writing OUT)' with no OUT there
    (safetensors), or deleted the other file and failed the same way (torch). Now each export has a name of its
    own and leaves what is not its own alone."""
    model, _ = _trained()
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": model})
    for fmt, out in (("safetensors", tmp_path / "st"), ("torch", tmp_path / "w.pt")):
        stale = tmp_path / f".{out.name}.tmp-{os.getpid()}"
        stale.mkdir() if fmt == "safetensors" else stale.write_bytes(b"a killed export's")
        assert ckpt.export(tmp_path / "root", out, format=fmt) == 1
        assert out.exists() and stale.exists()
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(loaded["embed.weight"], model.embed.weight)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f".st.tmp-{os.getpid()}", f".w.pt.tmp-{os.getpid()}", "root", "st", "w.pt"]
    )


def test_export_torch_into_an_empty_folder_says_it_is_a_folder(tmp_path, capsys):
    """`--format torch -o DIR` with DIR an empty folder said 'DIR already exists and is not empty': it is empty, and
    the user looks for what is in it. Now: it is a folder, torch writes one file, name it."""
    model, _ = _trained()
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": model})
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(tmp_path / "root"), "--format", "torch", "-o", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert "not empty" not in err and f"{tmp_path / 'empty'} is a folder: --format torch writes one file" in err, err
    assert err.count("\n") == 1 and os.listdir(tmp_path / "empty") == []


# -- import ---------------------------------------------------------------------------------------------------


def _restored(root, step: int, keys=None, seed: int = 1):
    model, optim = Tied(seed), None
    state = {"model": model}
    if keys is None:
        optim = torch.optim.AdamW(model.parameters())
        state["optim"] = optim
    with ckpt.CheckpointManager(root) as m:
        assert m.restore(state, keys=keys) == step
    return model, optim


def test_import_torch_save_then_restore_is_bitwise(tmp_path):
    model, optim = _trained()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "run.pt")
    assert cli.main(["import", str(tmp_path / "run.pt"), str(tmp_path / "root"), "--step", "100"]) == 0
    restored, restored_optim = _restored(tmp_path / "root", 100)
    _same(dict(restored.state_dict()), dict(model.state_dict()))
    assert restored.head.weight is restored.embed.weight
    _same(restored_optim.state_dict()["state"][0], optim.state_dict()["state"][0])
    assert restored_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]

    torch.save(model.state_dict(), tmp_path / "weights.pt")  # a bare state_dict goes under "model"
    assert ckpt.import_checkpoint(tmp_path / "weights.pt", tmp_path / "w", step=1) == "torch"
    _same(dict(_restored(tmp_path / "w", 1, keys=["model"])[0].state_dict()), dict(model.state_dict()))
    assert ckpt.CheckpointManager(tmp_path / "w").metadata(1)["imported_from"]["kind"] == "torch"
    with pytest.raises(ValueError, match=r"step must be a non-negative int below 2\*\*63, got '1'"):
        ckpt.import_checkpoint(tmp_path / "weights.pt", tmp_path / "bad", step="1")
    assert not (tmp_path / "bad").exists()  # refused before the root was touched: no lease left behind
    with pytest.raises(TypeError, match=r"top-level state keys must be str not starting with '\$', got '\$x'"):
        ckpt.import_checkpoint(tmp_path / "weights.pt", tmp_path / "bad", step=1, key="$x")
    assert not (tmp_path / "bad").exists()


def test_import_of_values_a_checkpoint_cannot_hold_names_the_source_and_leaves_the_root_untouched(tmp_path):
    """A torch.save file holding a sparse tensor or a None key failed inside the save: the error named the key but
    not the file, and a new root was left with a _LEASE file. Now the state is checked first: the error names the
    source and the key, and the root is not made."""
    for name, obj in (
        ("sparse", {"model": {"w": torch.ones(2).to_sparse()}}),
        ("nonekey", {"model": {None: torch.ones(2)}}),
    ):
        src = tmp_path / f"{name}.pt"
        torch.save(obj, src)
        with pytest.raises(TypeError) as err:
            ckpt.import_checkpoint(src, tmp_path / name, step=1)
        assert str(err.value).startswith(f"{src} cannot be imported: ") and "'model" in str(err.value), err.value
        assert not (tmp_path / name).exists()


def test_import_into_a_run_s_root_keeps_its_run_record(tmp_path, monkeypatch):
    """`python -m ckpt import SRC ROOT` recorded a new run in ROOT (a generated id, or the importing shell's
    SLURM_JOB_ID), so the requeue of the run that owns ROOT, with its own id, was refused at start with
    RunMismatchError. The import now adds its step to the run ROOT records."""
    from ckpt import run as run_mod

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, run_id="job-1") as m:
        m.save(1, {"model": {"w": torch.zeros(2)}}).wait()
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    monkeypatch.setenv("SLURM_JOB_ID", "shell-2")  # the shell the import runs in
    assert cli.main(["import", str(tmp_path / "w.pt"), str(root), "--step", "5"]) == 0
    storage = open_storage(str(root))
    assert run_mod.recorded_run(storage).id == "job-1" and run_mod.lineage(storage) == ["job-1"]
    restart = run_mod.Run.current("job-1")
    assert run_mod.check_start(storage, restart, resume=False, how_to_resume="-", how_to_start_over="-")
    assert ckpt.import_checkpoint(tmp_path / "w.pt", tmp_path / "new", step=1) == "torch"  # a new root: the import's
    assert run_mod.recorded_run(open_storage(str(tmp_path / "new"))).id == "shell-2"


def test_import_dcp_then_restore_is_bitwise(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, optim = _trained()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, single process
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    assert ckpt.import_checkpoint(tmp_path / "dcp", tmp_path / "root", step=7) == "dcp"
    restored, restored_optim = _restored(tmp_path / "root", 7)
    _same(dict(restored.state_dict()), dict(model.state_dict()))
    _same(restored_optim.state_dict()["state"][0], optim.state_dict()["state"][0])
    assert restored_optim.state_dict()["param_groups"] == optim.state_dict()["param_groups"]


def test_import_hf_folder_then_restore_into_the_tied_model(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="4KB")  # sharded, lm_head.weight left out (tied)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert ckpt.import_checkpoint(tmp_path / "hf", tmp_path / "root", step=1) == "hf"
    torch.manual_seed(1)
    fresh = GPT2LMHeadModel(config)
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        assert m.restore({"model": fresh}, keys=["model"]) == 1
        assert m.metadata(1)["hf_config"]["n_embd"] == 16
    _same(dict(fresh.state_dict()), dict(model.state_dict()))
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_import_hf_folder_finds_ties_without_building_the_model_and_names_a_bad_config(tmp_path):
    """The tied names come from the model class, not from a model built at the config's size (a config of a
    million layers took as long as building them); a config.json that is not JSON, or whose architectures are not
    class names, is an error naming it."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=4)).save_pretrained(
        tmp_path / "hf"
    )
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "n_layer": 10**6}))
    ckpt.import_checkpoint(tmp_path / "hf", tmp_path / "root", step=1)
    weights = ckpt.load(tmp_path / "root")["model"]
    assert weights["lm_head.weight"].data_ptr() == weights["transformer.wte.weight"].data_ptr()  # tied
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5Config(num_layers=1, num_decoder_layers=1, d_model=8, d_ff=16, num_heads=2, d_kv=4, vocab_size=16)
    T5ForConditionalGeneration(t5).save_pretrained(tmp_path / "t5")
    t5_path = tmp_path / "t5" / "config.json"
    t5_config = json.loads(t5_path.read_text())
    t5_config.pop("tie_word_embeddings", None)  # older Transformers wrote only the keys off their default
    t5_path.write_text(json.dumps(t5_config))
    ckpt.import_checkpoint(tmp_path / "t5", tmp_path / "t5root", step=1)
    weights = ckpt.load(tmp_path / "t5root")["model"]  # T5Config ties by default in __init__, not as a class field
    assert weights["lm_head.weight"].data_ptr() == weights["shared.weight"].data_ptr()
    for text, message in [
        (json.dumps({**config, "architectures": [5]}), r"config.json: 'architectures' must be a list of class names"),
        ("", r"config.json is not JSON \(JSONDecodeError: Expecting value"),
    ]:
        config_path.write_text(text)
        with pytest.raises(ValueError, match=message):
            ckpt.import_checkpoint(tmp_path / "hf", tmp_path / "other", step=1)


def test_import_safetensors_file_keeps_aliases_from_its_metadata(tmp_path):
    from safetensors.torch import save_model

    model, _ = _trained()
    save_model(model, str(tmp_path / "m.safetensors"))  # drops one tied name, records it in the metadata
    assert ckpt.import_checkpoint(tmp_path / "m.safetensors", tmp_path / "root", step=3) == "safetensors"
    restored, _ = _restored(tmp_path / "root", 3, keys=["model"])
    _same(dict(restored.state_dict()), dict(model.state_dict()))


def test_export_then_import_keeps_every_tie_whatever_the_names(tmp_path):
    """Ties between top-level names or between different attributes were dropped on import (only `x.attr: y.attr`
    entries count in a file of unknown origin); `ckpt export` marks its files, whose every entry is a tie."""
    w, attn = torch.randn(3, 3), torch.randn(4, 4)
    state = {"model": {"w": w, "v": w, "attn.in_proj_weight": attn, "out.weight": attn}}
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, state).wait()
    ckpt.export(tmp_path / "root", tmp_path / "out", format="safetensors")
    ckpt.import_checkpoint(tmp_path / "out" / "model.safetensors", tmp_path / "again", step=1)
    back = ckpt.load(tmp_path / "again")["model"]
    assert sorted(back) == ["attn.in_proj_weight", "out.weight", "v", "w"]
    assert back["v"].data_ptr() == back["w"].data_ptr() and torch.equal(back["out.weight"], attn)


def test_import_safetensors_reads_only_tie_records_as_aliases_not_other_metadata(tmp_path):
    """Metadata whose value happens to name a tensor (a note, a quantization record) adds no phantom tensor."""
    from safetensors.torch import save_file

    metadata = {"format": "pt", "quantized_param": "weight", "note": "bias", "head.weight": "bias"}
    save_file({"bias": torch.ones(2), "weight": torch.zeros(2, 2)}, tmp_path / "m.safetensors", metadata=metadata)
    ckpt.import_checkpoint(tmp_path / "m.safetensors", tmp_path / "root", step=1)
    assert sorted(ckpt.load(tmp_path / "root")["model"]) == ["bias", "weight"]


def _dcp_with(tmp_path, edit) -> str:
    """A real DCP checkpoint of a few entries whose .metadata (a pickle DCP wrote: the test reads and rewrites it
    with pickle itself; the importer never unpickles more than DCP's metadata classes) `edit` changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, single process
        dcp.save({"w": torch.ones(3), "b": torch.zeros(2), "obj": {"x": 1}}, checkpoint_id=str(folder))
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    by_fqn = {index.fqn: (index, info) for index, info in md.storage_data.items()}
    assert isinstance(by_fqn["w"][0], MetadataIndex)
    edit(md, by_fqn)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return str(folder / ".metadata")


def _set_attr(fqn, name, value):
    return lambda md, by_fqn: setattr(by_fqn[fqn][1], name, value)


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "sub/../../x"])
def test_import_dcp_refuses_data_files_outside_its_folder_naming_file_key_and_path(tmp_path, path):
    (tmp_path / "x").write_bytes(b"not for the import to read")
    metadata = _dcp_with(tmp_path, _set_attr("w", "relative_path", path))
    with pytest.raises(ValueError) as info:
        ckpt.import_checkpoint(tmp_path / "dcp", tmp_path / "root", step=1)
    message = str(info.value)
    assert metadata in message and "'w'" in message and repr(path) in message and "outside" in message, message
    assert not (tmp_path / "root").exists()


def _drop(fqn):
    return lambda md, by_fqn: md.storage_data.pop(by_fqn[fqn][0])


def _planner(fqn, path):
    return lambda md, by_fqn: md.planner_data.__setitem__(fqn, path)


def _chunk_past_the_end(md, by_fqn):
    md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([4])


def _sized(n: int):
    """w announced as n elements with no chunk: nothing stored for them (the import allocated n and kept garbage)."""

    def edit(md, by_fqn):
        md.state_dict_metadata["w"].size, md.state_dict_metadata["w"].chunks = torch.Size([n]), []

    return edit


def _overlapping_chunks(md, by_fqn):
    """w's 3 elements as chunks [0:2] and [1:2], the second stored in b's bytes: 3 elements in all, one twice."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md.state_dict_metadata["w"].chunks = [
        ChunkStorageMetadata(torch.Size([0]), torch.Size([2])),
        ChunkStorageMetadata(torch.Size([1]), torch.Size([1])),
    ]
    md.storage_data[MetadataIndex("w", [1])] = md.storage_data.pop(by_fqn["b"][0])
    del md.state_dict_metadata["b"]


def _shrunk(md, by_fqn):
    """w announced as 2 elements; its data file holds 3."""
    md.state_dict_metadata["w"].size = md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([2])


@pytest.mark.parametrize(
    "edit, key, what",
    [
        (_drop("w"), "w", "no storage_data item"),
        (_drop("obj.x"), "obj.x", "no storage_data item"),
        (_set_attr("b", "relative_path", None), "b", "not a path"),
        (_set_attr("b", "length", -1), "b", "bad byte range"),
        (_chunk_past_the_end, "w", "not inside its shape"),
        (_sized(4096), "w", r"its chunks hold 0 elements of its 4096 \(shape \[4096\]\): they must tile"),
        (_sized(2**40), "w", "its chunks hold 0 elements of its 1099511627776"),  # no 4 TiB allocated
        (_overlapping_chunks, "w", r"its chunks at offsets \[0\] and \[1\] overlap"),
        (_set_attr("w", "length", 4), "w", r"of sizes \[3\] takes 12 bytes of torch.float32, and is stored in 4"),
        (_set_attr("w", "length", 10**400), "w", r"bytes \d+\.\.100000000000\.\.\.\(401 digits\) of its data file"),
        (lambda md, by_fqn: setattr(by_fqn["b"][1], "offset", by_fqn["w"][1].offset), "w", "overlap those of entry 'b'"),
        (_shrunk, "w", r"holds a torch.float32 tensor of shape \[3\], not the torch.float32 tensor of shape \[2\]"),
        (_planner("b", ()), "b", "planner_data path"),
        (_planner("b", ("w", "b")), "b", "another entry's place"),  # below the tensor "w"
    ],
    ids=["tensor_without_storage", "bytes_without_storage", "path_none", "negative_length", "chunk_past_the_end",
         "gap", "gap_of_4_tib", "overlapping_chunks", "fewer_bytes_than_elements", "range_past_the_file",
         "bytes_shared_by_two_items", "stored_shape_differs", "empty_planner_path", "planner_path_through_a_tensor"],
)  # fmt: skip
def test_import_dcp_malformed_metadata_names_the_file_and_the_key(tmp_path, edit, key, what):
    metadata = _dcp_with(tmp_path, edit)
    with pytest.raises(ValueError, match=what) as info:
        ckpt.import_checkpoint(tmp_path / "dcp", tmp_path / "root", step=1)
    assert metadata in str(info.value) and f"entry {key!r}" in str(info.value), info.value
    assert not (tmp_path / "root").exists()


def test_import_dcp_metadata_of_another_type_is_named(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(ValueError, match=r"\.metadata is not DCP metadata this can read: it holds a dict"):
        ckpt.import_checkpoint(tmp_path / "dcp", tmp_path / "root", step=1)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))


def test_import_runs_no_code_from_a_checkpoint(tmp_path):
    _Payload.marker = str(tmp_path / "pwned")
    with open(tmp_path / "evil.pt", "wb") as f:
        torch.save({"model": {"w": torch.ones(2)}, "x": _Payload()}, f)
    with pytest.raises(ValueError, match="not loaded"):
        ckpt.import_checkpoint(tmp_path / "evil.pt", tmp_path / "root", step=1)
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(ValueError, match="posix.system|os.system"):
        ckpt.import_checkpoint(tmp_path / "dcp", tmp_path / "root", step=1)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "root").exists()


def _safetensors(path, header: str | bytes, data: bytes = b"") -> str:
    """A safetensors file with this header text (its length first) and data bytes, as a hostile writer makes one."""
    raw = header.encode() if isinstance(header, str) else header
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return str(path)


@pytest.mark.parametrize(
    "header, data, message",
    [
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}',
         bytes(12), "tensor 'b' starts at data byte 4, where 8 was expected"),  # overlapping: imported silently
        ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}',
         bytes(8), "tensor 'b' starts at data byte 0"),  # one buffer read as two dtypes
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8), "starts at data byte 4, where 0"),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}',
         bytes(4), "key 'a' appears twice"),  # the last one won, silently
        ('{"a":{"dtype":"F32","shape":[18446744073709551616,0],"data_offsets":[0,0]}}', b"", "malformed header entry"),
        ('{"a":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}}', b"",
         "malformed header entry"),  # a C++ stack trace, or tensorstore's, naming neither file nor key
        ("[" * 100_000, b"", "header is not JSON: RecursionError"),
        ('{"__metadata__":[],"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', bytes(4), "__metadata__ must map"),
        ('{"a":{"dtype":"C128","shape":[1],"data_offsets":[0,16]}}', bytes(16), "tensor 'a' has dtype C128, which is not supported"),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,' + "1" * 401 + ']}}', bytes(4),
         r"data_offsets \[0, 111111111111\.\.\.\(401 digits\)\], which"),  # not printed in full
    ],
)  # fmt: skip
def test_import_of_a_safetensors_file_that_breaks_the_format_names_it_and_writes_nothing(
    tmp_path, header, data, message
):
    path = _safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ValueError, match=message) as info:
        ckpt.import_checkpoint(path, tmp_path / "root", step=1)
    assert "bad.safetensors" in str(info.value)
    assert not (tmp_path / "root").exists() or not ckpt.CheckpointManager(tmp_path / "root").steps()


_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    "second, weight_map, message",
    [
        ({"w": torch.full((3,), 7.0)}, None, f"tensor 'w' is in two files, {_SHARDS[0]} and {_SHARDS[1]}"),
        ({"w": torch.full((3,), 7.0)}, {"w": 0, "a": 0, "b": 1}, f"'w' is in two files, {_SHARDS[0]} and {_SHARDS[1]}"),
        ({}, {"w": 1, "a": 0, "b": 1}, f"weight_map puts tensor 'w' in {_SHARDS[1]}, but {_SHARDS[0]} holds it"),
        ({}, {"a": 0, "b": 1}, f"weight_map puts tensor 'w' nowhere, but {_SHARDS[0]} holds it"),
        ({}, {"w": 0, "a": 0, "b": 1, "c": 1}, f"weight_map puts tensor 'c' in {_SHARDS[1]}, which does not hold it"),
    ],
    ids=["two_shards_without_index", "two_shards_with_index", "other_shard", "unlisted", "listed_not_held"],
)  # fmt: skip
def test_import_of_hf_shards_that_disagree_on_a_tensor_names_the_key_and_the_files(
    tmp_path, second, weight_map, message
):
    """A tensor is in exactly one shard, the one weight_map names: a later shard no longer silently replaces it."""
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"w": torch.ones(2), "a": torch.zeros(1)}, tmp_path / "hf" / _SHARDS[0])
    save_file({**second, "b": torch.zeros(1)}, tmp_path / "hf" / _SHARDS[1])
    if weight_map is not None:
        index = {"metadata": {}, "weight_map": {k: _SHARDS[i] for k, i in weight_map.items()}}
        (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message):
        ckpt.import_checkpoint(tmp_path / "hf", tmp_path / "root", step=1)
    assert not (tmp_path / "root").exists()


def test_import_of_a_folder_whose_index_is_not_an_object_names_it(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors.index.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not a safetensors index"):
        ckpt.import_checkpoint(tmp_path / "hf", tmp_path / "root", step=1)
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "m\0.safetensors"}}))
    with pytest.raises(ValueError, match=r"index.json: weight_map maps 'w' to 'm\\x00.safetensors', not a file name"):
        ckpt.import_checkpoint(tmp_path / "hf", tmp_path / "root", step=1)


def test_import_dcp_refuses_a_data_file_that_is_a_symlink_out_of_its_folder(tmp_path):
    """A data file of the folder that is a symlink to a file outside it (a tarball can carry one) was followed and
    read, though the docs say nothing outside the folder is read. Now it is refused as ../x is."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "dcp"))
    torch.save(torch.arange(3.0), tmp_path / "outside.pt")
    (data,) = (tmp_path / "dcp").glob("*.distcp")
    data.unlink()
    data.symlink_to(tmp_path / "outside.pt")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        ckpt.import_checkpoint(tmp_path / "dcp", tmp_path / "root", step=1)
    assert not (tmp_path / "root").exists()


def test_a_shard_size_is_whole_bytes_as_written():
    """0.29KB was int(0.29 * 1000) = 289 bytes; 1.5 (no unit) a 1-byte limit, one file per tensor."""
    from ckpt.exporter import parse_size

    assert [parse_size(s) for s in ("0.29KB", "1.5GB", "1.5KiB", "2", 7)] == [290, 1_500_000_000, 1536, 2, 7]
    with pytest.raises(ValueError, match="not a whole number of bytes: '1.5'"):
        parse_size("1.5")


def test_import_of_shards_without_their_index_refuses_a_missing_shard(tmp_path):
    """An export (or download) cut short leaves shards 1..K of N and no index (written last): the folder was imported
    as the whole model, without the tensors of the missing shards. Now it names the shard that is missing."""
    model, _ = _trained()
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": model})
    ckpt.export(tmp_path / "root", tmp_path / "st", format="safetensors", max_shard_size=1)
    (tmp_path / "st" / "model.safetensors.index.json").unlink()
    last = sorted(os.listdir(tmp_path / "st"))[-1]
    assert last == "model-00005-of-00005.safetensors"
    ckpt.import_checkpoint(tmp_path / "st", tmp_path / "whole", step=1)  # every shard there: as before
    assert torch.equal(ckpt.load(tmp_path / "whole")["model"]["norm.weight"], model.norm.weight)
    (tmp_path / "st" / last).unlink()
    with pytest.raises(ValueError, match=f"holds 4 of the 5 shards model-.*-of-00005.safetensors but not {last}"):
        ckpt.import_checkpoint(tmp_path / "st", tmp_path / "cut", step=1)
    assert not (tmp_path / "cut").exists()


@pytest.mark.parametrize(
    "model, message",
    [
        ({"__metadata__": torch.ones(2)}, "tensor '__metadata__' of step 1: safetensors names its header's metadata"),
        ({"a": torch.ones(2), "format": "a"}, "'format' of step 1 is tied to 'a'"),
        ({"a": torch.ones(2), "ckpt.ties": "a"}, "'ckpt.ties' of step 1 is tied to 'a'"),
        # os.fsdecode's name for non-UTF-8 bytes: written into a header that safetensors refused to open
        ({os.fsdecode(b"\xff"): torch.ones(2)}, "tensor '\\udcff' of step 1: its name holds a lone surrogate"),
        ({"a": torch.ones(2), os.fsdecode(b"\xff"): "a"}, "tensor '\\udcff' of step 1: its name holds a lone"),
    ],
    ids=["__metadata__", "format", "ckpt.ties", "surrogate", "surrogate_tie"],
)
def test_export_safetensors_refuses_a_name_the_file_format_takes_and_writes_nothing(tmp_path, capsys, model, message):
    """A tensor named __metadata__ was written as the header entry of that name (a file no reader opens, exit 0); a
    tie named format or ckpt.ties overwrote that metadata entry ('format': 'a', which from_pretrained refuses, and
    the tie was lost on import). Now the export is refused naming the key, and nothing is written."""
    tied = {k: model[v] if isinstance(v, str) else v for k, v in model.items()}
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": tied})
    (tmp_path / "config.json").write_text("{}")
    for fmt in ("safetensors", "hf"):
        out = [*(["--config", str(tmp_path / "config.json")] if fmt == "hf" else []), "-o", str(tmp_path / "out")]
        assert cli.main(["export", str(tmp_path / "root"), "--format", fmt, *out]) == 1
        err = capsys.readouterr().err
        assert message in err and "--format torch" in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["config.json", "root"]
    assert cli.main(["export", str(tmp_path / "root"), "--format", "torch", "-q", "-o", str(tmp_path / "w.pt")]) == 0
    assert list(torch.load(tmp_path / "w.pt", weights_only=True)) == list(tied)


def test_a_shard_size_of_many_digits_is_read_exactly():
    """A size past a float's range was an OverflowError ('cannot convert float infinity to integer', naming
    neither the option nor the size) with a unit, 'not a whole number of bytes' without one; past 2**53 bytes a
    size was rounded to another. Sizes are read as exact fractions."""
    from ckpt.exporter import parse_size

    huge = "9" * 400
    assert parse_size(huge + "GB") == int(huge) * 10**9 and parse_size(huge) == int(huge)
    assert parse_size("12345678901234567891") == 12345678901234567891
    assert parse_size("0.0015KB") == 2 and parse_size("1.0000000000000000001KiB") == 1024
    with pytest.raises(ValueError, match="not a size: a number of 5000 digits"):
        parse_size("9" * 5000 + "GB")  # more than int() converts


@pytest.mark.parametrize("size", [True, 1.5, None], ids=["bool", "float", "None"])
def test_a_shard_size_of_another_type_is_a_type_error_naming_it(size):
    """max_shard_size=True was a 1-byte limit (one file per tensor, in silence), 1.5 failed 'expected string or
    bytes-like object, got 'float'' (the regex's), naming neither the argument nor the value."""
    from ckpt.exporter import parse_size

    with pytest.raises(TypeError, match=rf"max_shard_size must be a str such as '5GB' or an int of bytes, got {size}"):
        parse_size(size)


def test_import_of_a_fifo_is_refused_naming_it_and_does_not_hang(tmp_path):
    """A FIFO named *.safetensors in an HF folder made the import wait forever for a writer (open() blocks), and a
    FIFO given as the source was said not to exist. Both are refused as not regular files, naming them."""
    (tmp_path / "hf").mkdir()
    os.mkfifo(tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError, match=r"hf/model.safetensors is a FIFO, not a regular file"):
        ckpt.import_checkpoint(tmp_path / "hf", tmp_path / "root", step=1)
    os.mkfifo(tmp_path / "w.pt")
    with pytest.raises(ValueError, match=r"w.pt is a FIFO, not a regular file"):
        ckpt.import_checkpoint(tmp_path / "w.pt", tmp_path / "root", step=1)
    assert not (tmp_path / "root").exists()


def test_import_under_an_empty_key_is_refused_before_the_root_is_touched(tmp_path, capsys):
    """`import --key ''` committed the source under the top-level key '', which `export --keys` and
    `load(keys=[...])` cannot select (an empty key is refused there). Now it is refused, naming the option."""
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert cli.main(["import", str(tmp_path / "w.pt"), str(tmp_path / "root"), "--step", "1", "--key", ""]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: key '' is empty: name the top-level key") and err.count("\n") == 1, err
    assert not (tmp_path / "root").exists()


class _NotAllowed:
    """A class torch.load(weights_only=True) refuses to build."""


def test_import_of_a_torch_file_cut_short_or_holding_objects_names_the_file_and_what_is_wrong(tmp_path, capsys):
    """A torch.save file cut short failed 'error: RuntimeError: PytorchStreamReader failed ...' or 'error: EOFError',
    naming no file, or was said to hold objects other than tensors, followed by torch's advice to load it with
    weights_only=False ('This file can still be loaded, ...'), as was a file that does hold an object, whose class
    went unnamed. Now each says which file and what is wrong in one line."""
    torch.save({"w": torch.ones(1000)}, tmp_path / "zip.pt")
    torch.save({"w": torch.ones(1000)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save({"w": torch.ones(2), "x": _NotAllowed()}, tmp_path / "object.pt")
    cases = [(tmp_path / "object.pt", "holds objects other than tensors", f"GLOBAL {__name__}._NotAllowed")]
    for name in ("zip.pt", "legacy.pt"):
        data = (tmp_path / name).read_bytes()
        for n in (10, 1000, len(data) - 100):
            (tmp_path / f"cut{n}-{name}").write_bytes(data[:n])
            cases.append(
                (tmp_path / f"cut{n}-{name}", "is not a torch.save file this can read (cut short or damaged?)", "")
            )
    for path, message, detail in cases:
        assert cli.main(["import", str(path), str(tmp_path / "root"), "--step", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path} {message}") and detail in err, err
        assert err.count("\n") == 1 and "weights_only" not in err and "\x1b" not in err, err
    assert not (tmp_path / "root").exists()


def test_import_of_a_folder_whose_index_names_a_missing_shard_names_the_index_and_its_tensors(tmp_path, capsys):
    """A shard the index names was missing (a download cut short): '[Errno 2] No such file or directory: ...', which
    says neither that the index names it nor what it should hold. Now the index, the shard and its tensors."""
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"a": torch.zeros(1)}, tmp_path / "hf" / _SHARDS[0])
    index = {"metadata": {}, "weight_map": {"a": _SHARDS[0], "b": _SHARDS[1], "c": _SHARDS[1]}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "root"), "--step", "1"]) == 1
    err = capsys.readouterr().err
    expected = (
        f"error: {tmp_path / 'hf' / 'model.safetensors.index.json'}: its weight_map puts 2 tensors ('b', 'c') in "
    )
    assert err.startswith(expected + f"{_SHARDS[1]}, which is not in {tmp_path / 'hf'}"), err
    assert err.count("\n") == 1 and not (tmp_path / "root").exists()


def test_export_hf_with_a_config_that_cannot_be_read_names_the_option(tmp_path, capsys):
    """`--config nope.json` failed '[Errno 2] No such file or directory: 'nope.json'' and `--config /etc` '[Errno 21]
    Is a directory', not saying which argument was read. Now the option, the path and why, and nothing is written."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2)}})
    for config, why in ((tmp_path / "nope.json", "No such file or directory"), (tmp_path, "Is a directory")):
        out = str(tmp_path / "out")
        assert cli.main(["export", str(tmp_path / "root"), "--format", "hf", "--config", str(config), "-o", out]) == 1
        err = capsys.readouterr().err
        assert err == f"error: --config {config}: {why} (the model's config.json, for --format hf)\n", err
    assert sorted(os.listdir(tmp_path)) == ["root"]


@pytest.mark.parametrize("directory", [True, False], ids=["folder", "file"])
def test_an_output_that_appears_during_the_export_is_kept_and_named(tmp_path, directory):
    """An OUT made by another process while the export ran (after its check) was kept, but the error named the
    export's temporary name, gone by then: '[Errno 39] Directory not empty: '.../.out.tmp-31403-afb2d23d' ->
    '.../out''. Now it says OUT appeared and export never overwrites."""
    from ckpt.exporter import _staged

    out = tmp_path / "out"
    with pytest.raises(FileExistsError, match=f"{out} appeared while the export was written: export never overwrites"):
        with _staged(str(out), directory=directory) as tmp:
            (Path(tmp) / "model.safetensors").write_bytes(b"x") if directory else Path(tmp).write_bytes(b"x")
            out.mkdir() if directory else out.write_text("someone else's")
            if directory:
                (out / "x").write_text("someone else's")
    assert os.listdir(tmp_path) == ["out"]
    assert (out / "x" if directory else out).read_text() == "someone else's"


def test_a_key_that_is_not_a_str_is_a_type_error_naming_it(tmp_path):
    """keys=['model', 3] failed "AttributeError: 'int' object has no attribute 'startswith'" (load and export),
    naming neither the argument nor the value. Now a TypeError names both."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2)}})
    for call, got in (
        (lambda: ckpt.load(tmp_path / "root", keys=["model", 3]), r"3 \(int\) in \['model', 3\]"),
        (lambda: ckpt.load(tmp_path / "root", keys=[None]), r"None \(NoneType\) in \[None\]"),
        (lambda: ckpt.export(tmp_path / "root", tmp_path / "out", format="torch", keys=["model", 3]), r"3 \(int\)"),
    ):
        with pytest.raises(TypeError, match=r"keys must be dotted paths \(str\), got " + got):
            call()
    assert sorted(os.listdir(tmp_path)) == ["root"]


def test_import_dcp_refuses_metadata_that_is_a_symlink_out_of_its_folder(tmp_path):
    """.metadata itself a symlink to a file outside the folder was followed and unpickled, where the docs say
    nothing outside a DCP folder is read (its data files were checked, not it)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "dcp"))
    (tmp_path / "dcp" / ".metadata").rename(tmp_path / "outside.metadata")
    (tmp_path / "dcp" / ".metadata").symlink_to(tmp_path / "outside.metadata")
    with pytest.raises(ValueError, match=r"dcp/.metadata is a symlink to .*outside.metadata, outside the checkpoint"):
        ckpt.import_checkpoint(tmp_path / "dcp", tmp_path / "root", step=1)
    assert not (tmp_path / "root").exists()


def test_import_dcp_refuses_a_data_file_that_is_a_fifo_and_does_not_hang(tmp_path):
    """An item stored in a FIFO of the folder (an empty byte range passes the size check) made the import wait
    forever for a writer at its open. Now it is refused as not a regular file, naming it."""

    def edit(md, by_fqn):
        info = by_fqn["obj.x"][1]
        info.relative_path, info.offset, info.length = "fifo", 0, 0

    folder = os.path.dirname(_dcp_with(tmp_path, edit))
    os.mkfifo(os.path.join(folder, "fifo"))
    with pytest.raises(ValueError, match=r"dcp/fifo is a FIFO, not a regular file"):
        ckpt.import_checkpoint(folder, tmp_path / "root", step=1)
    assert not (tmp_path / "root").exists()


def test_import_of_an_empty_source_is_refused_before_the_root_is_touched(tmp_path):
    """An empty source (a safetensors file of no tensor, an HF folder of one, torch.save({})) was committed as a step
    holding nothing, which then became the newest step a resume restores from, and could never be overwritten."""
    header = b"{}      "
    (tmp_path / "hf").mkdir()
    for path in (tmp_path / "empty.safetensors", tmp_path / "hf" / "model.safetensors"):
        path.write_bytes(len(header).to_bytes(8, "little") + header)
    torch.save({}, tmp_path / "empty.pt")
    for src in ("empty.safetensors", "hf", "empty.pt"):
        with pytest.raises(ValueError, match=f"{src} holds nothing to import"):
            ckpt.import_checkpoint(tmp_path / src, tmp_path / "root", step=1)
    assert not (tmp_path / "root").exists()


def test_a_save_under_an_empty_top_level_key_is_refused_naming_it(tmp_path):
    """save({'': t}) was committed, but load(keys=[...]) and export --keys refuse an empty key (`--keys model,`), so
    that entry could be read only with the whole state. It is refused as import --key '' is, and nothing is saved."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        with pytest.raises(ValueError, match=r"^key '' is empty: name the top-level key \(load\(keys=\) and export"):
            m.save(1, {"": torch.ones(2), "model": {"w": torch.ones(2)}})
        assert m.steps() == []


def test_an_empty_key_selection_selects_nothing_in_load_and_export(tmp_path, capsys):
    """export(keys=[]) exported 'model' where load(keys=[]) selects nothing ({}), and `export --keys ""` (an empty
    shell variable) likewise exported 'model'. keys=[] now selects nothing in both: load gives {}, export refuses
    (nothing to export), naming the step; --keys "" is an empty key, refused as --keys model, is."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2)}, "epoch": 3}).wait()
    assert ckpt.load(tmp_path / "root", keys=[]) == {}
    for fmt in ("safetensors", "torch"):
        with pytest.raises(ValueError, match=r"keys=\[\] selects nothing to export from step 1: name the keys"):
            ckpt.export(tmp_path / "root", tmp_path / "out", format=fmt, keys=[])
    assert (
        cli.main(["export", str(tmp_path / "root"), "--format", "torch", "--keys", "", "-o", str(tmp_path / "o")]) == 1
    )
    err = capsys.readouterr().err
    assert err.startswith("error: keys [''] hold an empty key") and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["root"]


def test_a_key_ending_in_a_dot_selects_the_empty_name_below_not_the_whole_node(tmp_path):
    """A dict may hold the key '' (restore keeps it), but `load(keys=['model.'])` selected all of `model` instead of
    its '' entry, and 'model.w.' read model.w: the trailing dot was dropped, so no key reached the '' entry alone and
    a typo read something else. Now 'model.' is the entry '' of model, and 'model.w.' a KeyError naming it."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2), "": torch.zeros(3)}}).wait()
    got = ckpt.load(tmp_path / "root", keys=["model."])
    assert list(got["model"]) == [""] and torch.equal(got["model"][""], torch.zeros(3))
    with pytest.raises(KeyError, match=r"key 'model.w.' is not in checkpoint step 1: no '' under model.w"):
        ckpt.load(tmp_path / "root", keys=["model.w."])


def test_a_region_error_names_the_key_as_selected_and_a_whole_state_selection_as_such(tmp_path):
    """A bad region named the array's storage name ('model/0.weight'), not the key the caller wrote, and region=
    without keys said 'keys [] select 2 arrays'. Now the dotted key, and 'the whole state'."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"model": torch.nn.Sequential(torch.nn.Linear(3, 2))}).wait()
    with pytest.raises(
        ValueError, match=r"with step 1 for key 'model.0.weight' \(shape \[2, 3\]\), got \(slice\(0, 2, 2"
    ):
        ckpt.load(tmp_path, keys=["model.0.weight"], region=(slice(0, 2, 2),))
    with pytest.raises(ValueError, match=r"one tensor: the whole state \(keys=None\) holds 2 arrays of step 1"):
        ckpt.load(tmp_path, region=(slice(0, 1),))


@pytest.mark.parametrize("where", ["manifest", "files"])
def test_a_step_deleted_while_load_or_export_reads_it_is_not_damage(tmp_path, monkeypatch, where):
    """A step deleted by another process's retention while load read it was reported 'checkpoint step 2 is damaged'
    (RuntimeWarning) before the previous step was read, load(step=2) raised CorruptCheckpointError, and export said
    'step 2 is damaged', where restore counts it as vanished. Now load reads the previous step in silence, and
    load(step=) and export raise StepNotFoundError saying it was deleted. The deletion is made right after the
    reader read the manifest (or listed the step's files), where the race falls."""
    from ckpt import catalog, layout, restore

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root) as m:
        m.save(1, {"model": {"w": torch.ones(4)}}).wait()
    for step in (2, 3, 4):
        with ckpt.CheckpointManager(root) as m:
            m.save(step, {"model": {"w": torch.full((4,), float(step))}}).wait()
        module, name = (layout, "read_manifest") if where == "manifest" else (restore, "step_files")
        real = getattr(module, name)

        def racing(storage, s, real=real, newest=step):
            got = real(storage, s)
            if s == newest:
                catalog.delete_step(storage, s)  # another process's retention, just then
            return got

        with monkeypatch.context() as patch:
            patch.setattr(module, name, racing)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no "damaged" warning
                if step == 2:
                    assert torch.equal(ckpt.load(root)["model"]["w"], torch.ones(4))
                elif step == 3:
                    with pytest.raises(ckpt.StepNotFoundError, match=r"step 3 of .* was deleted while being read"):
                        ckpt.load(root, step=3)
                else:
                    with pytest.raises(ckpt.StepNotFoundError, match=r"step 4 of .* was deleted while being read"):
                        ckpt.export(root, tmp_path / "out", format="safetensors", step=4)
    assert sorted(os.listdir(tmp_path)) == ["root"] and ckpt.CheckpointManager(root).steps() == [1]
    assert not (root / "_quarantine").exists()


@pytest.mark.parametrize(
    "device, what",
    [("nope", "Expected one of cpu"), ("cuda:1000", "")],
)
def test_load_to_a_device_it_cannot_reach_fails_before_reading_naming_it(tmp_path, device, what):
    """device='nope' (a typo) or a GPU this machine lacks read the whole selection first, then failed in torch
    naming no argument ('Expected one of cpu, ...'). Now a ValueError names device= before the arrays are read."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"model": {"w": torch.ones(1 << 20)}}).wait()  # 4 MiB
    ckpt.load(tmp_path, keys=["model"])  # imports and caches warm
    before = _io()
    with pytest.raises(ValueError, match=rf"^device={device!r} cannot take the loaded tensors: .*{what}"):
        ckpt.load(tmp_path, device=device)
    assert _io() - before < 1 << 20


def test_a_key_given_twice_exports_as_the_key_once(tmp_path):
    """`--keys model,model` exported full paths ('model.w') instead of the names below the key ('w'), and
    --format torch a dict {'model': ...} instead of the state dict itself: the duplicate counted as a second key.
    A key given twice now counts once."""
    from safetensors.torch import load_file

    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2), "b": torch.zeros(1)}}).wait()
    assert (
        cli.main(
            [
                "export",
                str(tmp_path / "root"),
                "--format",
                "safetensors",
                "--keys",
                "model,model",
                "-o",
                str(tmp_path / "st"),
            ]
        )
        == 0
    )
    assert sorted(load_file(tmp_path / "st" / "model.safetensors")) == ["b", "w"]
    ckpt.export(tmp_path / "root", tmp_path / "w.pt", format="torch", keys=["model", "model"])
    assert sorted(torch.load(tmp_path / "w.pt", weights_only=True)) == ["b", "w"]


def test_load_or_export_of_a_step_directory_names_its_root(tmp_path, capsys):
    """ckpt.load(ROOT/step_00000001) and `export ROOT/step_00000001` said only 'no committed checkpoint in
    ROOT/step_00000001', where ls, inspect and verify name the directory's step and its root. Now they do too."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2)}}).wait()
    step_dir = tmp_path / "root" / "step_00000001"
    hint = f"(step_00000001 is step 1's directory: its root is {tmp_path / 'root'})"
    with pytest.raises(FileNotFoundError, match=re.escape(hint)):
        ckpt.load(step_dir)
    assert cli.main(["export", str(step_dir), "--format", "torch", "-o", str(tmp_path / "w.pt")]) == 1
    assert capsys.readouterr().err == f"error: no committed checkpoint in {step_dir} {hint}\n"


@pytest.mark.parametrize("call", ["load", "export"])
def test_load_of_the_newest_step_replaced_while_it_reads_gives_the_newer_one(tmp_path, monkeypatch, call):
    """A training run under keep_last=1 committed step 3 and deleted step 2 while load read step 2: load went on to
    the older steps it had listed (none) and said 'no committed checkpoint in ROOT', with step 3 committed there,
    and export (without --step) failed. Both now list the steps again, as restore does, and read step 3. The
    writer's save is made right after the reader read step 2's manifest, where the race falls."""
    from ckpt import layout

    root = tmp_path / "root"
    real = layout.read_manifest
    with ckpt.CheckpointManager(root, keep_last=1) as writer:
        writer.save(2, {"model": {"w": torch.full((4,), 2.0)}}).wait()

        def racing(storage, step):
            got = real(storage, step)
            if step == 2:
                writer.save(3, {"model": {"w": torch.full((4,), 3.0)}}).wait()
                writer.wait()  # its retention deleted step 2
            return got

        monkeypatch.setattr(layout, "read_manifest", racing)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if call == "load":
                assert torch.equal(ckpt.load(root)["model"]["w"], torch.full((4,), 3.0))
            else:
                assert ckpt.export(root, tmp_path / "w.pt", format="torch") == 3
                assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.full((4,), 3.0))
        assert writer.steps() == [3]


def test_keys_given_as_a_generator_select_what_it_yields(tmp_path):
    """keys=(k for k in ['model']) selected nothing: the first pass over the selection consumed the generator, so
    load gave {} and export wrote an empty torch file ({}), with no error. Keys are read once now."""
    with ckpt.CheckpointManager(tmp_path / "root") as m:
        m.save(1, {"model": {"w": torch.ones(2)}, "opt": {"x": torch.zeros(1)}}).wait()
    assert list(ckpt.load(tmp_path / "root", keys=(k for k in ["model"]))) == ["model"]
    ckpt.export(tmp_path / "root", tmp_path / "w.pt", format="torch", keys=(k for k in ["model"]))
    assert list(torch.load(tmp_path / "w.pt", weights_only=True)) == ["w"]


def test_a_key_that_spells_an_int_key_and_its_str_alike_is_ambiguous(tmp_path):
    """A dict holding both 0 and '0' (restore keeps both): keys=['m.0'] read whichever came first, in silence, and
    the other could not be chosen. Now a KeyError says the key is ambiguous and names both."""
    with ckpt.CheckpointManager(tmp_path) as m:
        m.save(1, {"m": {0: torch.ones(1), "0": torch.zeros(2)}}).wait()
    with pytest.raises(KeyError, match=r"key 'm.0' is ambiguous in checkpoint step 1: m holds both 0 and '0'; select"):
        ckpt.load(tmp_path, keys=["m.0"])
    assert list(ckpt.load(tmp_path, keys=["m"])["m"]) == [0, "0"]
