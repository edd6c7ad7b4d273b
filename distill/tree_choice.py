"""Choosing a token-tree shape per domain (greedy serving) from held-out top-k hits and the cost profile.

Under greedy serving the accepted path follows the target's argmax, so a tree with branching factors
(b_1, …, b_D) accepts depth d of a block starting at held-out position t when the target's token at t+d−1 is
among the draft's b_d most likely tokens there, for every depth up to d (teacher forcing keeps the draft's
context equal to the accepted path). With hit_t(k) = 1[target argmax ∈ draft top-k at t]:

    A = Σ_d Π_{i≤d} hit_{t+i−1}(b_i),   nodes N = Σ_d Π_{i≤d} b_i,

and the predicted speedup is (1 + A) / (D·c + r(N)), with D draft forwards (one per depth: the frontier is fed
in one forward, costed as one draft step, which holds while a small draft's forward of a few tokens costs
about one step) and r(N) the target's (N+1)-token forward over its 1-token forward from the cost profile.
A chain (1, …, 1) is one of the candidates, so "no tree" is a valid answer (SpecInfer, Miao et al. 2024;
Sequoia, Chen et al. 2024, choose trees from the same two ingredients: per-depth acceptance and verify cost).
Sampled serving needs the multi-draft acceptance of recursive rejection sampling; not calibrated here.
"""
from __future__ import annotations

import torch

from distill.batch import completion_hidden
from distill.calibrate import HeldOut, domain_index
from pipeline.cost_profile import verify_ratio
from pipeline.heads import column_map, head_logits, head_rows

CANDIDATES = [(1,) * g for g in range(1, 9)] + [
    (2,), (2, 1), (2, 1, 1), (2, 2), (2, 2, 1), (2, 1, 1, 1), (2, 2, 1, 1), (3,), (3, 1), (3, 1, 1), (3, 2, 1),
    (3, 2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 2, 1, 1), (2, 2, 2, 1), (3, 2, 2, 1), (4, 2, 2, 1, 1)]


@torch.no_grad()
def target_ranks(draft, heldout: HeldOut, vocab=None) -> torch.Tensor:
    """[N] the rank of the target's greedy token among the draft's logits (0 = the draft's argmax; a token
    outside the draft's vocabulary subset gets rank V, never a hit)."""
    was_training = draft.training
    draft.eval()
    device = next(draft.parameters()).device
    vocab = None if vocab is None else vocab.to(device)
    rows, column_of = head_rows(draft, vocab), column_map(vocab, draft.config.vocab_size)
    ranks, start = [], 0
    for batch, mask in heldout.batches(device):
        logits = head_logits(completion_hidden(draft, batch)[mask], rows)
        target = heldout.p_ids[start:start + logits.shape[0], 0].to(device)
        cols = target if column_of is None else column_of[target]
        own = logits.gather(-1, cols.clamp_min(0)[:, None])
        rank = (logits > own).sum(-1)
        ranks.append(torch.where(cols >= 0, rank, torch.full_like(rank, logits.shape[-1])).cpu())
        start += logits.shape[0]
    draft.train(was_training)
    return torch.cat(ranks)


def simulate(ranks: torch.Tensor, heldout: HeldOut, positions: torch.Tensor, factors: tuple) -> float:
    """A: expected accepted tokens per pass of the tree `factors`, averaged over block starts (module docstring);
    positions past a completion's end count as misses."""
    rows = heldout.row_of[positions]
    chosen = ranks[positions]
    total, count = 0.0, 0
    for row in rows.unique():
        r = chosen[rows == row]
        alive = torch.ones(len(r), dtype=torch.bool)
        accepted = torch.zeros(len(r))
        for depth, width in enumerate(factors):
            hit = torch.zeros(len(r), dtype=torch.bool)
            hit[:len(r) - depth] = r[depth:] < width
            alive &= hit
            accepted += alive
        total, count = total + float(accepted.sum()), count + len(r)
    return total / max(count, 1)


def nodes(factors: tuple) -> int:
    total, width = 0, 1
    for factor in factors:
        width *= factor
        total += width
    return total


def choose(ranks: torch.Tensor, heldout: HeldOut, profile: dict, c: float,
           candidates: list[tuple] = CANDIDATES) -> dict[str, dict]:
    """Per domain (and overall): the candidate with the highest predicted speedup, chains included."""
    result = {}
    for domain, mask in domain_index(heldout).items():
        best = None
        for factors in candidates:
            accepted = simulate(ranks, heldout, mask, factors)
            speedup = (1 + accepted) / (len(factors) * c + verify_ratio(profile, nodes(factors)))
            if best is None or speedup > best["predicted_speedup"]:
                best = {"tree": list(factors), "accepted": accepted, "predicted_speedup": speedup}
        result[domain] = best
    return result
