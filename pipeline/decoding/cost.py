"""The one cost model every prediction uses (distill's calibration, its simulators, eval's report).

A speculative pass drafts with D draft forwards and verifies with one target forward over the drafted tokens;
it yields 1 + A tokens, A the accepted drafts. With c = draft forward / target 1-token forward and r the
verify forward / target 1-token forward (Leviathan et al. 2023, Thm 3.8, with the verify pass costed as
measured instead of as free), the predicted speedup over plain decoding is (1 + A) / (D·c + r).
A chain of γ has D = γ and verifies γ tokens; a token tree has D = its depth and verifies all its nodes.
"""
from __future__ import annotations

from typing import Mapping

from pipeline.sampling import expected_accepted_length


def verify_cost(verify_ratio: Mapping | None, drafted: float) -> float:
    """r(N): the target's forward over N drafted tokens (+ the newest committed one) relative to its 1-token
    forward, from a cost summary's `verify_ratio` {N: r_N} (pipeline/cost_profile.py `summary`), interpolated
    linearly from r_0 = 1 and extended along the last segment beyond the table; None = free verification."""
    if not verify_ratio:
        return 1.0
    points = [(0, 1.0)] + sorted((int(n), float(r)) for n, r in verify_ratio.items())
    for (n0, r0), (n1, r1) in zip(points, points[1:]):
        if drafted <= n1:
            return r0 + (r1 - r0) * (drafted - n0) / max(n1 - n0, 1)
    (n0, r0), (n1, r1) = points[-2], points[-1]
    return r1 + (r1 - r0) / max(n1 - n0, 1) * (drafted - n1)


def predicted_speedup(accepted: float, draft_forwards: float, c: float, verify: float) -> float:
    """(1 + A) / (D·c + r): tokens per pass over the pass's cost in target steps."""
    return (1.0 + accepted) / (draft_forwards * c + verify)


def pass_speedup(accepted: float, draft_forwards: float, drafted: float, cost: Mapping, tree: bool = False) -> float:
    """predicted_speedup with c and r(drafted) from a cost summary {"c", "verify_ratio", "tree_verify_ratio"}:
    a token tree's verify is priced as the tree verifies that were timed (4-D mask, explicit positions: another
    attention path than a chain's), where the profile has them."""
    ratios = (tree and cost.get("tree_verify_ratio")) or cost.get("verify_ratio")
    return predicted_speedup(accepted, draft_forwards, float(cost["c"]), verify_cost(ratios, drafted))


def iid_speedup(alpha, gamma: int, c: float):
    """The closed form for i.i.d. acceptance α and free verification, (1 − α^(γ+1)) / ((1 − α)(γc + 1))
    (Leviathan et al. 2023, Thm 3.8); floats or tensors."""
    return predicted_speedup(expected_accepted_length(alpha, gamma) - 1, gamma, c, 1.0)
