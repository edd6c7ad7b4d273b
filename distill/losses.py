"""Distillation losses between the target (teacher, p) and the draft (q), one value per completion position ([N];
the trainer masks and averages), in fp32. **p is the target distribution, q the draft's** (pipeline/sampling.py).
- `fkl`  forward KL(p ‖ q) (mass-covering; the classic KD loss, Hinton et al. 2015)
- `rkl`  reverse KL(q ‖ p) (mode-seeking; MiniLLM, Gu et al. 2024)
- `jsd`  generalised JSD(β) = β KL(p ‖ m) + (1−β) KL(q ‖ m), m = β p + (1−β) q (GKD, Agarwal et al. 2024, eq. 1;
         the dense path is TRL's `generalized_jsd_loss`)
- `tvd`  ½ Σ |p − q| = 1 − Σ min(p, q): one minus the acceptance rate itself (Leviathan et al. 2023; DistillSpec)
- `ce`   −log q(y) on the target's sampled token (sequence-level KD, Kim & Rush 2016)
- `top1` −log q(argmax p): greedy serving accepts a drafted token only where the argmaxes agree (DistillSpec's
         "divergence chosen for the decoding mode"); 0 where the draft cannot predict the target's argmax
- `lk_alpha` = −log α and `lk_lambda` = λ KL(p ‖ q) + (1 − λ) TV, λ = exp(−η·sg(ᾱ)), one detached λ per call (LK
         losses, Samarin et al. 2026, arXiv 2602.23881, as vLLM speculators' `nla` / `lk_hybrid` and NVIDIA
         Model-Optimizer's `masked_lk_lambda_loss` define them)
The loss temperature divides both models' logits before the softmax (no T² factor, as TRL); ce and top1 have none.

Two teacher forms. **Dense** (online target forward): teacher logits over the draft's classes, so under an FR-Spec
subset the target renormalised over the subset (mass outside it is unreachable for any draft). **Top-k**
(`SparseTeacher`, cached at T=1): `tail=bucket` makes the rest one "other" class holding the teacher's remaining
*reachable* mass (1 − Σ top-k, or P(S) − Σ listed-in-S for a subset draft, P(S) from distill/labels.py), floored at
`TAIL_FLOOR`: exactly the online teacher projected onto k+1 classes at T=1 (at T≠1 the tail is assumed even, which
overstates it for T>1: use teacher=online there); `renormalize` renormalises the top-k (reverse KL is then infinite,
and refused).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.errors import PipelineError

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd", "lk_alpha", "lk_lambda")
LOSSES = (*DIVERGENCES, "ce", "top1")
TAILS = ("bucket", "renormalize")
# η of LK^λ: the decay of the KL weight with acceptance, λ = exp(−η ᾱ); 3 in vLLM speculators' `lk_hybrid` and NVIDIA
# Model-Optimizer's `masked_lk_lambda_loss` (both citing arXiv 2602.23881).
LK_ETA = 3.0


def check_loss(name: str, beta: float, tail: str, teacher: str) -> None:
    """One-line errors for a loss configuration that cannot work."""
    if name not in LOSSES:
        raise PipelineError(f"unknown distillation loss {name!r}: use distill.objective.loss=one of {', '.join(LOSSES)}")
    if name == "jsd" and not 0.0 < float(beta) < 1.0:
        raise PipelineError(f"distill.objective.beta={beta} is outside (0, 1): JSD(β) needs 0 < β < 1 "
                            "(use loss=fkl for β→0 or loss=rkl for β→1)")
    if tail not in TAILS:
        raise PipelineError(f"unknown distill.objective.topk_tail={tail!r}: use bucket or renormalize")
    if name == "rkl" and teacher == "topk" and tail == "renormalize":
        raise PipelineError("reverse KL against a renormalised top-k teacher is infinite: "
                            "use distill.objective.topk_tail=bucket or distill.objective.teacher=online")


# ---------------------------------------------------------------- divergences on aligned log-probs
# log_p, log_q: [N, C] log-probabilities over the same C classes (-inf = zero mass). Return [N].

def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a ‖ b) = Σ a (log a − log b), with 0 log 0 = 0."""
    a = log_a.exp()
    terms = torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a))
    return terms.sum(-1)


def jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def tvd(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def acceptance(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """α = Σ min(p, q): the probability that speculative sampling accepts a token drafted from q (Leviathan et al.
    2023)."""
    return torch.minimum(log_p, log_q).exp().sum(-1)


def lk_alpha(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """LK^α = −log α (module docstring)."""
    return -torch.log(acceptance(log_p, log_q).clamp_min(torch.finfo(torch.float32).tiny))


def lk_lambda(log_p: torch.Tensor, log_q: torch.Tensor, eta: float = LK_ETA) -> torch.Tensor:
    """LK^λ = λ KL(p ‖ q) + (1 − λ) TV(p, q) with one detached λ = exp(−η ᾱ) for all positions (module docstring)."""
    weight = torch.exp(-eta * acceptance(log_p, log_q).mean().detach())
    return weight * _kl(log_p, log_q) + (1 - weight) * tvd(log_p, log_q)


# exp(-1e4) is 0 in fp32: a floor that keeps zero-mass classes at zero probability while their log stays
# finite, so logaddexp/exp never see (-inf) - (-inf) and gradients stay free of NaN.
LOG_FLOOR = -1e4


def divergence(name: str, log_p: torch.Tensor, log_q: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    log_p, log_q = log_p.clamp_min(LOG_FLOOR), log_q.clamp_min(LOG_FLOOR)
    if name == "fkl":
        return _kl(log_p, log_q)
    if name == "rkl":
        return _kl(log_q, log_p)
    if name == "jsd":
        return jsd(log_p, log_q, beta)
    if name == "tvd":
        return tvd(log_p, log_q)
    if name == "lk_alpha":
        return lk_alpha(log_p, log_q)
    if name == "lk_lambda":
        return lk_lambda(log_p, log_q)
    raise PipelineError(f"{name!r} is not a divergence between distributions: use one of {', '.join(DIVERGENCES)}")


# ---------------------------------------------------------------- teachers
# The least mass the "other" class keeps when the listed log-probs (stored in fp16) sum to 1 or more: the truth is
# then a tail below fp16's resolution, and a zero would make reverse KL charge the draft log(q/0) for any mass there.
TAIL_FLOOR = 1e-6


@dataclass
class SparseTeacher:
    """Cached top-k teacher at the loss positions.

    ids: [N, k] columns in the draft's output space (-1 = a token the draft cannot predict, e.g. outside
    its vocabulary subset); logprobs: [N, k] target log-probs at T=1 over the full vocabulary;
    reachable_logmass: [N] log of the target's mass on the draft's classes (0 for a full-vocabulary draft);
    n_unlisted: draft classes not listed, [N] (for the even-tail assumption at T≠1).
    """
    ids: torch.Tensor
    logprobs: torch.Tensor
    reachable_logmass: torch.Tensor
    n_unlisted: torch.Tensor


def sparse_teacher(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int,
                   column_of: torch.Tensor | None = None,
                   subset_logmass: torch.Tensor | None = None) -> SparseTeacher:
    """Builds a SparseTeacher from cached target ids [N, k]. column_of maps a target id to its column in
    the draft's vocabulary subset (-1 outside), None for a full-vocabulary draft; a subset draft needs
    `subset_logmass` [N], the target's log-mass on the subset at each position."""
    logprobs = topk_logprobs.float()
    if column_of is None:
        ids, n_classes = topk_ids.long(), vocab_size
        reachable = torch.zeros_like(logprobs[..., 0])
    else:
        if subset_logmass is None:
            raise PipelineError("a vocabulary-subset draft with cached top-k labels needs the target's mass on the "
                                "subset per position: the distill stage computes it (subset_logmass)")
        ids, n_classes = column_of[topk_ids.long()], int((column_of >= 0).sum())
        reachable = subset_logmass.float().clamp(max=0.0)
    n_listed = (ids >= 0).sum(-1)
    return SparseTeacher(ids, logprobs, reachable, n_classes - n_listed)


def sparse_log_probs(teacher: SparseTeacher, temperature: float, tail: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher log-probs over the k listed classes + 1 "other" class, at the loss temperature: [N, k+1].

    Listed tokens the draft cannot predict (id −1) are dropped and what remains is renormalised over the
    draft's classes: as for the dense teacher, mass outside them is unreachable. Returns (log_p, valid [N, k]).
    """
    lp = teacher.logprobs
    valid = teacher.ids >= 0
    scaled = torch.where(valid, lp / temperature, torch.full_like(lp, -math.inf))
    if tail == "bucket":
        listed_mass = torch.where(valid, lp.exp(), torch.zeros_like(lp)).sum(-1)
        other_mass = (teacher.reachable_logmass.exp() - listed_mass).clamp_min(TAIL_FLOOR)
        # Even-tail assumption at T≠1: each unlisted class holds other/n at T=1, so (other/n)^(1/T) at T.
        n_unlisted = teacher.n_unlisted.to(lp.dtype)
        log_other = torch.log(other_mass / n_unlisted.clamp_min(1)) / temperature + torch.log(n_unlisted.clamp_min(1))
        log_other = torch.where(n_unlisted > 0, log_other, torch.full_like(log_other, -math.inf))
    else:
        log_other = torch.full_like(lp[..., 0], -math.inf)
    logits = torch.cat([scaled, log_other.unsqueeze(-1)], -1)
    return torch.log_softmax(logits, -1), valid


def draft_sparse_log_probs(draft_logits: torch.Tensor, teacher: SparseTeacher, temperature: float,
                           valid: torch.Tensor) -> torch.Tensor:
    """The draft's log-probs on the same k+1 classes: the listed ids, then all other tokens together."""
    z = draft_logits.float() / temperature
    lse = torch.logsumexp(z, -1, keepdim=True)
    ids = teacher.ids.clamp_min(0)
    listed = torch.where(valid, z.gather(-1, ids) - lse, torch.full_like(teacher.logprobs, -math.inf))
    # log of the mass on every unlisted token, computed from the logits (not 1 − Σ listed) for stability
    is_listed = torch.zeros_like(z).scatter_add_(-1, ids, valid.to(z.dtype)) > 0
    none_left = is_listed.all(-1, keepdim=True)  # every class listed: "other" is empty
    # (a row with nothing left keeps its logits here, so logsumexp stays finite and so do its gradients)
    masked = torch.where(is_listed & ~none_left, torch.full_like(z, -math.inf), z)
    other = torch.logsumexp(masked, -1, keepdim=True) - lse
    other = torch.where(none_left, torch.full_like(other, -math.inf), other)
    return torch.cat([listed, other], -1)


# ---------------------------------------------------------------- the loss
def cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """−log q(y) per position; labels −100 (e.g. a token outside the draft's vocabulary subset) give 0."""
    return F.cross_entropy(draft_logits.float(), labels.clamp_min(0), reduction="none") * (labels >= 0)


def teacher_argmax(teacher_logits: torch.Tensor | None = None, teacher: SparseTeacher | None = None) -> torch.Tensor:
    """The target's most likely class per position [N] in the draft's columns; −100 where that token is outside the
    draft's classes (a sparse teacher lists the target's top tokens over the full vocabulary; a dense teacher comes
    sliced to a subset draft's rows, so there it is the subset's argmax)."""
    if teacher_logits is not None:
        return teacher_logits.argmax(-1)
    if teacher is None:
        raise PipelineError("loss=top1 needs a teacher: distill.teacher=online or topk")
    best = teacher.logprobs.argmax(-1, keepdim=True)
    column = teacher.ids.gather(-1, best).squeeze(-1)
    return torch.where(column >= 0, column, torch.full_like(column, -100))


def distillation_loss(name: str, draft_logits: torch.Tensor, *, teacher_logits: torch.Tensor | None = None,
                      teacher: SparseTeacher | None = None, labels: torch.Tensor | None = None,
                      temperature: float = 1.0, beta: float = 0.5, tail: str = "bucket") -> torch.Tensor:
    """Per-position loss [N] for draft logits [N, C] against a dense (teacher_logits [N, C], same classes)
    or a sparse (SparseTeacher) teacher; `ce` uses labels [N] (class indices, −100 = ignore), `top1` the teacher's
    argmax."""
    if name == "ce":
        if labels is None:
            raise PipelineError("loss=ce needs the target's tokens as labels")
        return cross_entropy(draft_logits, labels)
    if name == "top1":
        return cross_entropy(draft_logits, teacher_argmax(teacher_logits, teacher))
    if teacher_logits is not None and name == "jsd":
        return trl_jsd(draft_logits, teacher_logits, beta, temperature)
    if teacher_logits is not None:
        log_p = torch.log_softmax(teacher_logits.float() / temperature, -1)
        log_q = torch.log_softmax(draft_logits.float() / temperature, -1)
    elif teacher is not None:
        log_p, valid = sparse_log_probs(teacher, temperature, tail)
        log_q = draft_sparse_log_probs(draft_logits, teacher, temperature, valid)
    else:
        raise PipelineError(f"loss={name} needs a teacher: distill.teacher=online or topk")
    return divergence(name, log_p, log_q, beta)


def trl_jsd(draft_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """Per-position JSD(β) [N] from TRL's `GKDTrainer.generalized_jsd_loss` (GKD eq. 1), in fp32."""
    per_class = _gkd_trainer().generalized_jsd_loss(draft_logits.float(), teacher_logits.float(), beta=beta,
                                                   temperature=temperature, reduction="none")
    return per_class.sum(-1)


def _gkd_trainer():
    import warnings

    with warnings.catch_warnings():  # the experimental-API warning: the TRL version is pinned in pyproject.toml
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer
    return GKDTrainer

