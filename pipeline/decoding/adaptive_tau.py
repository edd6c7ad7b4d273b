"""Adaptive draft temperature (docs/architecture.md, "The online guard"): after every sampled pass the guard scores
each τ' on a grid τ₀·step^k by how often the pass's first draft would have been accepted at τ' — a chain's
α(τ') = Σ_v min(p(v), q_τ'(v)) (Leviathan et al. 2023, Def. 3.1), a tree root's sibling rule with its coins averaged
out (tree_sampling.sibling_acceptance) over one set of draws from the same noise for every τ' — and drafts the
next pass at the best decayed mean. q_τ' applies the draft's own filters at τ' (a top-p nucleus depends on τ);
under FR-Spec p carries one extra column for its mass outside the subset. Scoring on the visited states is fair
because the committed prefix follows the target's law whatever τ drafted it. The scores travel in the pass's one
host copy as fixed-point integers, so adaptive τ adds no host synchronisation.

Lossless: the τ of pass t depends on passes < t only, and each pass's drafts are drawn from and verified against
the q of that pass's τ (one Pair per τ). Off for greedy decoding (T = 0) and a greedy draft (τ = 0).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from pipeline.decoding import tree_sampling
from pipeline.decoding.loop import Pair

SCALE = 1 << 20  # fixed point of the scores in the pass's integer host copy: 1e-6 of acceptance, ample to rank them


class AdaptiveTau:
    """The draft temperature of one generate call: `pair` drafts the next pass, `scores` rates its candidates on
    a pass (device-side), `update` reads them after the pass's host copy and moves τ. Decisions land in `stats`."""

    def __init__(self, pair: Pair, step: float, steps: int, window: float, stats):
        planned = pair.q.temperature
        self.grid = [planned * step ** k for k in range(-steps, steps + 1)]
        self.pairs = [replace(pair, q=pair.q.with_temperature(tau)) for tau in self.grid]
        self.pairs[steps] = pair  # the planned τ is the call's own pair
        self.current = steps
        self.means = [0.0] * len(self.grid)
        self.keep = 1.0 - 1.0 / window
        self.unit = pair.q.with_temperature(1.0)  # the draft's filters, applied to logits already divided by τ'
        self.divisors: torch.Tensor | None = None  # the grid as a [C, 1] tensor on the logits' device
        self.stats = stats
        stats.draft_temperature = planned

    @property
    def pair(self) -> Pair:
        """The pair the next pass drafts and verifies with: q at the current τ."""
        return self.pairs[self.current]

    @property
    def temperature(self) -> float:
        return self.grid[self.current]

    def scores(self, pair: Pair, target_logits: torch.Tensor, draft_logits: torch.Tensor, width: int = 1,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Fixed-point acceptance [C] of a first draft drawn at each τ' from the target's logits [V] and the draft's
        [K] at the first draft position, `width` drafts there (siblings of a tree's root; a chain's 1)."""
        if self.divisors is None:
            self.divisors = torch.tensor(self.grid, device=draft_logits.device).view(-1, 1)
        q = self.unit.probs(draft_logits.float().view(1, -1) / self.divisors)  # [C, K]
        p = pair.p.probs(target_logits.view(1, -1))[0]  # [V]
        if pair.draft_vocab is not None:
            p = subset_columns(p, pair.draft_vocab)
            q = torch.cat([q, q.new_zeros(q.shape[0], 1)], -1)
        if width == 1:
            accepted = torch.minimum(p, q).sum(-1)
        else:
            accepted = tree_sampling.sibling_acceptance(p, q, width, generator)
        return (accepted * SCALE).round().long()

    def update(self, scores: list[int]) -> None:
        """Feeds the host copy of `scores` of a pass that drafted at the current τ; moves τ to the best mean."""
        self.stats.tau_passes += 1
        self.stats.tau_sum += self.temperature
        self.means = [self.keep * mean + score / SCALE for mean, score in zip(self.means, scores)]
        best = max(range(len(self.grid)), key=lambda i: (self.means[i], i == self.current))
        self.stats.tau_up += best > self.current
        self.stats.tau_down += best < self.current
        self.current = best
        self.stats.draft_temperature = self.temperature


def subset_columns(p: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """p [V] on a vocabulary subset's columns [K] and one more holding the mass outside it [K+1]. Where q is 0
    outside the subset, this is all that acceptance and the residuals after rejections (norm(max(0, p − q))) need
    of p: the draws never leave the subset, and outside it only the total mass of p enters the normalisation."""
    inside = p[vocab]
    return torch.cat([inside, (1.0 - inside.sum()).clamp_min(0.0).view(1)])


def adaptive_tau(guard, pair: Pair, stats) -> AdaptiveTau | None:
    """The adaptive τ of one call under `guard` (GuardSettings.adaptive_tau), its decisions in `stats.guard`;
    None when it is off, without a guard, or where there is nothing to adapt (greedy target or greedy draft)."""
    if guard is None or not guard.settings.adaptive_tau or pair.p.greedy or pair.q.greedy:
        return None
    settings = guard.settings
    return AdaptiveTau(pair, settings.tau_step, settings.tau_steps, settings.window, stats.guard)
