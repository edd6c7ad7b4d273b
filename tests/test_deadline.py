"""The run-level deadline (pipeline/control/deadline.py): each budgeted loop gets its share of what the fixed work ahead
leaves, a stage's own budget only gets lower, a loop never starts an item that would end past its budget, and a
simulated run replanning from the clock ends inside the deadline on slower machines where a static split does not."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

import pipeline.control.deadline as deadline
from pipeline.control.deadline import DeadlineSettings, RunDeadline, stage_budget_s, would_overrun
from pipeline.errors import PipelineError
from tests.conftest import SHIPPED

DEFAULT_DEADLINE = OmegaConf.to_container(SHIPPED.deadline)
SETTINGS = DeadlineSettings(minutes=15, margin=0.25, shares={"collect": 0.4, "distill": 0.3, "eval": 0.3},
                            fixed_passes={"collect": 1500, "distill": 8000, "eval": 5000}, overshoot_passes=0.0)


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
    assert starved["flexible_s"] < 0 and starved["budget_s"] == 60 * deadline.FLOOR_MINUTES


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
                                 {"minutes": 15, "overshoot_passes": -1},
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


def replanned(stage: str, clock_s: float, unit_s: float) -> float:
    return stage_budget_s(DEFAULTS, stage, 60 * DEFAULTS.minutes - clock_s, unit_s)["budget_s"]


def static_split(stage: str, clock_s: float, unit_s: float) -> float:
    """The deliberately wrong planner: the deadline split once by shares, blind to the fixed work and the clock."""
    return DEFAULTS.shares[stage] * 60 * DEFAULTS.minutes


def simulate(planner, slowdown: float, misjudged: float = 1.0) -> float:
    """Wall seconds of a run on a machine `slowdown` times slower, whose fixed work is `misjudged` times what
    deadline.fixed_passes says; each loop runs until its budget stops it (an item that would end past it does not
    start), plus half an item of jitter."""
    unit_s, clock_s = UNIT_S * slowdown, 25.0 * slowdown  # prepare and model loading
    for stage in deadline.STAGES:
        budget_s = planner(stage, clock_s, unit_s)
        clock_s += min(NEEDS_S[stage] * slowdown, budget_s) + ITEM_S[stage] * slowdown / 2
        clock_s += misjudged * DEFAULTS.fixed_passes[stage] * unit_s
    return clock_s


@pytest.mark.parametrize("slowdown", [1.0, 1.5, 2.0])
@pytest.mark.parametrize("misjudged", [0.8, 1.0, 1.2])
def test_a_run_replanned_from_the_clock_ends_inside_the_deadline(slowdown, misjudged):
    # up to twice the default run's machine time per pass, with the fixed work misjudged by 20% either way (calibrate
    # measured 3,800-5,300 passes on three days). Much slower machines run out of
    # deadline on the fixed work alone, whatever the split
    assert simulate(replanned, slowdown, misjudged) <= 60 * DEFAULTS.minutes


def test_the_static_split_overruns_on_a_slower_machine():
    assert simulate(static_split, 1.0) <= 60 * DEFAULTS.minutes  # where the default run was sized, both fit
    assert simulate(static_split, 2.0) > 60 * DEFAULTS.minutes


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
