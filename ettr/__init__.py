"""ettr: attribute a training job's wall time across restarts and export its goodput (ETTR)."""

from .advice import Advice, TwoTierAdvice, TwoTierInputs, advise, advise_two_tier
from .attribution import CATEGORIES, AttemptSummary, Attribution, RootFollower, Segment, attribute, attribute_root
from .clock import Clock, FakeClock, SystemClock
from .formulas import (
    TwoTierCosts,
    TwoTierPlan,
    best_single_interval,
    cluster_ettr,
    daly_interval,
    expected_ettr,
    mttf_from_rate,
    optimal_two_tier,
    seed_ettr,
    two_tier_ettr,
    young_interval,
)
from .ledger import Ledger, LedgerError, read_ledgers
from .report import plot_timeline, report_json, report_text
from .simulate import SimResult, simulate, simulate_two_tier
from .stragglers import RankSteps, StepWindow, Stragglers, ideal_step, step_deviation, stragglers, stragglers_root
from .telemetry import GoodputMetrics, configure_metrics, goodput_resource, identity_attributes, metric_totals
from .tracker import GoodputTracker

__all__ = [
    "CATEGORIES",
    "Advice",
    "AttemptSummary",
    "Attribution",
    "Clock",
    "FakeClock",
    "GoodputMetrics",
    "GoodputTracker",
    "Ledger",
    "LedgerError",
    "RankSteps",
    "RootFollower",
    "Segment",
    "SimResult",
    "StepWindow",
    "Stragglers",
    "SystemClock",
    "TwoTierCosts",
    "TwoTierAdvice",
    "TwoTierInputs",
    "TwoTierPlan",
    "advise",
    "advise_two_tier",
    "attribute",
    "attribute_root",
    "best_single_interval",
    "cluster_ettr",
    "configure_metrics",
    "daly_interval",
    "expected_ettr",
    "goodput_resource",
    "identity_attributes",
    "ideal_step",
    "metric_totals",
    "mttf_from_rate",
    "optimal_two_tier",
    "plot_timeline",
    "read_ledgers",
    "report_json",
    "report_text",
    "seed_ettr",
    "simulate",
    "simulate_two_tier",
    "step_deviation",
    "stragglers",
    "stragglers_root",
    "two_tier_ettr",
    "young_interval",
]
