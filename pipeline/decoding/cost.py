"""The one cost model every prediction uses (distill's calibration, its simulators, eval's report).

A pass of D draft forwards and one target verify yields 1 + A tokens; with c = draft forward / target 1-token
forward, r the verify forward over the same step (Leviathan et al. 2023, Thm 3.8, the verify costed as measured)
and the decoder's host work h_0 per plain pass, h(N) per speculative pass of N drafted tokens or tree nodes
(pipeline/measure/pass_overhead.py), the speedup over plain decoding is (1 + A)(1 + h_0) / (D·c + r + h(N)); a cost summary
without a `host` block prices host work at 0. A chain of γ has D = γ; a token tree has D = its depth.
"""
from __future__ import annotations

from typing import Mapping


def verify_cost(verify_ratio: Mapping | None, drafted: float) -> float:
    """r(N): the target's forward over N drafted tokens (+ the newest committed one) relative to its 1-token
    forward, from a cost summary's `verify_ratio` {N: r_N} (pipeline/measure/cost_profile.py `summary`), interpolated
    linearly from r_0 = 1 and extended along the last segment beyond the table; None = free verification."""
    if not verify_ratio:
        return 1.0
    points = [(0, 1.0)] + sorted((int(n), float(r)) for n, r in verify_ratio.items())
    for (n0, r0), (n1, r1) in zip(points, points[1:]):
        if drafted <= n1:
            return r0 + (r1 - r0) * (drafted - n0) / max(n1 - n0, 1)
    (n0, r0), (n1, r1) = points[-2], points[-1]
    return r1 + (r1 - r0) / max(n1 - n0, 1) * (drafted - n1)


def host_cost(host: Mapping | None, drafted: float, tree: bool = False) -> tuple[float, float]:
    """(h_0, h(drafted)): the host work of a plain pass and of a speculative pass drafting `drafted` tokens (a
    tree: verifying that many nodes), in target steps, from a cost summary's `host` block, linear between the
    measured points and extended along the nearest segment beyond them; (0, 0) without one. A pass of no drafts
    is a plain pass."""
    if not host:
        return 0.0, 0.0
    plain = float(host["plain"])
    table = host.get("tree" if tree else "chain") or host.get("chain") or {}
    points = sorted((float(n), float(h)) for n, h in table.items())
    if drafted <= 0 or not points:
        return plain, plain
    if len(points) == 1:
        return plain, points[0][1]
    i = next((j for j in range(len(points) - 1) if drafted <= points[j + 1][0]), len(points) - 2)
    (n0, h0), (n1, h1) = points[i], points[i + 1]
    return plain, max(0.0, h0 + (h1 - h0) * (drafted - n0) / (n1 - n0))


def predicted_speedup(accepted: float, draft_forwards: float, c: float, verify: float) -> float:
    """(1 + A) / (D·c + r): tokens per pass over the pass's cost in target steps."""
    return (1.0 + accepted) / (draft_forwards * c + verify)


def pass_speedup(accepted: float, draft_forwards: float, drafted: float, cost: Mapping, tree: bool = False) -> float:
    """predicted_speedup with c, r(drafted) and the host work from a cost summary {"c", "verify_ratio",
    "tree_verify_ratio", "host"}: a token tree's verify is priced as the tree verifies that were timed (4-D mask,
    explicit positions: another attention path than a chain's), where the profile has them. Every cost is
    relative to a plain pass (its forward and its host work), the baseline every speedup is measured against."""
    ratios = (tree and cost.get("tree_verify_ratio")) or cost.get("verify_ratio")
    plain, host = host_cost(cost.get("host"), drafted, tree)
    pass_cost = draft_forwards * float(cost["c"]) + verify_cost(ratios, drafted) + host
    return predicted_speedup(accepted, 0.0, 0.0, pass_cost / (1.0 + plain))
