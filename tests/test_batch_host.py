"""The batched loop's own host work per pass (pipeline/measure/batch_profile.py): measured per batch size through the batched
decoder, carried by batch_cost into the one cost model, recorded in speculative.json, and priced by the batch sweep's
prediction (eval/sweeps.py); a prediction that leaves it out is caught."""
from __future__ import annotations

import time

import pytest

from distill import batch_sizes
from eval import sweeps as bench_batch
from pipeline.measure import batch_profile
from pipeline.measure.batch_profile import CHAINS, BatchPlan, batch_cost, host_block, measure_batch_profile, validate
from pipeline.decoding import cost as cost_module
from pipeline.decoding.cost import pass_speedup
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling

GAMMAS = (1, 2, 3, 4)
PER_POSITION = {"overall": [0.8 ** k for k in range(1, 9)]}
STEP = 10.0  # ms of the 1-token target step in the constructed profiles
SLOPE = {1: 0.01, 2: 0.05, 4: 0.2}  # a verify of k tokens per row costs 1 + slope·(k − 1) steps
# host steps per pass: a speculative pass does more of it than a plain one, and more as B grows
HOST = {b: {"plain": 0.02 * b, "chain": {"1": 0.1 * b, "4": 0.2 * b}} for b in SLOPE}


def constructed_profile(host: dict | None = HOST) -> dict:
    profile = {"version": 1, "machine": {"device": "cpu"}, "context": 96, "repeats": 1,
               "target": {str(b): {str(k): STEP * (1 + s * (k - 1)) for k in range(1, 10)} for b, s in SLOPE.items()},
               "draft": {str(b): STEP * 0.1 for b in SLOPE}}
    return profile if host is None else {**profile, "host": {str(b): h for b, h in host.items()}}


def zero_host() -> dict:
    return {b: {"plain": 0.0, "chain": {str(g): 0.0 for g in CHAINS}} for b in SLOPE}


def by_formula(accepted: float, gamma: int, cost: dict) -> float:
    """(1 + A)(1 + h_0) / (γc + r(γ) + h(γ)) written out, h interpolated between the measured chains."""
    host = cost["host"]
    (n0, h0), (n1, h1) = ((int(n), h) for n, h in sorted(host["chain"].items(), key=lambda kv: int(kv[0])))
    h = h0 + (h1 - h0) * (gamma - n0) / (n1 - n0)
    r = cost["verify_ratio"][gamma]
    return (1 + accepted) * (1 + host["plain"]) / (gamma * cost["c"] + r + h)


def test_the_profile_has_a_host_block_per_batch_size_with_nonnegative_steps(target, close_draft):
    plan = BatchPlan((1, 2), (2,), repeats=1, context=8, sampling=Sampling(0.7), host_rounds=1)
    profile = measure_batch_profile(target, close_draft, plan, time.perf_counter)
    validate(profile, "profile")
    assert set(profile["host"]) == {"1", "2"} and profile["host_settings"]["sampling"]["temperature"] == 0.7
    for size in ("1", "2"):
        block = profile["host"][size]
        assert set(block["chain"]) == {str(g) for g in CHAINS}
        assert all(x >= 0 for x in [block["plain"], *block["chain"].values()])
        assert batch_cost(profile, int(size))["host"] == block
    assert {str(g + 1) for g in CHAINS} <= set(profile["target"]["1"])  # the host chains' forwards are priced


def test_host_steps_are_the_call_time_less_the_forwards_it_ran_per_pass():
    cost = batch_cost(constructed_profile(None), 2)
    prefill_ms, host_steps = 55.0, 0.3

    def call(drafted):  # seconds of a call: one fixed cost, then each pass's forwards and its host work
        ms = prefill_ms + sum(batch_profile.forwards_ms([d], cost) + host_steps * STEP for d in drafted)
        return ms / 1e3, drafted

    short, long = [0, 0, 4, 4], [0, 0, 4, 4, 4, 4, 4, 2]
    times = {None: [[call([0] * 8), call([0] * 40)]], **{g: [[call(short), call(long)]] for g in CHAINS}}
    block = host_block(times, cost)
    assert block["plain"] == pytest.approx(host_steps, abs=1e-3)
    assert all(h == pytest.approx(host_steps, abs=1e-3) for h in block["chain"].values())
    times[None] = [[call([0] * 8), (call([0] * 40)[0] - 1.0, [0] * 40)]]  # a long call faster than its forwards
    assert host_block(times, cost)["plain"] == 0.0  # clamped: host work is never negative


def test_batch_cost_carries_the_host_block_and_a_profile_without_one_prices_it_at_zero():
    assert batch_cost(constructed_profile(), 4)["host"] == HOST[4]
    assert "host" not in batch_cost(constructed_profile(None), 4)
    validate(constructed_profile(None), "old profile")  # before host work was timed: still a valid profile
    broken = constructed_profile()
    del broken["host"]["2"]
    with pytest.raises(PipelineError, match="batch size 2 lacks its host block") as error:
        validate(broken, "profile")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("size", sorted(SLOPE))
def test_priced_host_work_lowers_the_prediction_and_zero_host_changes_nothing(size):
    with_host, without = batch_cost(constructed_profile(), size), batch_cost(constructed_profile(None), size)
    zero = batch_cost(constructed_profile(zero_host()), size)
    for gamma in GAMMAS:
        accepted = sum(PER_POSITION["overall"][:gamma])
        priced, forwards_only = pass_speedup(accepted, gamma, gamma, with_host), pass_speedup(accepted, gamma, gamma,
                                                                                              without)
        assert priced < forwards_only
        assert priced == pytest.approx(by_formula(accepted, gamma, with_host))
        assert pass_speedup(accepted, gamma, gamma, zero) == pytest.approx(forwards_only)


def test_the_formula_check_fails_when_pass_speedup_ignores_host_work(monkeypatch):
    monkeypatch.setattr(cost_module, "host_cost", lambda host, drafted, tree=False: (0.0, 0.0))
    cost = batch_cost(constructed_profile(), 2)
    assert pass_speedup(1.6, 2, 2, cost) != pytest.approx(by_formula(1.6, 2, cost))


def test_speculative_json_records_the_host_work_and_both_predictions():
    block = batch_sizes.choose(PER_POSITION, constructed_profile(), GAMMAS, 0.05)
    for size in SLOPE:
        record = block["cost"]["by_batch"][str(size)]
        assert record["host"] == HOST[size]
        gamma = block["gamma_if_on"]["default"][str(size)]
        assert block["predicted_speedup"]["default"][str(size)] == pytest.approx(
            by_formula(sum(PER_POSITION["overall"][:gamma]), gamma, batch_cost(constructed_profile(), size)), abs=1e-3)
        no_host = block["predicted_speedup_no_host"]["default"][str(size)]
        assert block["predicted_speedup"]["default"][str(size)] < no_host
    old = batch_sizes.choose(PER_POSITION, constructed_profile(None), GAMMAS, 0.05)
    zero = batch_sizes.choose(PER_POSITION, constructed_profile(zero_host()), GAMMAS, 0.05)
    assert zero["predicted_speedup"] == old["predicted_speedup"] == old["predicted_speedup_no_host"]
    assert "host" not in old["cost"]["by_batch"]["1"]


def test_the_batch_sweep_predicts_through_batch_cost_with_and_without_host(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_batch, "measure_batch_profile", lambda *a, **k: constructed_profile())
    monkeypatch.setattr(bench_batch, "batch_cost", lambda p, size: calls.append(size) or batch_cost(p, size))
    measured = {size: {"accepted": 30, "drafting_passes": 20} for size in SLOPE}
    predicted = bench_batch.predict_from_profile(None, None, measured, {1: 2, 2: 2, 4: 2}, None, Sampling(0.0),
                                                 time.perf_counter)
    assert sorted(calls) == sorted(SLOPE)
    for size, p in predicted.items():
        assert p["predicted"] == pytest.approx(by_formula(1.5, 2, batch_cost(constructed_profile(), size)))
        assert p["no_host"] == pytest.approx(pass_speedup(1.5, 2, 2, batch_cost(constructed_profile(None), size)))
        assert p["predicted"] < p["no_host"]


def test_the_batch_sweep_reads_both_predictions_from_a_calibrated_export():
    block = batch_sizes.choose(PER_POSITION, constructed_profile(), GAMMAS, 0.05)
    predicted = bench_batch.predict_calibrated(block, sorted(SLOPE))
    for size, p in predicted.items():
        assert p["predicted"] == block["predicted_speedup"]["default"][str(size)]
        assert p["no_host"] == block["predicted_speedup_no_host"]["default"][str(size)]
    old = {k: v for k, v in block.items() if k != "predicted_speedup_no_host"}  # calibrated before host was timed
    assert bench_batch.predict_calibrated(old, [1])[1]["no_host"] is None
