"""speculation_profile.json: per drafted position, how often a draft's tokens are accepted, with 95% intervals
and the conditions they were measured under; calibrate writes it beside speculative.json (held-out simulator) and
eval as metrics.json `measured` (its own decodes). Fields, their source (NVIDIA Model-Optimizer's proposal) and why
the intervals are bootstrap intervals over units, not Wilson intervals: docs/architecture.md, "Speculation profile".
"""
from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np

from pipeline.atomic import write_json
from pipeline.errors import PipelineError

FILENAME = "speculation_profile.json"
SCHEMA_VERSION = "1.0"  # Model-Optimizer's; a reader refuses any other
N_RESAMPLES = 2000  # percentile bootstrap: 2,000 resamples put each 2.5% tail on 50 draws (Efron & Tibshirani, ch. 13)
BOOTSTRAP_SEED = 0  # fixed: the same units always give the same interval
CI_LEVEL = 0.95
HELDOUT, MEASURED = "heldout-simulator", "eval-measured"  # measurement_conditions.source
SECTION_KEYS = ("num_speculative_tokens", "conditional_accept_rates", "marginal_accept_rates",
                "conditional_accept_rates_ci95", "marginal_accept_rates_ci95", "mean_accept_length",
                "mean_accept_length_ci95", "accept_length_by_k", "accept_length_by_k_ci95", "n_proposed", "n_units")


def section(accepted, proposed) -> dict:
    """One domain's (or all domains') rates from per-unit counts: accepted[u, k-1] = Σ over unit u's blocks of
    the chance the first k drafts were all accepted (a 0/1 count when measured), proposed[u, k-1] = how many of
    its blocks proposed a k-th draft. K = the last position any unit proposed."""
    accepted, proposed = np.asarray(accepted, float), np.asarray(proposed, float)
    if accepted.ndim != 2:  # no units
        accepted = proposed = np.zeros((0, 0))
    k = int(np.flatnonzero(proposed.sum(0) > 0).max()) + 1 if proposed.sum() > 0 else 0
    accepted, proposed = accepted[:, :k], proposed[:, :k]
    marginal = _marginal(accepted.sum(0), proposed.sum(0))
    boot = _bootstrap(accepted, proposed)
    return {"num_speculative_tokens": k,
            "conditional_accept_rates": _rounded(_conditional(marginal)),
            "marginal_accept_rates": _rounded(marginal),
            "conditional_accept_rates_ci95": _intervals(_conditional(boot)),
            "marginal_accept_rates_ci95": _intervals(boot),
            "mean_accept_length": round(1.0 + float(marginal.sum()), 6),
            "mean_accept_length_ci95": _intervals(1.0 + boot.sum(-1, keepdims=True))[0] if k else None,
            "accept_length_by_k": {str(i + 1): v for i, v in enumerate(_rounded(1.0 + np.cumsum(marginal)))},
            "accept_length_by_k_ci95": {str(i + 1): v for i, v in enumerate(_intervals(1.0 + np.cumsum(boot, -1)))},
            "n_proposed": [int(n) if float(n).is_integer() else round(float(n), 6) for n in proposed.sum(0)],
            "n_units": len(accepted)}


def position_counts(stats) -> tuple[list[int], list[int]]:
    """One decode's (its pipeline.decoding DecodeStats) accepted and proposed counts per draft position k = 1..d:
    a verify pass that accepted n of d drafted tokens counts positions 1..d as proposed and 1..n as accepted
    (acceptance stops at the first rejection; a tree's positions are its depths)."""
    passes = list(zip(getattr(stats, "depths", None) or stats.drafted, stats.accepted))
    width = max((d for d, _ in passes), default=0)
    return ([sum(d > k and n > k for d, n in passes) for k in range(width)],
            [sum(d > k for d, _ in passes) for k in range(width)])


def position_table(stats_list) -> tuple[np.ndarray, np.ndarray]:
    """position_counts of every request as two [requests, longest] arrays (zeros beyond a request's own)."""
    counts = [position_counts(s) for s in stats_list]
    width = max((len(p) for _, p in counts), default=0)
    table = np.zeros((2, len(counts), width))
    for i, (a, p) in enumerate(counts):
        table[0, i, :len(a)], table[1, i, :len(p)] = a, p
    return table[0], table[1]


def _marginal(accepted, proposed):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(proposed > 0, accepted / np.where(proposed > 0, proposed, 1.0), np.nan)


def _conditional(marginal):
    """marginal_k / marginal_{k−1} along the last axis (marginal_0 = 1); 0 after a position nothing reached."""
    previous = np.concatenate([np.ones_like(marginal[..., :1]), marginal[..., :-1]], -1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(previous > 0, marginal / np.where(previous > 0, previous, 1.0), 0.0)


def _bootstrap(accepted, proposed) -> np.ndarray:
    """[N_RESAMPLES, K] marginals, each over units drawn with replacement (multinomial weights: no copies)."""
    units = len(accepted)
    if units == 0 or accepted.shape[1] == 0:
        return np.zeros((0, accepted.shape[1]))
    weights = np.random.default_rng(BOOTSTRAP_SEED).multinomial(units, np.full(units, 1.0 / units), N_RESAMPLES)
    return _marginal(weights @ accepted, weights @ proposed)


def _intervals(draws) -> list[list[float] | None]:
    """Percentile interval per column; None where fewer than 2 units were drawn from (no spread to resample)."""
    if len(draws) == 0:
        return [None] * draws.shape[-1]
    tail = 100 * (1 - CI_LEVEL) / 2
    finite = (column[np.isfinite(column)] for column in np.asarray(draws).T)
    return [[round(float(v), 6) for v in np.percentile(c, (tail, 100 - tail))] if len(c) else None for c in finite]


def _rounded(values) -> list[float]:
    return [round(float(v), 6) if np.isfinite(v) else 0.0 for v in values]


def build(sections: dict[str, dict], overall: str, conditions: dict, *, target: dict | None, draft: dict | None,
          reported: dict | None = None) -> dict:
    """The profile: `sections[overall]`'s fields at the top (what a consumer of one vector reads), every other
    section under `per_category`, the measurement conditions, and Model-Optimizer's two `validation` checks
    (`mean_consistency` where `reported` = {"gamma": γ, domain: mean}), recorded, not raised: a profile that fails
    one still describes what was measured."""
    top = sections[overall]
    profile = {"schema_version": SCHEMA_VERSION, "measured": True, "method": "draft_model",
               "draft_checkpoint": draft, "target_model": target, **top,
               "max_supported_k": top["num_speculative_tokens"], "verification_method": "longest_prefix",
               "accept_length_model": "chain_analytic", "acceptance_length_histogram": None,
               "per_category": {name: s for name, s in sections.items() if name != overall},
               "measurement_conditions": conditions,
               "validation": {"marginal_monotonicity": {name: monotonicity(s) for name, s in sections.items()}}}
    if reported:
        gamma = int(reported["gamma"])
        profile["validation"]["mean_consistency"] = {name: consistency(s, reported[name], gamma)
                                                     for name, s in sections.items() if reported.get(name) is not None}
    return profile


def monotonicity(rates: dict) -> dict:
    """The positions k whose marginal exceeds the one before (vLLM's synthetic sampler needs them falling)."""
    marginal = rates["marginal_accept_rates"]
    rising = [k + 2 for k, (a, b) in enumerate(pairwise(marginal)) if b > a + 1e-6]
    return {"passed": not rising, "rising_positions": rising}


def consistency(rates: dict, reported_mean: float, gamma: int) -> dict:
    """Do the section's marginals reproduce a reported mean accepted length of a chain of fixed γ? implied =
    1 + Σ_{k≤γ} marginal_k; passed when the reported mean and the implied one both lie in the 95% interval of the
    mean accepted length at γ (±1e-6 for rounding). The implied mean is judged too, so rates that are not the
    marginals fail it whatever interval the file states."""
    marginal = rates["marginal_accept_rates"][:gamma]
    implied = 1.0 + sum(marginal)
    ci = rates["accept_length_by_k_ci95"].get(str(len(marginal))) if marginal else None
    lo, hi = ci if ci else (implied, implied)
    inside = [lo - 1e-6 <= value <= hi + 1e-6 for value in (float(reported_mean), implied)]
    return {"gamma": gamma, "implied_mean_accept_length": round(implied, 6),
            "reported_mean_accept_length": round(float(reported_mean), 6), "ci95": ci, "passed": all(inside)}


def write(directory: str | Path, profile: dict) -> Path:
    path = Path(directory) / FILENAME
    write_json(path, check(profile, FILENAME))
    return path


def read(directory: str | Path) -> dict | None:
    """The directory's speculation_profile.json, checked, or None when it has none (an older export)."""
    path = Path(directory) / FILENAME
    if not path.exists():
        return None
    try:
        return check(json.loads(path.read_text()), str(path))
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON ({e.msg}): rerun stage=calibrate") from None


def check(profile, where: str) -> dict:
    """The profile, or one line naming what is wrong: another schema version, a missing field, or vectors whose
    length is not num_speculative_tokens."""
    if not isinstance(profile, dict) or profile.get("schema_version") != SCHEMA_VERSION:
        version = profile.get("schema_version") if isinstance(profile, dict) else None
        raise PipelineError(f"{where} has schema_version {version!r} (this code reads {SCHEMA_VERSION}): rerun "
                            "stage=calibrate")
    for name, rates in {"overall": profile, **(profile.get("per_category") or {})}.items():
        missing = [key for key in SECTION_KEYS if key not in rates]
        if missing:
            raise PipelineError(f"{where}: {name} lacks {missing}: rerun stage=calibrate")
        k = rates["num_speculative_tokens"]
        if len(rates["marginal_accept_rates"]) != k or len(rates["conditional_accept_rates"]) != k:
            raise PipelineError(f"{where}: {name} has rate vectors of another length than num_speculative_tokens={k}")
    return profile
