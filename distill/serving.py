"""The serving settings a draft ships with, chosen on the held-out calibration part: draft temperature τ, the
cost profile and c, the best fixed γ and draft-length policy, and token trees, per domain; and their predicted
speedups on the reporting part (distill/calibrate.py, policy.py and tree_choice.py hold the simulators)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from distill import calibrate as cal
from distill import tree_choice
from distill.policy import candidates, choose, keep_at, simulate
from pipeline.cost_profile import measure_cost_profile, read_profile, summary
from pipeline.decoding.cost import pass_speedup
from pipeline.decoding.tree import nodes, tree_key

if TYPE_CHECKING:  # the stage's job object; the stage imports this module
    from distill.stage import DistillJob


def log(msg: str) -> None:
    print(f"[distill] {msg}", flush=True)


def calibrate(job: DistillJob) -> dict:
    """Draft temperature τ per domain, cost ratio c (timed on this device, in the serving dtype), the best
    fixed γ and the best draft-length policy per domain, all chosen on the calibration part."""
    settings = job.settings.calibration
    taus = cal.calibrate_temperature(job.draft, job.calibration, list(settings.tau_ratios), job.vocab,
                                     int(settings.tau_refine))["temperature"]
    gammas = [int(g) for g in settings.gammas]
    lengths = settings.draft_length
    longest = max(gammas + [int(m) for m in lengths.max_lengths])
    job.cost_profile = job.cost_profile or cost_profile(job)  # the draft's shape, not its weights, sets it
    cost = summary(job.cost_profile, max(longest, tree_choice.MAX_NODES))  # r(N) for chains and tree candidates
    cost.update({key: job.cost_profile["machine"].get(key) for key in ("device", "device_name", "dtype", "torch_threads")})
    alpha = cal.acceptance_at(job.draft, job.calibration, taus, job.vocab)
    best = {}
    for domain, mask in cal.domain_index(job.calibration).items():
        per_position = cal.per_position_acceptance(alpha, job.calibration, mask, max(gammas))
        best[domain] = cal.best_gamma(per_position, cost["c"], gammas, cost.get("verify_ratio"))[0]
    thresholds = [float(t) for t in lengths.thresholds]
    keep = keep_at(job.draft, job.calibration, taus, thresholds, job.vocab)
    options = candidates(gammas, thresholds, [int(m) for m in lengths.max_lengths])
    chosen = choose(alpha, keep, job.calibration, options, cost["c"], cost.get("verify_ratio"))
    return {"temperature": taus, "gamma": best, "cost": cost, "tree": choose_trees(job, chosen, cost, taus),
            "draft_length": {domain: entry["draft_length"] for domain, entry in chosen.items()}}


def choose_trees(job: DistillJob, chains: dict, cost: dict, taus: dict) -> dict[str, list | None]:
    """Per domain the token tree that beats the chosen chain policy's predicted speedup on the calibration part
    (distill/tree_choice.py), else None (the chain). Sampled serving with calibration.tree_samples = 0: chains."""
    samples = int(job.settings.calibration.get("tree_samples") or 0)
    if not job.sampling.greedy and not samples:
        return {domain: None for domain in chains}
    hits = tree_choice.hit_table(job.draft, job.calibration, job.vocab, taus, samples, int(job.cfg.seed))
    trees = tree_choice.choose(hits, job.calibration, cost)
    return {domain: tree["tree"] if tree["predicted_speedup"] > chains[domain]["predicted_speedup"]
            and set(tree["tree"]) != {1} else None for domain, tree in trees.items()}


def tree_candidates(job: DistillJob, heldout: cal.HeldOut, calibration: dict) -> dict[str, dict]:
    """{domain: {"3,1": {accepted, nodes, predicted_speedup}}} for every candidate tree (chains included) on
    `heldout`, where trees are calibrated for this serving (eval's tree sweep sets measured beside predicted)."""
    samples = int(job.settings.calibration.get("tree_samples") or 0)
    if not job.sampling.greedy and not samples:
        return {}
    hits = tree_choice.hit_table(job.draft, heldout, job.vocab, calibration["temperature"], samples,
                                 int(job.cfg.seed) + 1)
    out = {}
    for domain, mask in cal.domain_index(heldout).items():
        out[domain] = {}
        for factors in tree_choice.CANDIDATES:
            accepted = tree_choice.simulate(hits, heldout, mask, factors)
            speedup = pass_speedup(accepted, len(factors), nodes(factors), calibration["cost"])
            out[domain][tree_key(factors)] = {"accepted": round(accepted, 4), "nodes": nodes(factors),
                                              "predicted_speedup": round(speedup, 3)}
    return out


def cost_profile(job: DistillJob) -> dict:
    """The cost profile γ and the policy are chosen for: distill.calibration.cost.profile when given (another
    device's, checked against these models' shapes), else measured here in the serving dtype."""
    settings = job.settings.calibration.cost
    if settings.get("profile"):
        rows = len(job.vocab) if job.vocab is not None else None
        profile = read_profile(settings.profile, job.target, job.draft, rows)
        log(f"calibrating for the cost profile {settings.profile} ({profile['machine'].get('device_name')}, "
            f"{profile['machine'].get('dtype')})")
        return profile
    return measure_cost_profile(job.target, job.draft, job.vocab, tuple(settings.tokens_fed), tuple(settings.contexts),
                                repeats=int(settings.repeats), warmup=int(settings.warmup), seed=int(job.cfg.seed))


def predict_speedup(job: DistillJob, heldout: cal.HeldOut, alpha: torch.Tensor, calibration: dict) -> dict:
    """Per domain, the predicted speedup of its chosen draft-length policy on `heldout` (distill/policy.py)."""
    cost, policies, trees = calibration["cost"], calibration["draft_length"], calibration["tree"]
    thresholds = sorted({p.threshold for p in policies.values() if p.policy == "confidence"})
    keep = keep_at(job.draft, heldout, calibration["temperature"], thresholds, job.vocab) if thresholds else {}
    predicted = {}
    for domain, mask in cal.domain_index(heldout).items():
        tree = trees.get(domain, trees[cal.OVERALL])
        if tree:
            predicted[domain] = calibration["tree_candidates"][domain][tree_key(tree)]["predicted_speedup"]
            continue
        policy = policies.get(domain, policies[cal.OVERALL])
        drafted, accepted = simulate(alpha, keep.get(policy.threshold), heldout, mask, policy.max)
        predicted[domain] = round(pass_speedup(accepted, drafted, drafted, cost), 3)
    return predicted
