"""The run-level deadline (pipeline/control/deadline.py): each budgeted loop gets its share of what the fixed work ahead
leaves, a stage's own budget only gets lower, a loop never starts an item that would end past its budget, and a
simulated run replanning from the clock ends inside the deadline on slower machines where a static split does not."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf

import pipeline.control.deadline as deadline
from pipeline.control.deadline import DeadlineSettings, RunDeadline, stage_budget_s, would_overrun
from pipeline.control.sizing import RunPlan, apply_sizes, describe_run, fixed_work_s, plan_run, sized_values
from pipeline.errors import PipelineError
from tests.conftest import SHIPPED

DEFAULT_DEADLINE = OmegaConf.to_container(SHIPPED.deadline)
COMPOSED = SHIPPED.composed  # the whole shipped config: the sizes a run is sized from
SETTINGS = DeadlineSettings(minutes=15, margin=0.25, shares={"collect": 0.4, "distill": 0.3, "eval": 0.3},
                            fixed_passes={"collect": 1500, "distill": 8000, "eval": 5000}, overshoot_passes=0.0,
                            min_minutes={}, smallest_passes={})


def test_a_budget_is_its_share_of_what_the_fixed_work_ahead_leaves():
    collect = stage_budget_s(SETTINGS, "collect", left_s=900, unit_s=0.02)
    assert collect["fixed_s"] == pytest.approx(0.02 * 14500 * 1.25)  # priced dearer by the margin
    assert collect["budget_s"] == pytest.approx(0.4 * (900 - 362.5))
    distill = stage_budget_s(SETTINGS, "distill", left_s=600, unit_s=0.02)  # collect is behind: 0.3 of 0.6
    assert distill["budget_s"] == pytest.approx(0.5 * (600 - 1.25 * 0.02 * 13000))
    last = stage_budget_s(SETTINGS, "eval", left_s=300, unit_s=0.02)  # the last loop gets all that is left
    assert last["budget_s"] == pytest.approx(300 - 125)
    held = dataclasses.replace(SETTINGS, overshoot_passes=500)  # a loop's last item may end past its budget
    assert stage_budget_s(held, "eval", left_s=300, unit_s=0.02)["budget_s"] == pytest.approx(300 - 125 - 10)
    starved = stage_budget_s(SETTINGS, "eval", left_s=60, unit_s=0.02)
    assert starved["flexible_s"] < 0 and starved["budget_s"] == 0


def test_no_loop_gets_less_than_its_smallest_useful_minutes():
    floored = dataclasses.replace(SETTINGS, min_minutes={"collect": 1, "distill": 3, "eval": 2})
    collect = stage_budget_s(floored, "collect", left_s=900, unit_s=0.02)  # its share is above its floor
    assert collect["budget_s"] == pytest.approx(0.4 * (900 - 362.5))
    tight = stage_budget_s(floored, "collect", left_s=700, unit_s=0.02)  # its share would eat the later floors
    assert tight["budget_s"] == pytest.approx(700 - 290 - 300)  # kept out of the expected fixed work (290 s)
    starved = stage_budget_s(floored, "distill", left_s=100, unit_s=0.02)
    assert starved["budget_s"] == 180  # the smallest useful training, even where the clock has run out


def test_the_fixed_work_is_priced_on_the_line_from_its_smallest_to_its_shipped_sizes():
    settings = dataclasses.replace(SETTINGS, smallest_passes={"eval": 1000}, min_scale=0.2, overshoot_passes=100)
    assert deadline.fixed_passes(settings, ["eval"], 1.0) == 5000
    assert deadline.fixed_passes(settings, ["eval"], 0.6) == pytest.approx(3000)  # halfway along
    assert deadline.fixed_passes(settings, ["eval"], 0.1) == deadline.fixed_passes(settings, ["eval"], 0.2) == 1000
    at_half = stage_budget_s(settings, "eval", left_s=300, unit_s=0.02, scale=0.6)  # the overshoot shrinks too
    assert at_half["fixed_s"] == pytest.approx(0.02 * (3000 * 1.25 + 60))


def test_a_stage_budget_only_ever_gets_lower_and_is_recorded():
    cfg = OmegaConf.create({"collect": {"max_minutes": 5}, "distill": {"checkpoint": {"max_train_minutes": None}},
                            "eval": {"max_minutes": 0.5}})
    clock = RunDeadline(SETTINGS)
    fast, plan = clock.apply(cfg, "collect", unit_s=0.001)  # a fast machine: the share exceeds the own 5 minutes
    assert fast.collect.max_minutes == 5 and plan["own_minutes"] == 5 and cfg.collect.max_minutes == 5
    slow, plan = clock.apply(cfg, "collect", unit_s=0.03)
    assert slow.collect.max_minutes == plan["minutes"] < 5 and cfg.collect.max_minutes == 5  # a copy, not cfg
    open_ended, plan = clock.apply(cfg, "distill", unit_s=0.03)  # null (no limit of its own) takes the share
    assert open_ended.distill.checkpoint.max_train_minutes == pytest.approx(plan["budget_s"] / 60, abs=1e-3)
    kept, _ = clock.apply(cfg, "eval", unit_s=0.03)
    assert kept.eval.max_minutes == 0.5
    assert "collect.max_minutes" in deadline.describe(clock.apply(cfg, "collect", 0.03)[1])


def test_no_item_starts_that_would_end_past_the_budget(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(deadline.time, "time", lambda: now[0])
    started = 40.0  # 60 s spent on 3 items: 20 s each
    assert would_overrun(started, 3, budget_minutes=1.2)       # 60 + 20 > 72
    assert not would_overrun(started, 3, budget_minutes=1.4)   # 60 + 20 <= 84
    assert not would_overrun(started, 3, budget_minutes=None)
    assert not would_overrun(started, 3, budget_minutes=0.01, first_round=6)  # the first round always runs
    assert not would_overrun(started, 0, budget_minutes=0.01)


@pytest.mark.parametrize("bad", [{"minutes": 0}, {"minutes": "soon"}, {"minutes": 15, "margin": -0.1},
                                 {"minutes": 15, "overshoot_passes": -1}, {"fixed_share": 0}, {"min_scale": 1.5},
                                 {"when_short": "later"}, {"min_minutes": {"distill": -1}},
                                 {"sized": {"eval.max_new_tokens": 0}}, {"steeper": {"eval.gammas": 2}},
                                 {"minutes": 15, "shares": {"collect": 0, "distill": 0, "eval": 0}}])
def test_bad_settings_are_one_clear_error(bad):
    with pytest.raises(PipelineError, match="deadline"):
        DeadlineSettings.from_cfg(OmegaConf.create({"deadline": {**DEFAULT_DEADLINE, **bad}}))


# ----------------------------------------------------------------------------- a simulated run

NEEDS_S = {"collect": 190, "distill": 123, "calibrate": 0, "eval": 117}  # the loops' full length on the default
ITEM_S = {"collect": 8, "distill": 0.5, "calibrate": 0, "eval": 6}  # run's machine; one shard, training step, prompt there
                                                                    # (calibrate has no loop: fixed work only)
UNIT_S = 0.022                                           # its target verify pass


DEFAULTS = DeadlineSettings.from_cfg(OmegaConf.create({"deadline": SHIPPED.deadline}))  # what a default run plans with


def simulate(planner, slowdown: float, misjudged: float = 1.0) -> tuple[float, RunPlan]:
    """Wall seconds of a run on a machine `slowdown` times slower, sized to it first (sizing.plan_run: the fixed work
    shrinks with the scale), whose fixed work is `misjudged` times what deadline.fixed_passes says; each loop runs
    until its budget stops it (an item that would end past it does not start), plus half an item of jitter."""
    unit_s, clock_s = UNIT_S * slowdown, 25.0 * slowdown  # prepare, model loading, the dtype probe
    plan = plan_run(DEFAULTS, COMPOSED, unit_s, clock_s)
    for stage in deadline.STAGES:  # items shrink with the sizes (shards with the scale squared, requests by half)
        budget_s = planner(stage, clock_s, unit_s, plan)
        clock_s += min(NEEDS_S[stage] * slowdown, budget_s) + ITEM_S[stage] * slowdown * plan.scale / 2
        clock_s += misjudged * deadline.fixed_passes(DEFAULTS, [stage], plan.scale) * unit_s
    return clock_s, plan


def replanned(stage: str, clock_s: float, unit_s: float, plan: RunPlan) -> float:
    return stage_budget_s(DEFAULTS, stage, 60 * plan.minutes - clock_s, unit_s, plan.scale)["budget_s"]


def static_split(stage: str, clock_s: float, unit_s: float, plan: RunPlan) -> float:
    """The deliberately wrong planner: the deadline split once by shares, blind to the fixed work and the clock."""
    return DEFAULTS.shares[stage] * 60 * DEFAULTS.minutes


@pytest.mark.parametrize("slowdown", [1.0, 2.0, 3.0, 5.0])
@pytest.mark.parametrize("misjudged", [0.8, 1.0, 1.1])
def test_a_run_sized_to_the_machine_ends_inside_the_deadline(slowdown, misjudged):
    # a planted slow step: up to five times the default run's machine's pass (the slow stand-in's 116 ms), the fixed
    # work misjudged (the measured runs came in at or under the estimate: docs/results.md). Every loop here runs to its
    # whole budget; collect's keeps the later loops' floors out of the fixed work's expected time, not its margin, so
    # fixed work over its estimate may pass the deadline, by less than the 5% the first run allows at 10% over
    wall_s, plan = simulate(replanned, slowdown, misjudged)
    allowed_s = 60 * DEFAULTS.minutes * (1.05 if misjudged > 1 else 1.0)
    assert not plan.short and plan.minutes == DEFAULTS.minutes and wall_s <= allowed_s
    assert (plan.scale == 1.0) == (slowdown == 1.0) and plan.scale >= DEFAULTS.min_scale


def test_unsized_the_same_slow_machine_overruns():
    # the deliberately wrong plan: the shipped sizes on the 5x machine (the scale left at 1)
    unsized = lambda stage, clock_s, unit_s, plan: replanned(stage, clock_s, unit_s, dataclasses.replace(plan, scale=1))
    unit_s = UNIT_S * 5
    clock_s = 125.0
    for stage in deadline.STAGES:
        clock_s += min(NEEDS_S[stage] * 5, unsized(stage, clock_s, unit_s, plan_run(DEFAULTS, COMPOSED, unit_s, 125)))
        clock_s += DEFAULTS.fixed_passes[stage] * unit_s
    assert clock_s > 60 * DEFAULTS.minutes


def test_the_static_split_overruns_on_a_slower_machine():
    assert simulate(static_split, 1.0)[0] <= 60 * DEFAULTS.minutes  # where the default run was sized, both fit
    assert simulate(static_split, 2.0)[0] > 60 * DEFAULTS.minutes


def test_a_machine_too_slow_for_the_smallest_run_says_so_first_and_extends_or_stops():
    unit_s = UNIT_S * 12
    plan = plan_run(DEFAULTS, COMPOSED, unit_s, 60)
    needed = (60 + fixed_work_s(DEFAULTS, unit_s, DEFAULTS.min_scale) + 60 * sum(DEFAULTS.min_minutes.values())) / 60
    assert plan.short and plan.scale == DEFAULTS.min_scale and plan.minutes == pytest.approx(needed)
    first = describe_run(plan, DEFAULTS, "a slow CPU")[0]
    assert "needs ≈" in first and "deadline.when_short=stop" in first and f"{math.ceil(needed)}" in first
    with pytest.raises(PipelineError, match=f"deadline.minutes={math.ceil(needed)}"):
        plan_run(dataclasses.replace(DEFAULTS, when_short="stop"), SHIPPED, unit_s, 60)


def test_sizes_shrink_with_the_scale_down_to_their_smallest_and_never_grow():
    sizes = sized_values(DEFAULTS, COMPOSED, 0.5)
    assert sizes["collect.shard_size"] == 8 and sizes["eval.max_new_tokens"] == 32  # shards with the scale squared
    assert sizes["distill.split.heldout_max_prompts_per_domain"] == DEFAULTS.sized[
        "distill.split.heldout_max_prompts_per_domain"]  # 64 prompts x 0.15 = 10 held out, halved, floored
    assert sized_values(DEFAULTS, COMPOSED, 1.0) == {}  # as shipped: nothing set
    smaller = OmegaConf.merge(COMPOSED, {"collect": {"shard_size": 2}})  # a user's value below the floor stays
    assert "collect.shard_size" not in sized_values(DEFAULTS, smaller, 0.1)
    sized = apply_sizes(COMPOSED, plan_run(DEFAULTS, COMPOSED, UNIT_S * 5, 60))
    assert sized.collect.shard_size < COMPOSED.collect.shard_size and sized.eval.max_new_tokens == 32


def test_the_fixed_work_is_priced_in_the_probed_verify_pass_not_the_1_token_step(monkeypatch, tmp_path):
    # the two differ by day on one machine (25 / 33 ms and 53 / 44 ms): the unit must be the pass the probe timed
    import pipeline.modelio.dtype as dtype
    import pipeline.modelio.models as models

    monkeypatch.setattr(models, "resolve_model", lambda *a, **k: tmp_path)
    monkeypatch.setattr(models, "resolve_device", lambda *a, **k: (torch.device("cpu"), torch.bfloat16))
    monkeypatch.setattr(dtype, "cpu_timings", lambda *a, **k: {"dtype": "bfloat16",
                                                               "bfloat16": {"step_ms": 53.0, "verify5_ms": 44.0},
                                                               "float32": {"step_ms": 72.0, "verify5_ms": 99.0}})
    cfg = OmegaConf.create({"model": {"target": {}}, "paths": {"models": str(tmp_path)}, "runtime": {}})
    assert deadline.verify_pass_seconds(cfg) == pytest.approx(0.044)


def test_a_rerun_after_a_crash_gets_the_same_sizes():
    # the first run paid a minute for the model and the probe, the rerun none (its pass read from the probe's cache)
    first, rerun = plan_run(DEFAULTS, COMPOSED, UNIT_S * 3, 60), plan_run(DEFAULTS, COMPOSED, UNIT_S * 3, 1)
    assert first.sizes == rerun.sizes and first.scale == rerun.scale < 1
