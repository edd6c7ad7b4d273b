"""The run sized to the machine before it starts (`stage=all` with `deadline.minutes`). The fixed work of a run (the
held-out passes, the cost profile, the calibrations, eval's fidelity check) is priced in target verify passes, so on a
machine whose pass is three times slower it takes three times as long and, at the shipped sizes, left no time for
collecting or training (docs/results.md, "The first run on any machine"). So the run measures the pass first and picks
a scale: the shipped sizes where the fixed work fits in `deadline.fixed_share` of the deadline, else every setting of
`deadline.sized` shrunk in proportion (never below its smallest), so collect, training and eval each keep at least
their `deadline.min_minutes`. Where even the smallest sizes cannot fit, the first line says so and the run either
takes the time it needs or stops (`deadline.when_short`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from pipeline.control.deadline import BUDGET_KEYS, STAGES, DeadlineSettings, stage_budget_s
from pipeline.errors import PipelineError

HELDOUT_CAP = "distill.split.heldout_max_prompts_per_domain"
SCALE_STEPS = 20  # the scale's grid, coarse: a pass timed again (a GPU's, not cached) mostly lands on the same sizes


@dataclass(frozen=True)
class RunPlan:
    """What the run was sized to: the pass it measured, the scale, the deadline it keeps, the sizes it set."""
    unit_s: float                 # the target's 5-token verify pass here
    scale: float                  # of the shipped sizes, in (0, 1]
    minutes: float                # the deadline kept: deadline.minutes, or the smallest useful run's where longer
    short: bool                   # deadline.minutes cannot hold even the smallest useful run
    fixed_s: float                # the fixed work ahead at this scale (with the margin and overshoot)
    sizes: dict                   # {setting: value} set by the plan (those already at or below their value omitted)


def fixed_work_s(settings: DeadlineSettings, unit_s: float, scale: float) -> float:
    """The whole run's fixed work at `scale` in seconds, with the margin and the overshoot held back."""
    return stage_budget_s(settings, STAGES[0], 0.0, unit_s, scale)["fixed_s"]


def plan_run(settings: DeadlineSettings, cfg: DictConfig, unit_s: float, elapsed_s: float) -> RunPlan:
    """The largest scale at which the fixed work takes at most fixed_share of the deadline and leaves every loop its
    min_minutes (the fixed work is linear in the scale, so one step solves it); below min_scale the run is short:
    the smallest sizes, and the minutes they need (`elapsed_s` included). The scale depends on the pass alone, rounded
    down to a twentieth: a rerun after a crash (its pass read from the probe's cache, its clock new) gets the same
    sizes, so collect's shards and distill's checkpoint resume."""
    left_s = 60 * settings.minutes
    loops_s = 60 * sum(settings.min_minutes[s] for s in BUDGET_KEYS)
    allowed_s = min(settings.fixed_share * left_s, left_s - loops_s)
    at_min, at_full = fixed_work_s(settings, unit_s, settings.min_scale), fixed_work_s(settings, unit_s, 1.0)
    scale = 1.0 if at_full <= allowed_s else \
        settings.min_scale + (1 - settings.min_scale) * (allowed_s - at_min) / (at_full - at_min)
    scale = math.floor(scale * SCALE_STEPS) / SCALE_STEPS
    short = scale < settings.min_scale
    scale = max(scale, settings.min_scale)
    fixed_s = fixed_work_s(settings, unit_s, scale)
    minutes = max(settings.minutes, (elapsed_s + fixed_s + loops_s) / 60)
    if short and settings.when_short == "stop":
        raise PipelineError(f"this machine needs ≈ {math.ceil(minutes)} min for the smallest useful run (a target "
                            f"verify pass takes {1e3 * unit_s:.0f} ms), past deadline.minutes={settings.minutes:g}: "
                            f"set deadline.minutes={math.ceil(minutes)}, or deadline.when_short=extend to run it anyway")
    return RunPlan(unit_s, scale, minutes, short, fixed_s, sized_values(settings, cfg, scale))


def sized_values(settings: DeadlineSettings, cfg: DictConfig, scale: float) -> dict:
    """{setting: its value at `scale`}: the composed value times the scale (or a power of it), rounded up, never below the smallest the
    deadline allows nor above the composed value (a user's smaller value stays). The held-out cap scales what it
    holds out: a domain's share of collect.max_prompts_per_domain, where that is below the cap."""
    sizes = {}
    for key, smallest in settings.sized.items():
        value = OmegaConf.select(cfg, key)
        if key == HELDOUT_CAP:
            held = _held_out_per_domain(cfg)
            value = held if value is None or (held is not None and held < value) else value
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue  # null (all) or absent: nothing to scale from
        sized = min(value, max(smallest, math.ceil(value * scale ** settings.steeper.get(key, 1.0))))
        if sized < value:
            sizes[key] = int(sized) if float(sized).is_integer() else sized
    return sizes


def _held_out_per_domain(cfg: DictConfig) -> int | None:
    prompts = OmegaConf.select(cfg, "collect.max_prompts_per_domain")
    fraction = OmegaConf.select(cfg, "distill.split.heldout_fraction")
    return None if prompts is None or fraction is None else max(1, math.ceil(prompts * fraction))


def apply_sizes(cfg: DictConfig, plan: RunPlan) -> DictConfig:
    cfg = cfg.copy()
    for key, value in plan.sizes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def describe_run(plan: RunPlan, settings: DeadlineSettings, machine: str) -> list[str]:
    """The run's first lines: the machine's pass, the plan and the minutes it expects."""
    loops = ", ".join(f"{stage} ≥ {settings.min_minutes[stage]:g}" for stage in BUDGET_KEYS)
    lines = [f"[pipeline] this machine needs ≈ {plan.minutes:.1f} min for the smallest useful run, past "
             f"deadline.minutes={settings.minutes:g}: running it anyway (deadline.when_short=extend; "
             f"deadline.minutes={math.ceil(plan.minutes)} plans for it, deadline.when_short=stop stops here)"] \
        if plan.short else []
    sizes = ", ".join(f"{k}={v}" for k, v in plan.sizes.items()) or "every size as shipped"
    lines += [f"[pipeline] machine: {machine}; a target verify pass (5 tokens) takes {1e3 * plan.unit_s:.0f} ms",
              f"[pipeline] plan: {plan.scale:.2f} of the shipped sizes ({sizes}); expected ≈ {plan.minutes:.1f} min: "
              f"fixed work ≈ {plan.fixed_s / 60:.1f} min, loops {loops} min plus their shares of the rest"]
    return lines
