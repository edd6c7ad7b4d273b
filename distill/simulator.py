"""The acceptance simulator, draft-temperature calibration and the best fixed γ, on held-out collected rows,
teacher-forced: at each completion position the target's serving distribution p_T (pipeline/sampling.py) meets the
draft's q_τ (same filters, draft temperature τ, FR-Spec subset head if any). A position accepts with
α = Σ_x min(p_T(x), q_τ(x)) (Leviathan et al. 2023, Def. 3.1; argmax agreement at T=0); a block of γ drafts from t
accepts its first k with P_k = Π_{i<k} α_{t+i}, averaged over t, so a pass yields 1 + Σ_{k≤γ} P_k tokens. P_k = α^k
gives Leviathan et al.'s formula; the measured P_k keep the burstiness of real acceptance (easy stretches).
"""
from __future__ import annotations

from typing import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from distill.aligned import Truncation, batches, completion_hidden
from pipeline.decoding.cost import pass_speedup
from pipeline.errors import PipelineError
from pipeline.heads import column_map, head_logits, head_rows
from pipeline.measure.intervals import bootstrap_ci
from pipeline.sampling import Sampling, expected_acceptance

OVERALL = "overall"


@dataclass
class HeldOut:
    """Held-out rows with the target's serving distribution at each completion position (computed once): p_ids /
    p_probs [N, m] its m most likely tokens (T=0: the argmax), `p_tail` [N] the mass left out (bounds α's error)."""
    rows: list[dict]
    domains: list[str]
    p_ids: torch.Tensor
    p_probs: torch.Tensor
    p_tail: torch.Tensor
    row_of: torch.Tensor
    sampling: Sampling
    batch_size: int
    pad_token_id: int

    @property
    def n_positions(self) -> int:
        return int(self.p_ids.shape[0])

    def batches(self, device):
        return batches(self.rows, self.batch_size, self.pad_token_id, device)  # rows are stored truncated


def _device(model):
    return next(model.parameters()).device


@torch.no_grad()
def build_heldout(target, rows: list[dict], sampling: Sampling, truncation: Truncation, support: int, batch_size: int,
                  pad_token_id: int) -> HeldOut:
    """One target pass over the held-out rows, each with its `domain` (rows without a prompt or a completion are
    dropped)."""
    domains = [r["domain"] for r in rows]
    rows = [dict(zip(("prompt_ids", "completion_ids"), truncation(r))) for r in rows]
    keep = [i for i, r in enumerate(rows) if r["prompt_ids"] and r["completion_ids"]]
    rows, domains = [rows[i] for i in keep], [domains[i] for i in keep]
    target.eval()
    ids, probs, tails, row_of = [], [], [], []
    m = 1 if sampling.greedy else support
    rows_of_head = head_rows(target)
    for b, (batch, mask) in enumerate(batches(rows, batch_size, pad_token_id, _device(target))):
        p = sampling.probs(head_logits(completion_hidden(target, batch)[mask], rows_of_head))
        top = p.topk(min(m, p.shape[-1]), -1)
        ids.append(top.indices.cpu())
        probs.append(top.values.cpu())
        tails.append((1 - top.values.sum(-1)).clamp_min(0).cpu())
        row_of.append((torch.arange(mask.shape[0], device=mask.device)[:, None] + b * batch_size)
                      .expand_as(mask)[mask].cpu())
    return HeldOut(rows, domains, torch.cat(ids), torch.cat(probs), torch.cat(tails), torch.cat(row_of),
                   sampling, batch_size, pad_token_id)


@torch.no_grad()
def draft_logits(draft, heldout: HeldOut, vocab: torch.Tensor | None = None):
    """Per batch of held-out positions, in order: the draft's logits [n, C] over its head (the FR-Spec subset's rows
    when `vocab` is set), computed in eval mode."""
    was_training = draft.training
    draft.eval()
    device = _device(draft)
    rows = head_rows(draft, None if vocab is None else vocab.to(device))
    for batch, mask in heldout.batches(device):
        yield head_logits(completion_hidden(draft, batch)[mask], rows)
    draft.train(was_training)


@torch.no_grad()
def acceptance(draft, heldout: HeldOut, temperatures: list[float], vocab: torch.Tensor | None = None,
               filtered: bool = True) -> torch.Tensor:
    """α per held-out position for each draft temperature τ: [len(temperatures), N]; filtered=False: q without the
    serving top-k/top-p (an engine that applies only the temperature to its draft, pipeline/engines/rules.py)."""
    device = _device(draft)
    column_of = column_map(None if vocab is None else vocab.to(device), draft.config.vocab_size)
    draft_sampling = heldout.sampling if filtered else Sampling(heldout.sampling.temperature)
    out, start = [], 0
    for logits in draft_logits(draft, heldout, vocab):
        n = logits.shape[0]
        p_ids = heldout.p_ids[start:start + n].to(device)
        p = heldout.p_probs[start:start + n].to(device)
        cols = p_ids if column_of is None else column_of[p_ids]
        alphas = []
        for tau in temperatures:
            q = draft_sampling.with_temperature(tau).probs(logits)
            q_at = q.gather(-1, cols.clamp_min(0)) * (cols >= 0)  # q is 0 outside the subset
            alphas.append(expected_acceptance(p, q_at).cpu())
        out.append(torch.stack(alphas))
        start += n
    return torch.cat(out, 1)


@torch.no_grad()
def acceptance_at(draft, heldout: HeldOut, temperature_of: dict[str, float], vocab=None) -> torch.Tensor:
    """α per held-out position [N], each position at its domain's draft temperature (OVERALL's elsewhere)."""
    tau = tau_at(heldout, temperature_of)
    taus = sorted(set(tau.tolist()))
    alpha = torch.zeros(heldout.n_positions)
    for t, table in zip(taus, acceptance(draft, heldout, taus, vocab)):
        at = tau == t
        alpha[at] = table[at]
    return alpha


def tau_at(heldout: HeldOut, temperature_of: dict[str, float]) -> torch.Tensor:
    """The draft temperature of each held-out position [N]: its domain's, OVERALL's where the domain has none."""
    tau = torch.full((heldout.n_positions,), float(temperature_of[OVERALL]), dtype=torch.float64)  # τ exactly
    for domain, mask in domain_index(heldout).items():
        if domain != OVERALL:
            tau[mask] = float(temperature_of.get(domain, temperature_of[OVERALL]))
    return tau


def domain_index(heldout: HeldOut) -> dict[str, torch.Tensor]:
    """Domain -> boolean mask over positions, plus OVERALL."""
    row_domains = heldout.domains
    names = sorted(set(row_domains))
    per_row = torch.tensor([names.index(d) for d in row_domains])
    pos_domain = per_row[heldout.row_of]
    masks = {d: pos_domain == i for i, d in enumerate(names)}
    masks[OVERALL] = torch.ones_like(pos_domain, dtype=torch.bool)
    return masks


def row_sums(alpha: torch.Tensor, heldout: HeldOut, mask: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per held-out row (of the positions `mask` selects; all by default): Σ α over its positions and their count."""
    mask = torch.ones(heldout.n_positions, dtype=torch.bool) if mask is None else mask
    rows, values = heldout.row_of[mask].numpy(), alpha[mask].double().numpy()
    present = np.unique(rows)
    return np.array([values[rows == r].sum() for r in present]), np.array([(rows == r).sum() for r in present])


def _difference(base, other, counts, axis=-1):
    """(other − base) of the position-weighted means over rows."""
    return (np.sum(other, axis=axis) - np.sum(base, axis=axis)) / np.sum(counts, axis=axis)


def paired_difference(base: np.ndarray, other: np.ndarray, counts: np.ndarray) -> tuple[float, list[float] | None]:
    """other − base (row sums of two drafts on the same rows) with its paired bootstrap interval over rows."""
    return float(_difference(base, other, counts)), bootstrap_ci((base, other, counts), _difference)


def keep_best(initial: torch.Tensor, trained: torch.Tensor, heldout: HeldOut, rule: str) -> dict:
    """keep_best's verdict from α per position of the initial and the trained weights on one held-out part:
    {"selected": "distilled" | "init", "rule", "initial", "trained", "difference", "ci95"}. "interval": the trained
    weights ship only when the paired 95% interval over rows of (trained − initial) lies above 0, so a difference
    the part cannot resolve keeps the weights the user brought (docs/results.md); "mean": unless their mean is lower,
    ties keeping them. Below two rows there is no interval and "interval" judges as "mean"."""
    base, counts = row_sums(initial, heldout)
    delta, ci = paired_difference(base, row_sums(trained, heldout)[0], counts)
    wins = ci[0] > 0 if rule == "interval" and ci is not None else delta >= 0
    return {"selected": "distilled" if wins else "init", "rule": rule, "initial": round(float(initial.mean()), 4),
            "trained": round(float(trained.mean()), 4), "difference": round(delta, 4),
            "ci95": None if ci is None else [round(v, 4) for v in ci]}


def by_row(values: torch.Tensor, heldout: HeldOut, positions: torch.Tensor, length: int, fill: float):
    """[rows, T + length] per held-out row (completion order), padded with `fill` past each row's end."""
    rows = heldout.row_of[positions]
    chosen = values[positions].double()
    names = rows.unique()
    counts = [int((rows == r).sum()) for r in names]
    table = torch.full((len(names), max(counts) + length), fill, dtype=torch.float64)
    for i, r in enumerate(names):
        table[i, :counts[i]] = chosen[rows == r]
    return table, counts


def per_position_windows(alpha: torch.Tensor, heldout: HeldOut, positions: torch.Tensor,
                         gamma_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per held-out row (of those with a selected position) and k = 1..γmax: the sum over the row's blocks of
    Π_{i<k} α_{t+i} (the first k drafts of the block starting at t all accepted) and the number of such blocks
    (windows that fit inside the completion): two [rows, γmax] float64 tensors. Kept per row so that
    speculation_profile.json can resample rows for its intervals."""
    if not bool(positions.any()):
        return torch.zeros((0, gamma_max), dtype=torch.float64), torch.zeros((0, gamma_max), dtype=torch.float64)
    a = by_row(alpha, heldout, positions, 0, float("nan"))[0]
    sums = torch.zeros((a.shape[0], gamma_max), dtype=torch.float64)
    counts = torch.zeros_like(sums)
    prod = torch.ones_like(a)
    for k in range(1, gamma_max + 1):
        prod = prod[:, :a.shape[1] - k + 1] * a[:, k - 1:]  # prod[t] = Π_{i<k} a[t+i]
        valid = ~torch.isnan(prod)
        sums[:, k - 1], counts[:, k - 1] = prod.nan_to_num(0.0).sum(1), valid.sum(1)
    return sums, counts


def per_position_acceptance(alpha: torch.Tensor, heldout: HeldOut, positions: torch.Tensor, gamma_max: int) -> list[float]:
    """P_k, k = 1..γmax: the chance that the first k drafts of a block are all accepted, averaged over the
    block's start position (windows that fit inside a completion), for the positions selected by `positions`."""
    sums, counts = per_position_windows(alpha, heldout, positions, gamma_max)
    result = []
    for total, n in zip(sums.sum(0).tolist(), counts.sum(0).tolist()):
        result.append(total / n if n else result[-1] if result else 0.0)
    return result


def summarize(alpha: torch.Tensor, heldout: HeldOut, gamma: int, gamma_max: int = 8) -> dict[str, dict]:
    """Per domain (+ overall): expected acceptance, per-position acceptance, mean accepted length at γ (expected
    tokens per target pass)."""
    out = {}
    for name, mask in domain_index(heldout).items():
        per_position = per_position_acceptance(alpha, heldout, mask, max(gamma, gamma_max))
        out[name] = {"acceptance": float(alpha[mask].mean()) if mask.any() else 0.0,
                     "mean_accepted_length": 1.0 + sum(per_position[:gamma]),  # the accepted drafts + one token
                     "per_position_acceptance": per_position[:max(gamma, gamma_max)],
                     "positions": int(mask.sum())}
    return out


def heldout_metrics(summary: dict[str, dict], gamma: int, prefix: str = "heldout") -> dict[str, float]:
    """Flat MLflow metrics from `summarize`."""
    flat = {}
    for name, s in summary.items():
        flat[f"{prefix}/acceptance/{name}"] = s["acceptance"]
        flat[f"{prefix}/mean_accepted_length_g{gamma}/{name}"] = s["mean_accepted_length"]
    return flat


def calibrate_temperature(draft, heldout: HeldOut, ratios: list[float], vocab=None, refine: int = 5) -> dict:
    """Per domain and overall, the draft temperature τ maximising mean α against p_T.

    τ is searched as a multiple of the serving temperature T over `ratios`, then refined on `refine` points
    (geometric) between the best ratio's neighbours: two passes over the held-out rows in all. T=0 (greedy):
    τ = 0, α = argmax agreement. Returns {"temperature": {d: τ}, "acceptance": {d: α(τ)},
    "acceptance_at_serving": {d: α(T)}, "alpha": {d: per-position α at d's τ}}.
    """
    T = heldout.sampling.temperature
    masks = domain_index(heldout)
    if T == 0:
        alpha = acceptance(draft, heldout, [0.0], vocab)[0]
        acc = {d: float(alpha[m].mean()) for d, m in masks.items()}
        return {"temperature": {d: 0.0 for d in masks}, "acceptance": acc, "acceptance_at_serving": acc,
                "alpha": {d: alpha for d in masks}}
    ratios = sorted(set(float(r) for r in ratios) | {1.0})
    taus = [r * T for r in ratios]
    table = dict(zip(taus, acceptance(draft, heldout, taus, vocab)))
    fine = set()
    for d, m in masks.items():
        best = max(range(len(taus)), key=lambda i: float(table[taus[i]][m].mean()))
        lo, hi = taus[max(best - 1, 0)], taus[min(best + 1, len(taus) - 1)]
        if hi > lo and refine > 0:
            fine.update(lo * (hi / lo) ** (j / (refine + 1)) for j in range(1, refine + 1))
    fine = sorted(t for t in fine if t not in table)
    if fine:
        table.update(zip(fine, acceptance(draft, heldout, fine, vocab)))
    result = {"temperature": {}, "acceptance": {}, "acceptance_at_serving": {}, "alpha": {}}
    for d, m in masks.items():
        tau = max(table, key=lambda t: float(table[t][m].mean()))
        result["temperature"][d] = round(tau, 4)
        result["acceptance"][d] = float(table[tau][m].mean())
        result["acceptance_at_serving"][d] = float(table[T][m].mean())
        result["alpha"][d] = table[tau]
    return result


def best_gamma(per_position: list[float], cost: Mapping, gammas) -> tuple[int, dict[int, float]]:
    """(γ, {γ: speedup}): the fixed chain of `gammas` with the highest predicted speedup by the one cost model, A =
    Σ_{k≤γ} P_k accepted drafts per pass, γ draft forwards and the verify of γ drafts as `cost` prices them ({"c": c}
    alone: free verification, Leviathan et al. Thm 3.8)."""
    speedups = {int(g): pass_speedup(sum(per_position[:int(g)]), int(g), int(g), cost)
                for g in gammas if int(g) <= len(per_position)}
    if not speedups:
        raise PipelineError(f"per_position_acceptance has {len(per_position)} positions, fewer than every γ of "
                            f"{list(gammas)}: calibrate with smaller gammas")
    return max(speedups, key=speedups.get), speedups


@torch.no_grad()
def out_of_subset_fill(draft, heldout: HeldOut, vocab: torch.Tensor | None) -> torch.Tensor | None:
    """The head row an export gives every token outside the FR-Spec subset (pipeline.heads.bake_subset): minus
    the mean direction ū of the draft's final hidden states h on `heldout`, scaled so that such a token scores
    −(|b| + 1), b the median best in-subset logit, where h·ū is at its median. Final hidden states share one dominant
    direction, so these rows stay far below the subset's best instead of at 0, which takes a share of the draft's
    mass when sampling (docs/results.md)."""
    if vocab is None:
        return None
    device = _device(draft)
    states = torch.cat([completion_hidden(draft, batch)[mask] for batch, mask in heldout.batches(device)])
    hidden = states.float()
    direction = hidden.mean(0)
    direction = direction / direction.norm()
    best = head_logits(states, head_rows(draft, vocab.to(device))).amax(-1).median()  # in the draft's own dtype
    return -direction * (best.abs() + 1) / (hidden @ direction).median().clamp_min(1e-3)
