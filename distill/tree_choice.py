"""Choosing a token-tree shape per domain from held-out acceptance per depth and the cost profile.

A node with k children yields one of them with probability h_t(k) at held-out position t (teacher forcing keeps the
draft's context the accepted path): at greedy serving 1[target argmax ∈ draft top-k at t]; when sampling, the chance
that recursive rejection sampling (pipeline/decoding/tree_sampling.py) accepts one of k draws without replacement from
q_τ against p_T, a Monte Carlo estimate over the draws (k = 1: the chain's α). A tree (b_1, …, b_D) accepts
A = Σ_d Π_{i≤d} h_{t+i−1}(b_i) per block from t, with one draft forward per depth (its frontier in one forward, priced
as one step) and a verify of its N = Σ_d Π_{i≤d} b_i nodes (pass_speedup); depths are taken as independent given the positions, as the
chain's Π α. Chains are candidates too, so "no tree" is a valid answer (SpecInfer, Miao et al. 2024; Sequoia, Chen
et al. 2024, choose trees from the same per-depth acceptance and verify cost).
"""
from __future__ import annotations

import torch

from distill.simulator import OVERALL, HeldOut, domain_index, draft_logits, tau_at
from distill.policy import visit_weights
from pipeline.decoding.cost import pass_speedup
from pipeline.decoding.tree import nodes
from pipeline.heads import column_map
from pipeline.sampling import sample
from pipeline.decoding.tree_sampling import rejection_update

CANDIDATES = [(1,) * g for g in range(1, 9)] + [
    (2,), (2, 1), (2, 1, 1), (2, 2), (2, 2, 1), (2, 1, 1, 1), (2, 2, 1, 1), (3,), (3, 1), (3, 1, 1), (3, 2, 1),
    (3, 2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 2, 1, 1), (2, 2, 2, 1), (3, 2, 2, 1), (4, 2, 2, 1, 1)]
K_MAX = max(max(factors) for factors in CANDIDATES)
MAX_NODES = max(nodes(factors) for factors in CANDIDATES)


def hit_table(draft, heldout: HeldOut, vocab=None, temperature_of: dict | None = None, samples: int = 8,
              seed: int = 0) -> torch.Tensor:
    """[N, K_MAX]: h_t(k) at column k − 1 (module docstring), for the held-out serving distribution."""
    if heldout.sampling.greedy:
        return (target_ranks(draft, heldout, vocab)[:, None] < torch.arange(1, K_MAX + 1)).float()
    return sibling_acceptance(draft, heldout, temperature_of or {OVERALL: heldout.sampling.temperature}, vocab,
                              samples, seed)


@torch.no_grad()
def target_ranks(draft, heldout: HeldOut, vocab=None) -> torch.Tensor:
    """[N] the rank of the target's greedy token among the draft's logits (0 = the draft's argmax; a token
    outside the draft's vocabulary subset gets rank V, never a hit)."""
    device = next(draft.parameters()).device
    column_of = column_map(None if vocab is None else vocab.to(device), draft.config.vocab_size)
    ranks, start = [], 0
    for logits in draft_logits(draft, heldout, vocab):
        target = heldout.p_ids[start:start + logits.shape[0], 0].to(device)
        cols = target if column_of is None else column_of[target]
        own = logits.gather(-1, cols.clamp_min(0)[:, None])
        rank = (logits > own).sum(-1)
        ranks.append(torch.where(cols >= 0, rank, torch.full_like(rank, logits.shape[-1])).cpu())
        start += logits.shape[0]
    return torch.cat(ranks)


@torch.no_grad()
def sibling_acceptance(draft, heldout: HeldOut, temperature_of: dict[str, float], vocab=None, samples: int = 8,
                       seed: int = 0, chunk: int = 32) -> torch.Tensor:
    """[N, K_MAX]: P(recursive rejection sampling accepts one of k siblings drawn without replacement from q_τ)
    at each held-out position, k = 1..K_MAX, each position at its domain's τ. p_T's mass outside the draft's
    vocabulary subset, and the tail beyond the held-out support, form one bucket the draft never proposes."""
    device = next(draft.parameters()).device
    column_of = column_map(None if vocab is None else vocab.to(device), draft.config.vocab_size)
    tau = tau_at(heldout, temperature_of).float()  # the draft's logits' dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    out, start = [], 0
    for logits in draft_logits(draft, heldout, vocab):
        for s in range(0, logits.shape[0], chunk):
            at = slice(start + s, start + min(s + chunk, logits.shape[0]))
            q = _draft_probs(logits[s:s + chunk], tau[at].to(device), heldout.sampling)
            p = _target_on_columns(heldout, at, column_of, q.shape[-1], device)
            out.append(_race(p, torch.cat([q, q.new_zeros(q.shape[0], 1)], -1), samples, generator).cpu())
        start += logits.shape[0]
    return torch.cat(out)


def _draft_probs(logits: torch.Tensor, tau: torch.Tensor, sampling) -> torch.Tensor:
    q = torch.empty_like(logits, dtype=torch.float32)
    for t in tau.unique().tolist():
        rows = tau == t
        q[rows] = sampling.with_temperature(t).probs(logits[rows]).float()
    return q


def _target_on_columns(heldout: HeldOut, at: slice, column_of, columns: int, device) -> torch.Tensor:
    """p_T over the draft's columns plus one last bucket for what the draft cannot propose."""
    ids, probs = heldout.p_ids[at].to(device), heldout.p_probs[at].to(device).float()
    cols = ids if column_of is None else column_of[ids]
    p = torch.zeros(ids.shape[0], columns + 1, device=device)
    p.scatter_add_(1, torch.where(cols >= 0, cols, columns), probs)
    p[:, columns] += heldout.p_tail[at].to(device).float()
    return p


def _race(p: torch.Tensor, q: torch.Tensor, samples: int, generator) -> torch.Tensor:
    """[M, K_MAX] acceptance with 1..K_MAX siblings, averaged over `samples` draw sequences per row."""
    p, q = p.repeat_interleave(samples, 0), q.repeat_interleave(samples, 0)
    rejected = torch.ones(p.shape[0], device=p.device)
    accepted = []
    for _ in range(K_MAX):
        x = sample(q, generator)
        qx, px = q.gather(1, x[:, None]).squeeze(1), p.gather(1, x[:, None]).squeeze(1)
        rejected = rejected * (1 - torch.where(qx > 0, (px / qx.clamp_min(1e-30)).clamp(max=1.0), 0.0))
        accepted.append(1 - rejected)
        p, q = rejection_update(p, q, x)
    return torch.stack(accepted, -1).view(-1, samples, K_MAX).mean(1)


def simulate(hits: torch.Tensor, heldout: HeldOut, positions: torch.Tensor, factors: tuple) -> float:
    """A: expected accepted tokens per pass of the tree `factors` (module docstring), averaged over the block starts
    the decoder visits (distill/policy.py `visit_weights`); positions past a completion's end count as misses."""
    rows = heldout.row_of[positions]
    chosen = hits[positions]
    total, count = 0.0, 0.0
    for row in rows.unique():
        h = chosen[rows == row].double()
        alive, at_least = torch.ones(len(h), dtype=torch.float64), []
        for depth, width in enumerate(factors):
            hit = torch.zeros(len(h), dtype=torch.float64)
            reach = max(len(h) - depth, 0)  # a row shorter than the tree is deep: its starts miss past its end
            hit[:reach] = h[depth:depth + reach, width - 1]
            alive = alive * hit
            at_least.append(alive.view(1, -1))  # P(the accepted path reaches depth + 1) from each start
        weight = visit_weights(at_least)[0]
        total += float((torch.cat(at_least).sum(0) * weight).sum())
        count += float(weight.sum())
    return total / max(count, 1e-12)


def choose(hits: torch.Tensor, heldout: HeldOut, cost: dict, candidates: list[tuple] = CANDIDATES) -> dict[str, dict]:
    """Per domain (and overall): the candidate with the highest predicted speedup under `cost` (a cost summary,
    pipeline/measure/cost_profile.py), chains included."""
    result = {}
    for domain, mask in domain_index(heldout).items():
        predictions = []
        for factors in candidates:
            accepted = simulate(hits, heldout, mask, factors)
            predictions.append({"tree": list(factors), "accepted": accepted, "predicted_speedup": pass_speedup(
                accepted, len(factors), nodes(factors), cost, tree=set(factors) != {1})})
        result[domain] = max(predictions, key=lambda p: p["predicted_speedup"])  # the first of equals
    return result
