"""Multi-draft verification for token-tree speculative decoding.

The children of a tree node are several candidates for the same next token. They are verified so that the
token the node finally yields (an accepted child, or a fresh sample when every child is rejected) is
distributed exactly as the target's p at that node; the chosen child's own children then continue from it.

Rule: recursive rejection sampling over candidates drawn WITHOUT replacement from the draft's q
(Yang et al. 2024, "Multi-Candidate Speculative Decoding", arXiv:2401.06706, the without-replacement variant;
Jeon et al. 2024, "Recursive Speculative Decoding", arXiv:2402.14160, RSD-C/RSD-S). For candidates
x_1..x_k in draw order, starting from p_1 = p and q_1 = q:
  accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
  on rejection p_{i+1} = norm(max(0, p_i − q_i)) and q_{i+1} = q_i with x_i removed, renormalised
  (the law of the next draw given the earlier ones);
  after k rejections the token is drawn from p_{k+1}.

Why it is exact (induction from the last candidate): suppose that, whichever x_i was drawn and rejected, the
rest of the procedure yields a token distributed as p_{i+1}. Then the token yielded from step i is y with
probability q_i(y)·min(1, p_i(y)/q_i(y)) + (Σ_x max(0, q_i(x) − p_i(x)))·p_{i+1}(y)
= min(p_i(y), q_i(y)) + max(0, p_i(y) − q_i(y)) = p_i(y), since Σ max(0, q_i − p_i) = Σ max(0, p_i − q_i).
The step needs only that q_i is exactly the law of x_i given the earlier draws, which is why q_{i+1} drops
x_i: sampling without replacement, realised by Gumbel-top-k (Kool et al. 2019, "Stochastic Beams and Where
to Find Them", arXiv:1903.06059), here in its exponential-race form like `pipeline.sampling.sample`.

A greedy draft (temperature 0) proposes its top-k tokens deterministically: then the law of x_i given the
earlier draws is the point mass δ(x_i), and the same rule with q_i = δ(x_i) is exact (a rejection removes
x_i from p_i and renormalises). When q's support is smaller than k (top-k/top-p, a vocabulary subset, a
one-hot q), the draws past the support are marked invalid: the procedure stops there and samples p_i.
"""
import torch

from pipeline.sampling import residual_distribution, sample


def draw_without_replacement(q: torch.Tensor, k: int, generator: torch.Generator | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from each row of q [M, V], in draw order: (index [M, k], valid [M, k]).

    Gumbel-top-k: the k largest q/E with E ~ Exp(1) (log of it = log q + Gumbel noise). A draw is invalid
    when q's support was already exhausted (its key is 0); invalid draws have index 0.
    """
    noise = torch.empty_like(q, dtype=torch.float32).exponential_(1, generator=generator)
    keys, index = (q.float() / noise).topk(min(k, q.shape[-1]), dim=-1)
    valid = keys > 0
    if index.shape[-1] < k:  # more siblings than draft tokens: the extra ones can never be proposed
        pad = k - index.shape[-1]
        index = torch.cat([index, index.new_zeros(q.shape[0], pad)], -1)
        valid = torch.cat([valid, valid.new_zeros(q.shape[0], pad)], -1)
    return index.masked_fill(~valid, 0), valid


def rejection_update(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After x [M] was drawn from q [M, V] and rejected against p [M, V]: (norm(max(0, p − q)), q without x).

    Rows of q whose whole mass was x become all-zero: their next draw is invalid anyway.
    """
    q_next = q.scatter(-1, x.view(-1, 1), 0.0)
    mass = q_next.sum(-1, keepdim=True)
    q_next = torch.where(mass > 0, q_next / mass.clamp_min(torch.finfo(q_next.dtype).tiny), q_next)
    return residual_distribution(p, q), q_next


def verify_siblings(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                    generator: torch.Generator | None = None, draft_greedy: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling at M nodes at once (rule in the module docstring).

    p [M, V]: target distribution at each node; q [M, V]: the draft's distribution the node's children were
    drawn from (ignored, may be None, when draft_greedy: then q_i = δ(x_i)); tokens [M, B]: the children in draw order;
    valid [M, B]: False for padding and for draws past q's support. Returns (accepted rank [M], −1 when every
    child was rejected; the node's token when none is accepted [M], drawn from the last residual, which is p
    itself at a node without children). No host sync.
    """
    p = p.float()
    q = p if q is None else q.float()
    m, width = tokens.shape
    rows = torch.arange(m, device=p.device)
    u = torch.rand(m, width, device=p.device, generator=generator)
    accepted = torch.full((m,), -1, dtype=torch.long, device=p.device)
    for rank in range(width):
        x = tokens[:, rank]
        q_i = torch.nn.functional.one_hot(x, p.shape[-1]).float() if draft_greedy else q
        trying = valid[:, rank] & (accepted < 0)
        # u < p/q without the division; strict '<' so a token p gives 0 is never accepted.
        ok = trying & (u[:, rank] * q_i[rows, x] < p[rows, x])
        accepted = torch.where(ok, rank, accepted)
        p_next, q_next = rejection_update(p, q_i, x)
        rejected = (trying & ~ok).view(-1, 1)
        p, q = torch.where(rejected, p_next, p), torch.where(rejected, q_next, q)
    return accepted, sample(p, generator)


def greedy_verify_siblings(best: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy target and draft: at each node accept the child equal to the target's argmax best [M] (children
    are distinct, so at most one matches). Returns (accepted rank [M] or −1, best)."""
    match = (tokens == best.view(-1, 1)) & valid
    rank = match.long().argmax(-1)
    return torch.where(match.any(-1), rank, torch.full_like(rank, -1)), best

