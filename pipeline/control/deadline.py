"""A wall-clock budget for the whole run (`stage=all`, `deadline.minutes`), split among the budgeted loops still to
run before each stage (docs/architecture.md, "A deadline for the whole run"). A stage's own budget only ever gets
lower, and the next stage plans again from the clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from pipeline.settings import build, refuse, register, setting

STAGES = ("collect", "distill", "calibrate", "eval")  # the stages with work to plan for (calibrate: fixed only)
BUDGET_KEYS = {"collect": "collect.max_minutes", "distill": "distill.checkpoint.max_train_minutes",
               "eval": "eval.max_minutes"}
WHEN_SHORT = ("extend", "stop")


@dataclass(frozen=True)
class DeadlineSettings:
    """`deadline`, stage=all only: the whole run's wall-clock budget. First the run is sized to the machine: where the
    fixed work at the shipped sizes would take more than `fixed_share` of the deadline, the `sized` settings shrink in
    proportion (pipeline/control/sizing.py). Then, before each stage, the time left, less the fixed work of the stages
    still to run (with `margin`), is split among their budgeted loops by `shares`, none below its `min_minutes`; a
    stage's own budget (collect.max_minutes, distill.checkpoint.max_train_minutes, eval.max_minutes) only gets lower."""
    minutes: float | None = setting(15, "the whole run; null = off (each stage keeps its own budget)")
    margin: float = setting(0.25, "the fixed work ahead priced this much dearer: the error of its estimate")
    shares: dict[str, float] = setting({"collect": 0.5, "distill": 0.25, "eval": 0.25}, "how the time the fixed "
                                       "work leaves is split: collect's shards, distill's training, eval's requests "
                                       "(collect first: more target tokens buy the most acceptance; training and eval "
                                       "requests usually end before their budgets)")
    min_minutes: dict[str, float] = setting(
        {"collect": 1.5, "distill": 3, "eval": 2}, "the smallest useful loop of each stage, whatever its share: "
        "training long enough to at least triple the derived draft's held-out acceptance, a collect round in every "
        "domain, eight eval requests in each drafting domain (docs/results.md, \"The first run on any machine\")")
    fixed_passes: dict[str, float] = setting(
        {"collect": 800, "distill": 800, "calibrate": 4500, "eval": 1500}, "each stage's unbudgeted work at the shipped "
        "sizes in target 5-token verify passes, priced at the pass the dtype probe timed here: mostly multi-token "
        "forwards (distill: label pass, held-out passes; calibrate: held-out passes, cost profile, both drafts' "
        "calibrations; eval: fidelity check, sweeps) whose time tracked this pass across days. From default runs on 2 "
        "cores at 33-44 ms passes (docs/journal.md: calibrate 3,800-5,300, eval 1,100-1,700, distill ~800); each stage "
        "replans")
    overshoot_passes: float = setting(400, "held back at every plan, in target verify passes: a loop starts its last "
                                      "item when predicted to end inside the budget at the mean item's length, so a "
                                      "long one ends past it (about half a collect shard or an eval request)")
    fixed_share: float = setting(0.45, "the most of the run the fixed work may take at the shipped sizes; on a slower "
                                 "machine the `sized` settings shrink until it fits (the scale), so every loop keeps a "
                                 "useful share")
    sized: dict[str, float] = setting(
        {"collect.shard_size": 4, "distill.split.heldout_max_prompts_per_domain": 6, "calibrate.cost.repeats": 2,
         "calibrate.cost.warmup": 1, "calibrate.tree_samples": 2, "eval.max_new_tokens": 32},
        "the settings sized to the machine (the composed value times the scale, rounded up) and the smallest each may "
        "become: shards small enough for a round in every domain, held-out prompts (distill's and calibrate's passes "
        "over them), the cost profile's rounds, the tree choice's draws, eval's request length")
    steeper: dict[str, float] = setting(
        {"collect.shard_size": 2}, "sized settings that shrink with a power of the scale: a collected prompt's time "
        "grew as about the square of the pass's, 0.25 s at a 40 ms pass to 3 s at 113 ms (a slow machine also batches "
        "worse), and a round of shards, one per domain, must fit collect's smallest minutes")
    smallest_passes: dict[str, float] = setting(
        {"collect": 100, "distill": 250, "calibrate": 1000, "eval": 450}, "each stage's fixed work with every sized "
        "setting at its smallest, in the same passes: measured on the slow stand-in (docs/results.md, \"The first run "
        "on any machine\"); between min_scale and 1 the fixed work is priced on the line from these to fixed_passes")
    min_scale: float = setting(0.3, "the scale at which the sized settings reach their smallest (most floors hold "
                               "below it): the fixed work costs smallest_passes there and no less below")
    when_short: str = setting("extend", "where even the smallest useful run cannot fit the deadline: extend = run it "
                              "anyway, saying first how long it will take; stop = exit before any work, naming the "
                              "deadline.minutes it needs")

    def __post_init__(self):
        for key in ("shares", "fixed_passes", "smallest_passes", "min_minutes"):  # a stage left unnamed: none; normalised once, here
            object.__setattr__(self, key, {s: float((getattr(self, key) or {}).get(s, 0.0)) for s in STAGES})
        shares = self.shares.values()
        refuse([(self.minutes is not None and not (isinstance(self.minutes, (int, float)) and self.minutes > 0),
                 f"deadline.minutes={self.minutes} must be a positive number of minutes (null = no run-level deadline)"),
                (min(self.margin, self.overshoot_passes, *shares, *self.min_minutes.values(),
                     *self.smallest_passes.values()) < 0 or sum(shares) <= 0,
                 "deadline.margin, deadline.overshoot_passes, deadline.min_minutes, deadline.smallest_passes and "
                 "deadline.shares must be >= 0, the shares with a positive sum"),
                (not 0 < self.fixed_share <= 1 or not 0 < self.min_scale < 1,
                 f"deadline.fixed_share={self.fixed_share} must be in (0, 1], deadline.min_scale={self.min_scale} in "
                 "(0, 1)"),
                (any(self.smallest_passes[s] > self.fixed_passes[s] for s in STAGES),
                 "deadline.smallest_passes must not exceed deadline.fixed_passes in any stage"),
                (any(not isinstance(v, (int, float)) or v <= 0 for v in self.sized.values()),
                 f"deadline.sized={self.sized} must give each setting a positive smallest value"),
                (any(key not in self.sized or not isinstance(power, (int, float)) or power <= 0
                     for key, power in self.steeper.items()),
                 f"deadline.steeper={self.steeper} must give settings of deadline.sized positive powers"),
                (self.when_short not in WHEN_SHORT,
                 f"deadline.when_short={self.when_short!r}: use one of {', '.join(WHEN_SHORT)}")])

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "DeadlineSettings":
        values = OmegaConf.to_container(cfg.get("deadline") or {}, resolve=True)
        return build(cls, values, "deadline", "pipeline/control/deadline.py")


def fixed_passes(settings: DeadlineSettings, stages, scale: float = 1.0) -> float:
    """The fixed work of `stages` at `scale`, in target verify passes (without the margin): on the line from
    smallest_passes at min_scale to fixed_passes at 1."""
    along = (max(scale, settings.min_scale) - settings.min_scale) / (1 - settings.min_scale)
    return sum(settings.smallest_passes[s] + along * (settings.fixed_passes[s] - settings.smallest_passes[s])
               for s in stages)


def stage_budget_s(settings: DeadlineSettings, stage: str, left_s: float, unit_s: float, scale: float = 1.0) -> dict:
    """Seconds for `stage`'s budgeted loop, with their parts: the time left less the fixed work of this and every later
    stage (at the run's `scale`, priced `margin` dearer) and the overshoot held back (it shrinks with the shards and
    requests: the scale), split among the loops still to run by their shares, but leaving each later loop its
    min_minutes; never less than this loop's own (the run's plan made room for every loop's, sizing.plan_run)."""
    ahead = STAGES[STAGES.index(stage):]
    overshoot_s = unit_s * scale * settings.overshoot_passes
    expected_s = unit_s * fixed_passes(settings, ahead, scale) + overshoot_s
    fixed_s = expected_s + unit_s * fixed_passes(settings, ahead, scale) * settings.margin
    flexible_s = left_s - fixed_s
    share = settings.shares[stage] / sum(settings.shares.get(s, 0.0) for s in ahead)
    # the later loops' floors are kept out of the fixed work's expected time, not out of its margin as well: the
    # margin insures the deadline against a misjudged estimate, and charging both starved collect on slow machines
    later_floors_s = 60 * sum(settings.min_minutes[s] for s in ahead[1:] if s in BUDGET_KEYS)
    budget_s = max(60 * settings.min_minutes.get(stage, 0.0),
                   min(share * flexible_s, left_s - expected_s - later_floors_s))
    return {"left_s": left_s, "fixed_s": fixed_s, "flexible_s": flexible_s, "budget_s": budget_s}


class RunDeadline:
    """The run's clock: `apply(cfg, stage, unit_s)` returns cfg with that stage's budget lowered to fit."""

    def __init__(self, settings: DeadlineSettings, scale: float = 1.0, minutes: float | None = None,
                 started: float | None = None):
        self.settings, self.started, self.scale = settings, started or time.time(), scale
        self.minutes = minutes or settings.minutes  # more than deadline.minutes where the smallest run needs it

    def left_s(self) -> float:
        return 60 * self.minutes - (time.time() - self.started)

    def apply(self, cfg: DictConfig, stage: str, unit_s: float) -> tuple[DictConfig, dict]:
        plan = stage_budget_s(self.settings, stage, self.left_s(), unit_s, self.scale)
        key = BUDGET_KEYS[stage]
        own = OmegaConf.select(cfg, key)
        minutes = plan["budget_s"] / 60 if own is None else min(float(own), plan["budget_s"] / 60)
        cfg = cfg.copy()
        OmegaConf.update(cfg, key, round(minutes, 3))
        plan.update(key=key, own_minutes=own, minutes=round(minutes, 3), unit_ms=1e3 * unit_s)
        return cfg, plan


def describe(plan: dict) -> str:
    own = "none" if plan["own_minutes"] is None else f"{plan['own_minutes']:g}"
    return (f"[pipeline] deadline: {plan['left_s'] / 60:.1f} min left; {plan['key']}={plan['minutes']:g} "
            f"(its own {own}; fixed work ahead ≈ {plan['fixed_s'] / 60:.1f} min at {plan['unit_ms']:.1f} ms a "
            f"target verify pass)")


def would_overrun(started: float, done: int, budget_minutes: float | None, first_round: int = 1) -> bool:
    """True when the next item of a budgeted loop, at the mean duration of the items so far, would end past the
    budget. The first `first_round` items always run (at least one: a loop's mean needs an item)."""
    if budget_minutes is None or done < max(1, first_round):
        return False
    elapsed = time.time() - started
    return elapsed + elapsed / done > 60 * budget_minutes


def machine_line(cfg: DictConfig) -> str:
    """The processor (or GPU) and dtype the run's target runs in, as the first lines name them."""
    import torch

    from pipeline.machine import cpu_name
    from pipeline.modelio.models import resolve_device, resolve_model

    device, dtype = resolve_device(cfg.get("runtime"), resolve_model(cfg.model.target, "target", cfg.paths),
                                   cfg.paths.models)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)"
    return f"{where}, {str(dtype).removeprefix('torch.')}"


def verify_pass_seconds(cfg: DictConfig) -> float:
    """The unit the fixed work is priced in: the target's 5-token verify pass on the run's device and dtype (the
    dtype probe's cached figure on a CPU). The fixed work is mostly multi-token forwards, whose time tracks this
    pass, not the 1-token step (docs/journal.md, "The default run with the fixed work priced in verify passes")."""
    from pipeline.modelio.dtype import VERIFY_FED, cpu_timings, time_forward
    from pipeline.modelio.models import load_model, resolve_device, resolve_model

    path = resolve_model(cfg.model.target, "target", cfg.paths)
    device, dtype = resolve_device(cfg.get("runtime"), path, cfg.paths.models)
    if device.type == "cpu":
        return cpu_timings(path, cfg.paths.models)[str(dtype).removeprefix("torch.")]["verify5_ms"] / 1e3
    return time_forward(load_model(path, device, dtype), fed=VERIFY_FED)


register("deadline", DeadlineSettings)
