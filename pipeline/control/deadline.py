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
FLOOR_MINUTES = 0.1  # a budget is never zero: each loop's first round still runs (would_overrun)


@dataclass(frozen=True)
class DeadlineSettings:
    """`deadline`, stage=all only: the whole run's wall-clock budget. Before each stage the time left, less the fixed
    work of the stages still to run (with `margin`), is split among their budgeted loops by `shares`; a stage's own
    budget (collect.max_minutes, distill.checkpoint.max_train_minutes, eval.max_minutes) only ever gets lower."""
    minutes: float | None = setting(15, "the whole run; null = off (each stage keeps its own budget)")
    margin: float = setting(0.25, "the fixed work ahead priced this much dearer: the error of its estimate")
    shares: dict[str, float] = setting({"collect": 0.5, "distill": 0.25, "eval": 0.25}, "collect's shards, distill's "
                                       "training, eval's requests (collect first: more target tokens buy the most "
                                       "acceptance; training and eval requests usually end before their budgets)")
    fixed_passes: dict[str, float] = setting(
        {"collect": 800, "distill": 800, "calibrate": 4500, "eval": 1500}, "each stage's unbudgeted work in target "
        "5-token verify passes, priced at the pass the dtype probe timed here: mostly multi-token forwards (distill: "
        "label pass, held-out passes; calibrate: held-out passes, cost profile, both drafts' calibrations; eval: "
        "fidelity check, sweeps) whose time tracked this pass across days. From default runs on 2 cores at 33-44 ms "
        "passes (docs/results.md: calibrate 3,800-5,300, eval 1,100-1,700, distill ~800); each stage replans")
    overshoot_passes: float = setting(400, "held back at every plan, in target verify passes: a loop starts its last "
                                      "item when predicted to end inside the budget at the mean item's length, so a "
                                      "long one ends past it (about half a collect shard or an eval request)")

    def __post_init__(self):
        for key in ("shares", "fixed_passes"):  # a stage left unnamed: none; frozen: normalised once, here
            object.__setattr__(self, key, {s: float((getattr(self, key) or {}).get(s, 0.0)) for s in STAGES})
        shares = self.shares.values()
        refuse([(self.minutes is not None and not (isinstance(self.minutes, (int, float)) and self.minutes > 0),
                 f"deadline.minutes={self.minutes} must be a positive number of minutes (null = no run-level deadline)"),
                (min(self.margin, self.overshoot_passes, *shares) < 0 or sum(shares) <= 0,
                 "deadline.margin, deadline.overshoot_passes and deadline.shares must be >= 0, the shares with a "
                 "positive sum")])

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "DeadlineSettings":
        values = OmegaConf.to_container(cfg.get("deadline") or {}, resolve=True)
        return build(cls, values, "deadline", "pipeline/control/deadline.py")


def stage_budget_s(settings: DeadlineSettings, stage: str, left_s: float, unit_s: float) -> dict:
    """Seconds for `stage`'s budgeted loop, with their parts: the time left less the fixed work of this and every later
    stage (priced `margin` dearer) and the overshoot held back, split among the budgeted loops still to run in
    proportion to their shares."""
    ahead = STAGES[STAGES.index(stage):]
    fixed_passes = sum(settings.fixed_passes.get(s, 0.0) for s in ahead) * (1 + settings.margin)
    fixed_s = unit_s * (fixed_passes + settings.overshoot_passes)
    flexible_s = left_s - fixed_s
    share = settings.shares[stage] / sum(settings.shares.get(s, 0.0) for s in ahead)
    return {"left_s": left_s, "fixed_s": fixed_s, "flexible_s": flexible_s,
            "budget_s": max(60 * FLOOR_MINUTES, share * flexible_s)}


class RunDeadline:
    """The run's clock: `apply(cfg, stage, unit_s)` returns cfg with that stage's budget lowered to fit."""

    def __init__(self, settings: DeadlineSettings):
        self.settings, self.started = settings, time.time()

    def left_s(self) -> float:
        return 60 * self.settings.minutes - (time.time() - self.started)

    def apply(self, cfg: DictConfig, stage: str, unit_s: float) -> tuple[DictConfig, dict]:
        plan = stage_budget_s(self.settings, stage, self.left_s(), unit_s)
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
    budget. The first `first_round` items always run: an interleaved loop gives every domain at least one."""
    if budget_minutes is None or done < max(1, first_round):
        return False
    elapsed = time.time() - started
    return elapsed + elapsed / done > 60 * budget_minutes


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
