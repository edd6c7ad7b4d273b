"""The online guard: speculation that switches itself down or off when the running acceptance says it loses
(docs/architecture.md, "The online guard"). Lossless by construction: it decides only how many tokens are
drafted, never how they are drawn or accepted.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Mapping

from pipeline.decoding.cost import pass_speedup
from pipeline.decoding.draft_length import Policy
from pipeline.errors import PipelineError


@dataclass(frozen=True)
class GuardSettings:
    """The guard's knobs; their defaults and what each does: eval/settings.py `eval.guard`."""
    window: float  # passes of memory per draft position: counts decay by 1 − 1/window per observation
    prior_passes: float  # weight of the calibrated acceptance, in observations
    probe_every: int  # passes off before one probing pass of a single draft
    margin: float  # speculate only when the best length is predicted ≥ (1 + margin) × plain decoding
    longest: int  # the most drafts per pass the guard may choose (never fewer than the policy's own budget)
    measure_every: int  # one plain pass in this many times the plain step the passes' costs are checked against;
                        #   0 = the calibrated costs only

    def __post_init__(self):
        checks = {"window": (_number(self.window) and self.window >= 1, "a number >= 1, e.g. 16"),
                  "prior_passes": (_number(self.prior_passes) and self.prior_passes > 0, "a positive number, e.g. 4"),
                  "probe_every": (_integer(self.probe_every) and self.probe_every >= 1, "an integer >= 1, e.g. 8"),
                  "margin": (_number(self.margin) and 0 <= self.margin < 1, "in [0, 1), e.g. 0.0"),
                  "longest": (_integer(self.longest) and self.longest >= 1, "an integer >= 1, e.g. 8"),
                  "measure_every": (_integer(self.measure_every) and self.measure_every >= 0,
                                    "an integer >= 0, e.g. 32 (0 = calibrated costs only)")}
        for key, (ok, fix) in checks.items():
            if not ok:
                raise PipelineError(f"guard.{key}={getattr(self, key)!r} is invalid: use {fix}")

    @classmethod
    def from_dict(cls, values: Mapping) -> "GuardSettings":
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise PipelineError(f"guard has unknown keys {unknown}: use {', '.join(known)}")
        return cls(**values)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Guard:
    """What one domain's guard prices with: the cost summary of its plan ({"c", "verify_ratio",
    "tree_verify_ratio"}, pipeline/measure/cost_profile.py `summary`) and the calibrated acceptance P_k (the chance the
    first k drafts of a block are accepted: speculative.json `per_position_acceptance`)."""
    cost: Mapping
    prior: tuple[float, ...]
    settings: GuardSettings

    def __post_init__(self):
        c = self.cost.get("c") if isinstance(self.cost, Mapping) else None
        if not _number(c) or c < 0:
            raise PipelineError(f"guard cost {self.cost!r} has no draft cost c >= 0: pass a cost summary such as "
                                "speculative.json's `cost`")
        prior = tuple(float(p) for p in self.prior)
        if not prior or not all(0.0 <= p <= 1.0 for p in prior):
            raise PipelineError(f"guard prior {self.prior!r} is not a non-empty list of probabilities: pass the "
                                "calibrated per_position_acceptance")
        object.__setattr__(self, "prior", prior)

    def to_dict(self) -> dict:
        return {"settings": asdict(self.settings), "prior": list(self.prior)}


@dataclass
class GuardStats:
    """The guard's decisions over one generate call (or summed over many: `add`)."""
    passes: int = 0  # passes the guard decided
    off: int = 0  # passes it decoded plainly (no drafts)
    probes: int = 0  # single-draft passes after a stretch off
    shortened: int = 0  # passes it drafted fewer than the policy wanted
    lengthened: int = 0  # passes it drafted more than the policy wanted
    timing: int = 0  # plain passes that timed the plain step (GuardSettings.measure_every)
    cost_factor: float = 1.0  # the last measured/calibrated cost of a speculative pass (PassTimes.factor)

    def add(self, other: "GuardStats") -> "GuardStats":
        """The counts summed; cost_factor, the latest value and not a count, is the other's."""
        counts = [f.name for f in fields(self) if f.name != "cost_factor"]
        summed = {name: getattr(self, name) + getattr(other, name) for name in counts}
        return GuardStats(**summed, cost_factor=other.cost_factor)

    def to_dict(self) -> dict:
        return asdict(self)


def conditional_rates(prior: tuple[float, ...], n: int) -> list[float]:
    """a_k = P_k / P_{k−1} for k = 1 … n from cumulative P_k; past the list, its last rate."""
    rates, before = [], 1.0
    for p in prior[:n]:
        rates.append(min(p / before, 1.0) if before > 0 else 0.0)
        before = p
    return rates + [rates[-1]] * (n - len(rates))


class PassTimes:
    """κ = (seconds per calibrated target step of the timed speculative passes) / (seconds of the timed plain
    passes), decayed like the acceptance counts; 1 until both kinds were timed. A pass is timed from `budget()` to
    `update()`, which follows the pass's one host synchronisation, so the interval is the pass's on any device."""

    def __init__(self, keep: float, clock=time.perf_counter):
        self.keep, self.clock = keep, clock
        self.plain, self.speculative = [0.0, 0.0], [0.0, 0.0]  # decayed (seconds per target step, weight)
        self.started: float | None = None
        self.timed = self.drafted = False  # whether a pass, and a pass with drafts, was seen

    def start(self) -> None:
        self.started = self.clock()

    def stop(self, steps: float, drafted: bool) -> None:
        """The pass since start() cost `steps` calibrated target steps (1 for a plain pass)."""
        if self.started is None:
            return
        seconds, self.started = self.clock() - self.started, None
        if not self.timed or (drafted and not self.drafted):  # the first pass, and the first with drafts, read
            self.timed, self.drafted = True, self.drafted or drafted  # the prompt (target, draft): not a step
            return
        sums = self.speculative if drafted else self.plain
        sums[0] = self.keep * sums[0] + seconds / steps
        sums[1] = self.keep * sums[1] + 1.0

    @property
    def factor(self) -> float:
        (plain, n_plain), (speculative, n_speculative) = self.plain, self.speculative
        return (speculative / n_speculative) / (plain / n_plain) if n_plain and n_speculative and plain > 0 else 1.0


class GuardedPolicy(Policy):
    """A draft-length policy under the guard: `budget()` may be 0 (a plain step), shorter or longer than the
    wrapped policy's; `keep_going` is the wrapped policy's; `update` feeds both."""

    def __init__(self, inner: Policy, guard: Guard, tree_depths: tuple[int, ...] | None = None,
                 clock=time.perf_counter):
        self.inner, self.settings = inner, guard.settings
        self.needs_confidence = inner.needs_confidence
        tree = tree_depths is not None
        self.longest = max(tree_depths) if tree else max(inner.budget(), guard.settings.longest)
        sizes = ([sum(d <= depth for d in tree_depths) for depth in range(self.longest + 1)] if tree
                 else list(range(self.longest + 1)))
        # pass_speedup of 0 accepted is 1 / the pass's cost in target steps: the one cost model, priced once.
        self.per_cost = [pass_speedup(0.0, gamma, sizes[gamma], guard.cost, tree) for gamma in range(self.longest + 1)]
        weight = guard.settings.prior_passes
        self.hits = [weight * a for a in conditional_rates(guard.prior, self.longest)]
        self.seen = [weight] * self.longest
        self.keep = 1.0 - 1.0 / guard.settings.window
        self.resting = -1  # passes still to spend off before the next probe; -1 = on
        self.times = PassTimes(self.keep, clock) if guard.settings.measure_every else None
        self.stats = GuardStats()

    def best(self) -> int:
        """The draft length with the most expected tokens per target step (0 = plain decoding)."""
        tokens, reach, best, best_rate = 1.0, 1.0, 0, self.per_cost[0] * (1.0 + self.settings.margin)
        measured = self.times.factor if self.times else 1.0
        for gamma in range(1, self.longest + 1):
            reach *= self.hits[gamma - 1] / self.seen[gamma - 1]
            tokens += reach
            if tokens * self.per_cost[gamma] > best_rate * measured:
                best, best_rate = gamma, tokens * self.per_cost[gamma] / measured
        return best

    def budget(self) -> int:
        self.stats.passes += 1
        if self.times:
            self.times.start()
        if self.resting > 0:
            self.resting -= 1
            self.stats.off += 1
            return 0
        if self.resting == 0:  # a stretch off ended: one draft to see whether acceptance recovered
            self.resting = -1
            self.stats.probes += 1
            return 1
        every = self.settings.measure_every
        if every and self.stats.passes >= 3 and (self.stats.passes - 3) % every == 0:
            self.stats.timing += 1  # a plain pass now and then: the clock's reference for the measured costs
            return 0
        wanted, chosen = self.inner.budget(), self.best()
        if chosen == 0:
            self.resting = self.settings.probe_every - 1
            self.stats.off += 1
            return 0
        self.resting = -1
        if self.inner.needs_confidence:  # its stop drafts fewer than priced: the guard decides only on or off
            return wanted
        self.stats.shortened += chosen < wanted
        self.stats.lengthened += chosen > wanted
        return chosen

    def keep_going(self, confidence) -> bool:
        return self.inner.keep_going(confidence)

    def update(self, drafted: int, accepted: int) -> None:
        """Drafts 1 … accepted were accepted, draft accepted + 1 (if drafted) rejected; later ones never judged."""
        if self.times:
            self.times.stop(1.0 / self.per_cost[min(drafted, self.longest)], drafted > 0)
            self.stats.cost_factor = self.times.factor
        for k in range(min(accepted + 1, drafted, self.longest)):
            self.hits[k] = self.keep * self.hits[k] + (k < accepted)
            self.seen[k] = self.keep * self.seen[k] + 1.0
        self.inner.update(drafted, accepted)


def guarded(policy: Policy, guard: Guard | None, stats, tree_depths: tuple[int, ...] | None = None) -> Policy:
    """`policy` under `guard` (itself when there is none) for one generate call, its decisions recorded in
    `stats.guard`; `tree_depths` (a token tree's node depths) prices budgets as that tree truncated to a depth."""
    if guard is None:
        return policy
    wrapped = GuardedPolicy(policy, guard, tree_depths)
    stats.guard = wrapped.stats
    return wrapped
