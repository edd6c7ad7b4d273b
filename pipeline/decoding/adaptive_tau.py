"""Adaptive draft temperature: the guard moves the draft's τ between passes toward the temperature at which the
first draft of a pass would have been accepted most often, lossless by construction.

A calibration picks one τ per domain from held-out data; one request may want a sharper or a flatter draft. After
every verify pass with drafts (T > 0 and τ > 0) the pass holds the target's logits and the draft's at the first
draft position, whose context is the committed prefix. For every τ' on a grid τ₀·step^k (k = −K … K, τ₀ the
planned τ) it scores how often that first draft would have been accepted had it been drawn at τ':

- a chain's first draft: α(τ') = Σ_v min(p(v), q_τ'(v)) (Leviathan et al. 2023, Def. 3.1): exact, no sampling noise;
- a token tree's root with w > 1 children: 1 − Π_i (1 − min(1, p_i(x_i) / q_i(x_i))) over one set of w draws
  without replacement from q_τ' (tree_sampling.sibling_acceptance: the sibling rule with its coins averaged out),
  from the same exponential noise for every τ', so the differences between candidates carry little of it.

q_τ' is the draft's own filters at τ' applied to its logits (a top-p nucleus depends on τ); under FR-Spec it lives
on the subset's columns, p on the same plus one column for its mass outside (all the residuals need of it). Scoring
every candidate on the states the decode visits is fair because those states do not depend on τ: the committed
prefix follows the target's law whatever τ drafted it (only where a pass starts does). Each candidate keeps a
decayed mean (the guard's `window`); before a pass τ is the best mean's, ties keeping the current. The scores
travel in the pass's one host copy, beside the accepted count and the token ids, as fixed-point integers, so
adaptive τ adds no host synchronisation.

Lossless: the τ of pass t is a function of passes < t only, and each pass's drafts are drawn from and verified
against the q of that pass's τ (one Pair per τ); the acceptance rule is untouched. Given the past, each pass is an
ordinary speculative pass with some draft, so the output follows the target (Leviathan et al. 2023, Thm. 3.8).
Greedy decoding (T = 0) has nothing to adapt, nor has a greedy draft (τ = 0): there it is off.
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
