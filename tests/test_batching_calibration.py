"""The draft length per batch size (distill/batch_sizes.py): γ shrinks as the target's batched verify gets dearer and
is off from the break-even batch on, speculative.json carries it, vLLM gets the same schedule, bad input is one line."""
from __future__ import annotations

import time

import pytest

from distill import batch_sizes
from pipeline.measure.batch_profile import CHAINS, BatchPlan, batch_cost, break_even, measure_batch_profile, validate
from pipeline.decoding.cost import pass_speedup
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from pipeline.decoding.spec import SpeculativeSpec
from tests.conftest import SHIPPED, read_spec

GAMMAS = (1, 2, 3, 4, 5, 6)
MARGIN = 0.05
ALPHA = 0.8
# P_k = α^k: the chance the first k drafts of a block are accepted (i.i.d. acceptance)
PER_POSITION = {"overall": [ALPHA ** k for k in range(1, 9)], "code": [0.9 ** k for k in range(1, 9)]}
# a verify of k tokens per row costs 1 + slope·(k − 1) target steps: memory-bound at B = 1, compute-bound at 16
SLOPE = {1: 0.01, 2: 0.05, 4: 0.2, 8: 0.6, 16: 1.5}


def constructed_profile(draft_c: float = 0.1) -> dict:
    step = 10.0
    return {"version": 1, "machine": {"device": "cpu"}, "context": 96, "repeats": 1,
            "target": {str(b): {str(k): step * (1 + s * (k - 1)) for k in range(1, 10)} for b, s in SLOPE.items()},
            "draft": {str(b): step * draft_c for b in SLOPE}}


def policy_problems(block: dict, profile: dict) -> list[str]:
    """What a per-batch-size choice gets wrong, priced afresh at every B with the one cost model."""
    problems = []
    for domain, per_position in PER_POSITION.items():
        name = "default" if domain == "overall" else domain
        speedups = {}
        for size in SLOPE:
            cost = batch_cost(profile, size)
            best, gamma = max((pass_speedup(sum(per_position[:g]), g, g, cost), g) for g in GAMMAS)
            speedups[size] = best
            want = gamma if best >= 1 + MARGIN else 0
            if block["by_domain"][name][str(size)] != want:
                problems.append(f"{name} B={size}: γ {block['by_domain'][name][str(size)]}, want {want}")
        if block["break_even"][name] != break_even(speedups):
            problems.append(f"{name}: break-even {block['break_even'][name]}, want {break_even(speedups)}")
    return problems


def test_gamma_shrinks_as_the_batch_grows_and_is_off_from_the_break_even_batch():
    profile = constructed_profile()
    block = batch_sizes.choose(PER_POSITION, profile, GAMMAS, MARGIN)
    assert policy_problems(block, profile) == []
    for name in ("default", "code"):
        gammas = [block["by_domain"][name][str(b)] for b in sorted(SLOPE)]
        assert gammas == sorted(gammas, reverse=True) and gammas[0] > gammas[-1]
        edge = block["break_even"][name]
        assert edge is not None and all(block["by_domain"][name][str(b)] == 0 for b in SLOPE if b >= edge)
        assert all(block["by_domain"][name][str(b)] > 0 for b in SLOPE if b < edge)
    assert block["by_domain"]["default"]["1"] > block["by_domain"]["default"]["4"]


def test_the_check_rejects_a_chooser_that_ignores_the_batch_size(monkeypatch):
    profile = constructed_profile()
    real = batch_sizes.batch_cost
    monkeypatch.setattr(batch_sizes, "batch_cost", lambda p, size: real(p, 1))  # every B priced as B = 1
    wrong = batch_sizes.choose(PER_POSITION, profile, GAMMAS, MARGIN)
    assert wrong["by_domain"]["default"]["16"] > 0
    assert policy_problems(wrong, profile)


def test_break_even_is_where_speculation_stops_paying_as_the_batch_grows():
    assert break_even({1: 0.7, 2: 1.1, 4: 0.9, 8: 0.8}) == 4  # a loss at B = 1 alone is not the break-even
    assert break_even({1: 1.3, 2: 1.2}) is None
    assert break_even({1: 0.9, 2: 0.8}) == 1


def spec_with(per_position=PER_POSITION, engines=None) -> SpeculativeSpec:
    return SpeculativeSpec({"name": "tiny"}, Sampling(0.7), {"init": "random"},
                           per_position_acceptance=per_position, engines=engines or {})


def test_the_batching_block_round_trips_through_speculative_json(tmp_path):
    spec = batch_sizes.with_batching(spec_with(), constructed_profile(), GAMMAS, MARGIN)
    spec.write(tmp_path)
    back = SpeculativeSpec.read(tmp_path)
    assert back.batching == spec.batching == read_spec(tmp_path)["batching"]
    table = back.batching["by_domain"]["default"]
    assert back.gamma_for_batch("default", 4) == table["4"]
    assert back.gamma_for_batch("default", 3) == table["4"]  # between two measured B: the larger one's setting
    assert back.gamma_for_batch("default", 64) == table["16"]
    assert back.gamma_for_batch("unseen-domain", 1) == table["1"]
    assert spec_with().gamma_for_batch("default", 1) is None  # not calibrated for batches


def test_vllm_gets_the_same_schedule_as_inclusive_ranges_from_one():
    assert batch_sizes.vllm_schedule({"1": 3, "2": 3, "4": 1, "8": 0, "16": 0}, 2) == [[1, 2, 2], [3, 4, 1], [5, 16, 0]]
    engines = {"vllm": {"speculative_config": {"code": {"model": ".", "method": "draft_model",
                                                        "num_speculative_tokens": 4}, "default": None}}}
    spec = batch_sizes.with_batching(spec_with(engines=engines), constructed_profile(), GAMMAS, MARGIN)
    configs = spec.engines["vllm"]["speculative_config"]
    assert configs["default"] is None  # a domain served without the draft stays so
    schedule = configs["code"]["num_speculative_tokens_per_batch_size"]
    assert schedule[0][0] == 1 and schedule[-1][2] == 0 and all(k <= 4 for _, _, k in schedule)
    assert all(a[1] + 1 == b[0] for a, b in zip(schedule, schedule[1:]))  # vLLM: sorted, non-overlapping


def test_tensorrt_llm_gets_thresholds_and_none_where_its_smallest_key_would_not_be_max_draft_len():
    from pipeline.engines.rules import unknown_keys

    assert batch_sizes.trtllm_schedule({"4": 1, "1": 3, "2": 3, "8": 0}, 3) == {"1": 3, "2": 3, "4": 1, "8": 0}
    assert batch_sizes.trtllm_schedule({"1": 3, "2": 1}, 2) == {"1": 2, "2": 1}  # clamped to max_draft_len
    assert batch_sizes.trtllm_schedule({"1": 1, "2": 0}, 3) is None  # TensorRT-LLM would refuse schedule[1] != 3
    engines = {"trtllm": {"speculative_config": {"code": {"decoding_type": "Draft_Target", "max_draft_len": 4,
                                                          "speculative_model": ".", "use_rejection_sampling": True},
                                                 "default": None}}}
    spec = batch_sizes.with_batching(spec_with(engines=engines), constructed_profile(), GAMMAS, MARGIN)
    configs, table = spec.engines["trtllm"]["speculative_config"], spec.batching["by_domain"]["code"]
    assert configs["default"] is None and int(table["1"]) >= 4  # B = 1 drafts at least k here: the schedule is written
    assert configs["code"]["draft_len_schedule"] == batch_sizes.trtllm_schedule(table, 4)
    assert unknown_keys("trtllm", configs["code"]) == []


def test_a_profile_measured_on_tiny_models_prices_every_batch_size(target, close_draft):
    profile = measure_batch_profile(target, close_draft, BatchPlan((1, 2), (2, 3), repeats=1, context=8),
                                    time.perf_counter)
    validate(profile, "profile")
    cost = batch_cost(profile, 2)
    assert cost["c"] > 0 and set(cost["verify_ratio"]) == {1, 2, *CHAINS}  # the host chains' verifies are timed too
    assert set(cost["host"]) == {"plain", "chain"}
    with pytest.raises(PipelineError, match="no batch size 4"):
        batch_cost(profile, 4)


@pytest.mark.parametrize("sizes, ok", [([], True), (None, True), ([1, 4], True), ([0], False), ([2.5], False)])
def test_settings_take_batch_sizes_from_conf_and_refuse_a_size_below_one(sizes, ok):
    from omegaconf import OmegaConf

    from distill.settings import DistillSettings

    cfg = OmegaConf.create({"distill": SHIPPED.distill,
                            "calibrate": SHIPPED.calibrate})
    cfg.calibrate.batch_sizes = sizes
    if ok:
        assert DistillSettings.from_config(cfg, "calibrate").calibration.batch_sizes == tuple(sizes or ())
    else:
        with pytest.raises(PipelineError, match="calibrate.batch_sizes"):
            DistillSettings.from_config(cfg, "calibrate")


def test_the_distill_step_runs_only_when_batch_sizes_are_set(target, close_draft):
    from types import SimpleNamespace

    def inputs(sizes):
        calibration = SimpleNamespace(batch_sizes=sizes, gammas=(1, 2), speculate_margin=MARGIN,
                                      cost=SimpleNamespace(repeats=1))
        return SimpleNamespace(settings=SimpleNamespace(calibration=calibration), target=target, draft=close_draft)

    split, spec = SimpleNamespace(vocab=None), spec_with()
    assert batch_sizes.calibrate_batching(inputs(()), split, spec, print) is spec
    calibrated = batch_sizes.calibrate_batching(inputs((1, 2)), split, spec, print)
    assert calibrated.batching["batch_sizes"] == [1, 2] and set(calibrated.batching["by_domain"]) == {"default", "code"}
