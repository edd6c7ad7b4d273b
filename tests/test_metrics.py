"""Bootstrap confidence intervals of the eval metrics on synthetic records (no models): the interval holds the
estimate, narrows with more requests, gains from pairing, tells noise from a real difference, and is null
below two requests."""
from __future__ import annotations

import re

import numpy as np
import pytest
from scipy.stats import bootstrap

from eval import metrics as M
from eval.intervals import speedup_stat
from eval.tables import comparison_lines, domain_rows, method_rows, text_table
from pipeline.decoding import DecodeStats
from pipeline.measure.intervals import N_RESAMPLES
from tests.conftest import SHIPPED

BAND = tuple(SHIPPED.eval.control_band)  # the shipped eval.control_band
STEP_S = 0.01  # seconds per generated token of the autoregressive target


def _stats(n_tokens: int, accept: float, rng, gamma: int = 4) -> DecodeStats:
    accepted = list(rng.binomial(gamma, accept, size=max(1, n_tokens // (1 + gamma))))
    return DecodeStats(accepted=accepted, drafted=[gamma] * len(accepted), target_passes=len(accepted) + 1,
                       n_generated=n_tokens, target_times=[STEP_S])


def make_records(n: int, seed: int = 0, speedup: float = 1.5, jitter: float = 0.05, spread: float = 0.6,
                 others: dict[str, float] | None = None, domain: str = "chat") -> list[dict]:
    """n requests, each run by AR, speculative (`speedup` faster) and every other method (its own speedup).

    Requests differ a lot in speed (lognormal `spread`: machine drift, prompt length), and every method on one
    request shares that factor up to a small independent `jitter`, as interleaved runs do."""
    rng = np.random.default_rng(seed)
    methods = {"autoregressive": 1.0, "speculative": speedup, **(others or {})}
    out = []
    for i in range(n):
        n_tokens = int(rng.integers(20, 200))
        slowness = rng.lognormal(0.0, spread)
        accept = rng.uniform(0.4, 0.8)
        for method, gain in methods.items():
            seconds = n_tokens * STEP_S * slowness / gain * (1 + jitter * rng.standard_normal())
            stats = None if method.startswith("hf_") else _stats(n_tokens, accept, rng)
            out.append({"method": method, "domain": domain, "prompt_id": f"{domain}-{i}", "turn": 0,
                        "tokens": [1] * n_tokens, "time_s": seconds, "stats": stats})
    return out


def width(ci: list[float]) -> float:
    return ci[1] - ci[0]


def test_ci_contains_the_point_estimate():
    out = M.summarize(make_records(12, others={"hf_assisted": 1.2}), greedy=False)
    for method, true_speedup in (("speculative", 1.5), ("hf_assisted", 1.2)):
        m = out[method]
        lo, hi = m["speedup_ci95"]
        assert lo < m["speedup"] < hi
        # the records were built with a known speedup: the estimate is near it (5% jitter, 12 requests) and the
        # interval covers it
        assert m["speedup"] == pytest.approx(true_speedup, rel=0.03), method
        assert lo < true_speedup < hi, (method, lo, hi)
    spec = out["speculative"]
    lo, hi = spec["acceptance_rate_ci95"]
    assert lo < spec["acceptance_rate"] < hi
    assert "acceptance_rate_ci95" not in out["hf_assisted"]  # no decode stats, no acceptance
    assert out["speedup_ci95"] == spec["speedup_ci95"]  # the domain headline mirrors the tuned draft


def test_ci_narrows_with_more_requests():
    """Mean width over a few draws of each size: one draw of 4 requests can land narrow by chance."""
    def mean_widths(n: int) -> tuple[float, float]:
        runs = [M.summarize(make_records(n, seed=s, jitter=0.1, spread=0.3), greedy=False)["speculative"]
                for s in range(8)]
        return (np.mean([width(m["speedup_ci95"]) for m in runs]),
                np.mean([width(m["acceptance_rate_ci95"]) for m in runs]))

    few, some, many = mean_widths(4), mean_widths(16), mean_widths(64)
    for k in range(2):  # speedup, acceptance
        assert few[k] > some[k] > many[k] and many[k] < 0.5 * few[k]


def unpaired_speedup_ci(records: list[dict]) -> list[float]:
    """Method and AR requests resampled independently: what the bootstrap would give without pairing."""
    spec = [r for r in records if r["method"] == "speculative"]
    ar = [r for r in records if r["method"] == "autoregressive"]
    tok_m, sec_m = (np.array([len(r["tokens"]) for r in spec]), np.array([r["time_s"] for r in spec]))
    tok_ar, sec_ar = (np.array([len(r["tokens"]) for r in ar]), np.array([r["time_s"] for r in ar]))

    def statistic(i_m, i_ar, axis=-1):
        i_m, i_ar = i_m.astype(int), i_ar.astype(int)
        return speedup_stat(tok_m[i_m], sec_m[i_m], tok_ar[i_ar], sec_ar[i_ar], axis=axis)

    index = np.arange(len(spec), dtype=float)
    res = bootstrap((index, index), statistic, paired=False, vectorized=True, method="percentile",
                    n_resamples=N_RESAMPLES, rng=np.random.default_rng(0))
    return [float(res.confidence_interval.low), float(res.confidence_interval.high)]


def test_pairing_narrows_the_ci_when_method_and_ar_times_are_correlated():
    records = make_records(24, seed=2, spread=0.8, jitter=0.03)
    paired = M.summarize(records, greedy=False)["speculative"]["speedup_ci95"]
    unpaired = unpaired_speedup_ci(records)
    assert width(paired) < 0.25 * width(unpaired)
    assert paired[0] > 1.0 and unpaired[0] < 1.0  # pairing is what makes the gain visible at all


def test_within_noise_and_clearly_different_are_told_apart():
    records = make_records(16, seed=3, jitter=0.15, others={"hf_assisted": 1.5, "hf_generate": 0.9})
    out = M.summarize(records, greedy=False)
    same = out["comparisons"]["speculative_vs_hf_assisted"]
    assert same["within_noise"] is True and same["ci95"][0] < 1.0 < same["ci95"][1]
    different = out["comparisons"]["speculative_vs_hf_generate"]
    assert different["within_noise"] is False and different["ci95"][0] > 1.0
    assert different["ratio"] == pytest.approx(out["speculative"]["speedup"] / out["hf_generate"]["speedup"])
    metrics = {"domains": {"chat": out}, "overall": out, "temperature": 0.0}
    lines = comparison_lines(metrics)
    assert any("HF assisted (HF defaults) are within noise" in line for line in lines)
    assert any("faster than HF generate beyond noise" in line for line in lines)


def test_fewer_than_two_requests_gives_null_ci_and_the_report_says_so():
    out = M.summarize(make_records(1, others={"hf_assisted": 1.2}), greedy=True)
    assert out["speculative"]["speedup_ci95"] is None and out["speculative"]["acceptance_rate_ci95"] is None
    assert out["speedup_ci95"] is None
    assert out["comparisons"]["speculative_vs_hf_assisted"] == {
        "ratio": pytest.approx(out["speculative"]["speedup"] / out["hf_assisted"]["speedup"]),
        "ci95": None, "within_noise": None, "n_requests": 1}
    metrics = {"domains": {"chat": out}, "overall": out, "temperature": 0.0}
    assert "n<2, no CI" in text_table(*domain_rows(metrics))
    assert "too few to tell" in comparison_lines(metrics)[0]


def test_identical_requests_fall_back_to_a_defined_interval():
    records = make_records(5, jitter=0.0, spread=0.0)
    for r in records:
        r["tokens"] = [1] * 50  # every request the same: the jackknife has no spread and BCa is undefined
    spec = M.summarize(records, greedy=False)["speculative"]
    assert spec["speedup_ci95"] == pytest.approx([spec["speedup"]] * 2)


def test_build_and_tables_show_speedup_with_its_interval():
    records = make_records(6, domain="chat") + make_records(6, seed=4, domain="code", others={"hf_generate": 1.1})
    plan = {"gamma": 4, "draft_temperature": None}
    metrics = M.build(records, {"speculative": {"chat": plan, "code": plan, "default": plan}}, temperature=0.0,
                      band=BAND, min_ci_requests=2)
    overall = metrics["overall"]
    assert overall["n_requests"] == 12
    assert overall["acceptance_rate_ci95"] == overall["speculative"]["acceptance_rate_ci95"]
    assert "speculative_vs_hf_generate" in overall["comparisons"] and "comparisons" in metrics["domains"]["chat"]
    interval = re.compile(r"^\d+\.\d\d× \[\d+\.\d\d, \d+\.\d\d\]$")
    header, rows = domain_rows(metrics)
    assert all(interval.match(row[header.index("speedup")]) for row in rows)
    _, rows = method_rows(metrics)
    assert all(interval.match(row[4]) for row in rows if row[0] != "own autoregressive")
    flat = M.flat_metrics(metrics)  # lists (the intervals) stay out of the tracker's scalar keys
    assert "chat.comparisons.speculative_vs_hf_generate.ratio" not in flat
    assert "code.comparisons.speculative_vs_hf_generate.ratio" in flat and "overall.speedup_ci95" not in flat


def test_sweep_point_pairs_by_position():
    records = make_records(8, seed=5)
    spec = [r for r in records if r["method"] == "speculative"]
    ar = [r for r in records if r["method"] == "autoregressive"]
    point = M.sweep_point(spec, ar)
    lo, hi = point["speedup_ci95"]
    assert lo < point["speedup"] < hi


def test_the_control_pair_names_disturbed_requests_and_gives_the_figures_without_them():
    from eval.report import control_lines

    records = make_records(12, others={"hf_generate": 1.0, "hf_assisted": 1.2})
    assert M.control_check(records, greedy=False, band=BAND)["disturbed"] == []  # 5% jitter stays inside the band
    assert M.control_check(make_records(12), greedy=False, band=BAND) is None  # no HF generate: no control pair
    disturbed = [dict(r) for r in records]
    for r in disturbed:  # other load slows plain decoding (and only it) on request 3 threefold
        if r["prompt_id"] == "chat-3" and r["method"] == "autoregressive":
            r["time_s"] *= 3
    control = M.control_check(disturbed, greedy=False, band=BAND)
    assert control["disturbed"] == [["chat", "chat-3", 0]] and control["n_requests"] == 12
    clean = control["without_disturbed"]["speedup"]["speculative"]["speedup"]
    measured = M.summarize(disturbed, greedy=False)["speculative"]["speedup"]
    assert clean == pytest.approx(M.summarize(records, greedy=False)["speculative"]["speedup"], rel=0.05)
    assert measured > clean  # the slowed plain decoding inflated every measured speedup
    assert control["unfiltered"]["speedup"]["speculative"]["speedup"] == pytest.approx(measured)
    assert control["band"] == [0.8, 1.25]
    lines = control_lines({"control": control})
    assert "1 of 12 requests" in lines[0] and "chat chat-3 turn 0" in lines[0]
    # the unfiltered figure (every request) comes first, the filtered one beside it, both labelled
    own = lines[0].split("own speculative ", 1)[1].split(";")[0]
    assert own.index(f"{measured:.2f}× ") < own.index("unfiltered (all 12 requests)") \
        < own.index(f"{clean:.2f}× ") < own.index("filtered (without the disturbed, 11 requests)"), own
    # the band is a setting fixed before the run: a wider one keeps the threefold-slowed request, a narrow one
    # that even 5% jitter leaves filters more
    assert M.control_check(disturbed, greedy=False, band=(0.25, 4.0))["disturbed"] == []
    assert M.build(disturbed, {"speculative": {"chat": {}, "default": {"gamma": 4}}}, 1.0,
                   band=(0.25, 4.0), min_ci_requests=2)["control"]["band"] == [0.25, 4.0]
    assert len(M.control_check(records, greedy=False, band=(0.999, 1.001))["disturbed"]) > 1
    assert any(line.startswith("overall without them") for line in lines[1:])
    for r in disturbed:  # every request disturbed: nothing left to recompute on, and the report says so
        if r["method"] == "autoregressive":
            r["time_s"] *= 3
    everything = M.control_check(disturbed, greedy=False, band=BAND)
    assert len(everything["disturbed"]) == 12 and "without_disturbed" not in everything
    assert "read no timing" in control_lines({"control": everything})[0]
