"""Choosing the draft-length policy per domain from the held-out simulator and the measured costs.

A block from held-out position t proposes token k when the policy kept going after tokens 1..k−1 (fixed γ: up to γ;
confidence: while the draft's probability of its own token stays ≥ the threshold, up to `max`), and token k is
accepted when tokens 1..k all are. With acceptance α_t and keep-probabilities κ_t (teacher-forced), a pass drafts
D = Σ_k Π_{i<k−1} κ_{t+i} and accepts A = Σ_k Π_{i<k−1} κ_{t+i} · Π_{i<k} α_{t+i} tokens, priced by
pipeline/decoding/cost.py pass_speedup. Exact at greedy given the teacher-forced prefix; when sampling, acceptance and
stopping are taken as independent given the position. Positions past a completion's end are rejections that still
cost their drafts.
"""
from __future__ import annotations

from typing import Mapping

import torch

from distill.simulator import HeldOut, by_row, domain_index, draft_logits, tau_at
from pipeline.decoding.cost import pass_speedup
from pipeline.decoding.draft_length import DraftLength


@torch.no_grad()
def keep_probabilities(draft, heldout: HeldOut, tau: float, thresholds: list[float], vocab=None) -> torch.Tensor:
    """κ [len(thresholds), N]: the chance the confidence rule keeps drafting after each held-out position.
    Greedy drafting: 1[max softmax ≥ threshold] (the draft's temperature-1 confidence in its argmax, as the
    decoder and HF use). Sampling at τ: Σ_x q(x)·1[q(x) ≥ threshold]."""
    limits = torch.tensor(thresholds, device=next(draft.parameters()).device).view(-1, 1, 1)
    out = []
    for logits in draft_logits(draft, heldout, vocab):
        if tau == 0:
            keep = (logits.softmax(-1).amax(-1) >= limits[:, :, 0]).float()
        else:
            q = heldout.sampling.with_temperature(tau).probs(logits)
            keep = (q * (q >= limits)).sum(-1)
        out.append(keep.cpu())
    return torch.cat(out, 1)


def keep_at(draft, heldout: HeldOut, temperature_of: dict[str, float], thresholds: list[float],
            vocab=None) -> dict[float, torch.Tensor]:
    """{threshold: κ [N]}, each position at its domain's draft temperature (the overall one elsewhere)."""
    tau = tau_at(heldout, temperature_of)
    keep = {t: torch.zeros(heldout.n_positions) for t in thresholds}
    for t in sorted(set(tau.tolist())):
        table, at = keep_probabilities(draft, heldout, t, thresholds, vocab), tau == t
        for i, threshold in enumerate(thresholds):
            keep[threshold][at] = table[i][at]
    return keep


def simulate(alpha: torch.Tensor, keep: torch.Tensor | None, heldout: HeldOut, positions: torch.Tensor,
             max_len: int, stop_before: bool = False, renewal: bool = True) -> tuple[float, float]:
    """(D, A): expected drafted and accepted tokens per pass (module docstring), averaged over the block starts
    the decoder visits (`visit_weights`; renewal=False: over every start alike, which overweights easy stretches).
    keep None = the fixed policy (always keeps going). stop_before: a token is proposed only when its own keep
    holds (llama.cpp's p_min: the block stops before an unsure token), not after it (HF's confidence rule)."""
    if not bool(positions.any()):
        return float(max_len), 0.0
    proposed, accepted = pass_profile(alpha, keep, heldout, positions, max_len, stop_before, renewal)
    return sum(proposed), sum(accepted)


def pass_profile(alpha: torch.Tensor, keep: torch.Tensor | None, heldout: HeldOut, positions: torch.Tensor,
                 max_len: int, stop_before: bool = False, renewal: bool = True) -> tuple[list[float], list[float]]:
    """Per draft position k = 1..max_len, the chance a pass proposes a k-th draft and the chance it accepts at least
    k (what llama-server counts per position, `spec_decode_num_accepted_tokens_per_pos_total`), averaged as
    `simulate` averages; their sums are its (D, A)."""
    proposed, accepted, passes = pass_profile_rows(alpha, keep, heldout, positions, max_len, stop_before, renewal)
    total = float(passes.sum())
    return [float(v) / total for v in proposed.sum(0)], [float(v) / total for v in accepted.sum(0)]


def pass_profile_rows(alpha: torch.Tensor, keep: torch.Tensor | None, heldout: HeldOut, positions: torch.Tensor,
                      max_len: int, stop_before: bool = False,
                      renewal: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pass_profile per held-out row, for intervals over rows: (proposed [rows, max_len], accepted [rows, max_len],
    passes [rows]), each row's expected passes and its expected passes proposing / accepting ≥ k drafts."""
    if not bool(positions.any()):
        return torch.zeros(0, max_len, dtype=torch.float64), torch.zeros(0, max_len, dtype=torch.float64), \
            torch.zeros(0, dtype=torch.float64)
    a, counts = by_row(alpha, heldout, positions, max_len, 0.0)
    k = torch.ones_like(a) if keep is None else by_row(keep, heldout, positions, max_len, 1.0)[0]
    starts = torch.zeros_like(a, dtype=torch.bool)
    for i, n in enumerate(counts):
        starts[i, :n] = True
    proposed = torch.ones_like(a)  # P(token k proposed), for every start t at once
    all_accepted = torch.ones_like(a)
    drafted, at_least = [], []
    for step in range(max_len):
        shifted_a = torch.nn.functional.pad(a[:, step:], (0, step), value=0.0)
        shifted_k = torch.nn.functional.pad(k[:, step:], (0, step), value=1.0)
        all_accepted = all_accepted * shifted_a
        if stop_before:
            proposed = proposed * shifted_k
        drafted.append(proposed)
        at_least.append(proposed * all_accepted)  # P(at least step + 1 drafts accepted)
        if not stop_before:
            proposed = proposed * shifted_k
    weight = (visit_weights(at_least) if renewal else torch.ones_like(a)) * starts
    return (torch.stack([(d * weight).sum(1) for d in drafted], 1),
            torch.stack([(n * weight).sum(1) for n in at_least], 1), weight.sum(1))


def visit_weights(at_least: list[torch.Tensor]) -> torch.Tensor:
    """v [rows, T]: the chance that the decoder starts a pass at each position of a row, starting at its first: a pass
    from t that accepts k drafts starts the next at t + k + 1, so the decoder's acceptance is an average over these
    visits, not over positions (docs/results.md; `python -m pipeline.tools acceptance-gap`). at_least[k] [rows, T]:
    P(at least k + 1 drafts accepted) from each start."""
    rows, width = at_least[0].shape
    ge = torch.stack([torch.ones_like(at_least[0]), *at_least, torch.zeros_like(at_least[0])])
    exactly = (ge[:-1] - ge[1:]).permute(2, 1, 0)  # [T, rows, k]: P(exactly k accepted) from each start
    visits = torch.zeros(rows, width + len(at_least) + 1, dtype=at_least[0].dtype)
    visits[:, 0] = 1.0
    for t in range(width):
        visits[:, t + 1:t + len(at_least) + 2] += visits[:, t:t + 1] * exactly[t]
    return visits[:, :width]


def candidates(gammas: list[int], thresholds: list[float], max_lengths: list[int]) -> list[DraftLength]:
    fixed = [DraftLength("fixed", int(g)) for g in gammas]
    return fixed + [DraftLength("confidence", int(m), float(t)) for m in max_lengths for t in thresholds]


def choose(alpha: torch.Tensor, keep: dict[float, torch.Tensor], heldout: HeldOut, options: list[DraftLength],
           cost: Mapping) -> dict[str, dict]:
    """Per domain (and OVERALL): the option with the highest predicted speedup under the cost summary `cost`
    (pipeline/decoding/cost.py pass_speedup), with its D, A and speedup."""
    result = {}
    for domain, mask in domain_index(heldout).items():
        predictions = []
        for option in options:
            policy_keep = keep[option.threshold] if option.policy == "confidence" else None
            drafted, accepted = simulate(alpha, policy_keep, heldout, mask, option.max)
            predictions.append({"draft_length": option, "drafted": drafted, "accepted": accepted,
                                "predicted_speedup": pass_speedup(accepted, drafted, drafted, cost)})
        result[domain] = max(predictions, key=lambda p: p["predicted_speedup"])  # the first of equals
    return result

