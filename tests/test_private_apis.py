"""One canary for every private name of torch, Transformers, Accelerate, Lightning and OpenTelemetry this project
touches.

The integrations override or call private `Trainer` methods (integrations/hf.py), reach into Lightning's checkpoint
connector and `ModelCheckpoint`'s private save methods (integrations/lightning.py), and ckpt uses torch internals
(ckpt/distributed.py, ckpt/snapshot.py, ckpt/restore.py, ckpt/determinism/data.py). An upgrade that renames or
reshapes one fails here, in one place, with a message naming the name, the code that uses it and the installed
version.

Each name is checked the way the code uses it: an override must take the same parameters as the method it replaces
(the library calls ours as it would call its own); a call must bind the arguments our code passes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import pytest

_ANY = object()  # a placeholder argument


@dataclass(frozen=True)
class Use:
    name: str  # as the failure names it
    dist: str  # the distribution that defines it (its installed version is in the message)
    where: str  # our code that uses it
    get: Callable[[], Any]  # imports and returns it (AttributeError/ImportError: it is gone)
    override: Callable[[], Any] | None = None  # our method that replaces it: the same parameters
    call: tuple[int, tuple[str, ...]] | None = None  # what our code passes: positional count (self included for a
    # method), keyword names
    check: Callable[[Any], str | None] | None = None  # anything else; returns the problem or None


def _attr(module: str, *path: str) -> Callable[[], Any]:
    def get() -> Any:
        value: Any = importlib.import_module(module)
        for name in path:
            value = getattr(value, name)
        return value

    return get


def _hf(name: str) -> Callable[[], Any]:
    return _attr("transformers", "Trainer", name)


def _mixin(name: str) -> Callable[[], Any]:
    return _attr("integrations.hf", "CkptTrainerMixin", name)


def _mc(name: str) -> Callable[[], Any]:
    return _attr("lightning.pytorch.callbacks", "ModelCheckpoint", name)


def _connector() -> Any:
    """A real Trainer's `_checkpoint_connector` (its attributes are set in __init__, not on the class)."""
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    return trainer._checkpoint_connector


def _has_loaded_checkpoint(connector: Any) -> str | None:
    missing = [n for n in ("_loaded_checkpoint", "restore_model", "restore_datamodule", "restore_callbacks")
               if not hasattr(connector, n)]  # fmt: skip
    if missing:
        return f"the checkpoint connector has no {missing}"
    for name in ("restore_model", "restore_datamodule", "restore_callbacks"):
        if _binds(getattr(connector, name), (0, ())) is not None:
            return f"_checkpoint_connector.{name}() takes arguments: {inspect.signature(getattr(connector, name))}"
    return None


def _sees_overlap(fn: Any) -> str | None:
    import torch

    if fn(torch.zeros(1).expand(3)) != 1 or fn(torch.zeros(3)) != 0:
        return "no longer tells an expanded tensor (1) from a plain one (0)"
    return None


def _proxies_point_to_the_sdk(proxy_meter: Any) -> str | None:
    """ettr/telemetry.py finds the SDK meter and instruments behind the API's proxies (made before the global
    provider was set) by `_real_meter` and `_real_instrument`: None before a provider, the SDK's after."""
    from opentelemetry.sdk.metrics import MeterProvider

    meter = proxy_meter("canary")
    counter = meter.create_counter("canary")
    if getattr(meter, "_real_meter", 0) is not None or getattr(counter, "_real_instrument", 0) is not None:
        return "a proxy made before any provider has no _real_meter / _real_instrument of None"
    meter.on_set_meter_provider(MeterProvider())
    if getattr(meter, "_real_meter", None) is None or getattr(counter, "_real_instrument", None) is None:
        return "a proxy no longer names the SDK meter / instrument behind it as _real_meter / _real_instrument"
    return None


def _version_counts(t_cls: Any) -> str | None:
    import torch

    t = torch.zeros(2)
    before = t._version
    t.add_(1)
    return None if isinstance(before, int) and t._version > before else "Tensor._version does not count in-place writes"


HF_OVERRIDES = [
    "_init_training_state",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
    "_load_best_model",
    "_save_checkpoint",
    "_finalize_training",
    "_save_optimizer_and_scheduler",
    "_save_scaler",
    "_save_rng_state",
    "save_model",  # public, but its second parameter (_internal_call) is private
]

USES = [
    *(
        Use(f"transformers.Trainer.{n}", "transformers", "integrations/hf.py CkptTrainerMixin", _hf(n), _mixin(n))
        for n in HF_OVERRIDES
    ),
    Use("transformers.Trainer._get_output_dir", "transformers", "integrations/hf.py", _hf("_get_output_dir"),
        call=(1, ("trial",))),
    Use("accelerate.Accelerator.unwrap_model(keep_torch_compile=)", "accelerate",
        "integrations/hf.py _write_folder_files", _attr("accelerate", "Accelerator", "unwrap_model"),
        call=(2, ("keep_torch_compile",))),
    Use("tests/procs/hf_train.py: Trainer.training_step(model, inputs, num_items_in_batch)", "transformers",
        "tests/procs/hf_train.py LossPrinter", _hf("training_step"), call=(4, ())),
    Use("lightning Trainer._checkpoint_connector._loaded_checkpoint", "lightning",
        "integrations/lightning.py GoodputCallback.on_fit_start", _connector, check=_has_loaded_checkpoint),
    Use("ModelCheckpoint._should_skip_saving_checkpoint", "lightning", "integrations/lightning.py DecisionCheckpoint",
        _mc("_should_skip_saving_checkpoint"), call=(2, ())),
    Use("ModelCheckpoint._monitor_candidates", "lightning", "integrations/lightning.py DecisionCheckpoint",
        _mc("_monitor_candidates"), call=(2, ())),
    Use("ModelCheckpoint._save_topk_checkpoint", "lightning", "integrations/lightning.py DecisionCheckpoint",
        _mc("_save_topk_checkpoint"), call=(3, ())),
    Use("ModelCheckpoint._save_last_checkpoint", "lightning", "integrations/lightning.py DecisionCheckpoint",
        _mc("_save_last_checkpoint"), call=(3, ())),
    Use("ModelCheckpoint._save_checkpoint", "lightning", "integrations/lightning.py DecisionCheckpoint",
        _mc("_save_checkpoint"), _attr("integrations.lightning", "DecisionCheckpoint", "_save_checkpoint")),
    Use("torch.distributed.tensor._utils.compute_local_shape_and_global_offset", "torch", "ckpt/distributed.py",
        _attr("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"), call=(3, ())),
    Use("torch.utils.data._utils.collate.default_collate", "torch", "ckpt/determinism/data.py",
        _attr("torch.utils.data._utils.collate", "default_collate"), call=(1, ())),
    Use("torch.utils.data.DataLoader._get_iterator", "torch", "ckpt/determinism/data.py _Loader (live workers)",
        _attr("torch.utils.data", "DataLoader", "_get_iterator"),
        override=_attr("ckpt.determinism.data", "_Loader", "_get_iterator")),
    Use("torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers", "torch",
        "ckpt/determinism/data.py _end_workers (workers ended at exit)",
        _attr("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter", "_shutdown_workers"), call=(1, ())),
    Use("torch.Tensor._version", "torch", "ckpt/snapshot.py (the overlapped snapshot's change check)",
        _attr("torch", "Tensor"), check=_version_counts),
    Use("torch._debug_has_internal_overlap", "torch", "ckpt/restore.py (an expanded target is refused first)",
        _attr("torch", "_debug_has_internal_overlap"), check=_sees_overlap),
    Use("opentelemetry.metrics proxies' _real_meter and _real_instrument", "opentelemetry-api",
        "ettr/telemetry.py (_backing, _recording: gauges registered once, points held until a provider is set)",
        _attr("opentelemetry.metrics._internal", "_ProxyMeter"), check=_proxies_point_to_the_sdk),
]  # fmt: skip


def _binds(fn: Any, call: tuple[int, tuple[str, ...]]) -> str | None:
    positional, keywords = call
    try:
        inspect.signature(fn).bind(*[_ANY] * positional, **{k: _ANY for k in keywords})
    except TypeError as e:
        return f"our call ({positional} positional, keywords {list(keywords)}) no longer binds {inspect.signature(fn)}: {e}"
    return None


def _same_parameters(theirs: Any, ours: Any) -> str | None:
    mine = list(inspect.signature(ours).parameters.values())
    if {p.kind for p in mine[1:]} == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        return None  # ours passes whatever it is given through
    shape = [(p.name, p.kind) for p in inspect.signature(theirs).parameters.values()]
    if shape != [(p.name, p.kind) for p in mine]:
        return f"its parameters are now {inspect.signature(theirs)}; our override takes {inspect.signature(ours)}"
    return None


def _problem(use: Use) -> str | None:
    try:
        value = use.get()
    except (ImportError, AttributeError) as e:
        return f"it is gone ({type(e).__name__}: {e})"
    if use.override is not None:
        return _same_parameters(value, use.override())
    if use.call is not None:
        return _binds(value, use.call)
    return use.check(value)


@pytest.mark.parametrize("use", USES, ids=[u.name for u in USES])
def test_a_private_name_we_use_is_there_as_we_use_it(use):
    module = {"transformers": "transformers", "accelerate": "accelerate", "lightning": "lightning"}.get(use.dist)
    if module is not None:
        pytest.importorskip(module)  # an optional extra: its own tests skip without it too
    problem = _problem(use)
    assert problem is None, (
        f"{use.name}, used by {use.where}: {problem} (installed: {use.dist} {importlib.metadata.version(use.dist)}). "
        f"Adapt that code to this version, or pin {use.dist} to a tested one (pyproject.toml)"
    )


def test_the_canary_fails_naming_the_name_and_the_version():
    gone = Use("torch.no_such_private_thing", "torch", "nowhere", _attr("torch", "_no_such_private_thing"))
    with pytest.raises(
        AssertionError, match=r"torch\.no_such_private_thing, used by nowhere: it is gone .*installed: torch \d"
    ):
        test_a_private_name_we_use_is_there_as_we_use_it(gone)
    reshaped = Use("x", "torch", "here", lambda: lambda a, b: None, call=(3, ()))
    assert "no longer binds" in _problem(reshaped)
