"""pytest plugin: with CKPT_REQUIRE_EXTRAS=1 (scripts/test.sh sets it) a test skipped because an optional framework
is missing (`pytest.importorskip`: Lightning, Transformers, the OpenTelemetry exporters) fails instead, naming the
module, so a CI without the extras cannot pass by skipping what it was meant to test. Loaded by conftest.py."""

from __future__ import annotations

import os

import pytest

ENV = "CKPT_REQUIRE_EXTRAS"
HINT = "install the extras (bash scripts/setup.sh dev,lightning,hf), or unset CKPT_REQUIRE_EXTRAS to skip"


def required() -> bool:
    """Whether a missing optional framework is a failure in this run."""
    return os.environ.get(ENV) == "1"


def _missing_module(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The reason of a skip that `pytest.importorskip` raised, else None."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    return reason if reason.startswith("could not import") else None


def _fail(report: pytest.CollectReport | pytest.TestReport) -> None:
    reason = _missing_module(report)
    if reason is not None and required():
        report.outcome = "failed"
        report.longrepr = f"{ENV}=1: {reason}; {HINT}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    _fail(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    _fail(outcome.get_result())
