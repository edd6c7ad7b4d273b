"""The serving settings a draft ships with, chosen on the held-out calibration part: draft temperature τ, the
cost profile and c, the best fixed γ and draft-length policy, and token trees, per domain; and their predicted
speedups on the reporting part (distill/simulator.py, policy.py and tree_choice.py hold the simulators)."""
from __future__ import annotations

import torch

from distill import simulator as sim
from distill import tree_choice
from distill.heldouts import log
from distill.job import Calibration, Inputs, Split
from distill.policy import candidates, choose, keep_at, simulate
from pipeline.measure.cost_profile import CostPlan, canary_warning, measure_cost_profile, read_profile, summary
from pipeline.decoding.cost import pass_speedup
from pipeline.decoding.spec import Recipe
from pipeline.decoding.tree import nodes, tree_key


def choose_recipe(inputs: Inputs, split: Split, heldout: sim.HeldOut, cost_profile: dict, name: str) -> Calibration:
    """Draft temperature τ per domain, the cost summary of `cost_profile` (c and r(N) for every chain and tree
    considered), the best fixed γ and the best draft-length policy per domain, chosen on `heldout` (the
    calibration part). `name` (the draft's export) heads the "off" line: the stage calibrates two drafts."""
    settings, draft, vocab = inputs.settings.calibration, inputs.draft, split.vocab
    taus = sim.calibrate_temperature(draft, heldout, list(settings.tau_ratios), vocab,
                                     int(settings.tau_refine))["temperature"]
    gammas = [int(g) for g in settings.gammas]
    lengths = settings.draft_length
    longest = max(gammas + [int(m) for m in lengths.max_lengths])
    cost = summary(cost_profile, max(longest, tree_choice.MAX_NODES))  # r(N) for chains and tree candidates
    cost.update({key: cost_profile["machine"].get(key) for key in ("device", "device_name", "dtype", "torch_threads")})
    alpha = sim.acceptance_at(draft, heldout, taus, vocab)
    best = {}
    for domain, mask in sim.domain_index(heldout).items():
        per_position = sim.per_position_acceptance(alpha, heldout, mask, max(gammas))
        best[domain] = sim.best_gamma(per_position, cost, gammas)[0]
    thresholds = [float(t) for t in lengths.thresholds]
    keep = keep_at(draft, heldout, taus, thresholds, vocab)
    options = candidates(gammas, thresholds, [int(m) for m in lengths.max_lengths])
    chosen = choose(alpha, keep, heldout, options, cost)
    trees, tree_speedups = choose_trees(inputs, split, heldout, chosen, cost, taus)
    best_speedup = {domain: max(entry["predicted_speedup"], tree_speedups.get(domain, 0.0))
                    for domain, entry in chosen.items()}
    speculate = {domain: speedup >= 1 + settings.speculate_margin for domain, speedup in best_speedup.items()}
    off = [domain for domain, on in speculate.items() if not on]
    if off:
        predicted = ", ".join(f"{d} {best_speedup[d]:.2f}×" for d in off)
        log(f"{name}: plain decoding (off) for {', '.join(off)}: no drafting predicted "
            f"≥ {1 + settings.speculate_margin:.2f}× on the calibration part ({predicted})")
    recipes = {domain: Recipe(speculate[domain], entry["draft_length"], best[domain],
                              tuple(trees[domain]) if trees[domain] else None, taus[domain])
               for domain, entry in chosen.items()}
    return Calibration(recipes, cost, sim.out_of_subset_fill(draft, heldout, vocab))


def choose_trees(inputs: Inputs, split: Split, heldout: sim.HeldOut, chains: dict, cost: dict,
                 taus: dict) -> tuple[dict[str, list | None], dict[str, float]]:
    """Per domain the token tree that beats the chosen chain policy's predicted speedup on the calibration part
    (distill/tree_choice.py), else None (the chain), and each chosen tree's predicted speedup. Sampled serving
    with calibration.tree_samples = 0: chains."""
    samples = int(inputs.settings.calibration.tree_samples)
    if not inputs.sampling.greedy and not samples:
        return {domain: None for domain in chains}, {}
    hits = tree_choice.hit_table(inputs.draft, heldout, split.vocab, taus, samples, int(inputs.cfg.seed))
    best = tree_choice.choose(hits, heldout, cost)
    wins = {domain: tree["predicted_speedup"] > chains[domain]["predicted_speedup"] and set(tree["tree"]) != {1}
            for domain, tree in best.items()}
    return ({domain: tree["tree"] if wins[domain] else None for domain, tree in best.items()},
            {domain: tree["predicted_speedup"] for domain, tree in best.items() if wins[domain]})


def tree_candidates(inputs: Inputs, split: Split, heldout: sim.HeldOut, calibration: Calibration) -> dict[str, dict]:
    """{domain: {"3,1": {accepted, nodes, predicted_speedup}}} for every candidate tree (chains included) on
    `heldout`, where trees are calibrated for this serving (eval's tree sweep sets measured beside predicted)."""
    samples = int(inputs.settings.calibration.tree_samples)
    if not inputs.sampling.greedy and not samples:
        return {}
    hits = tree_choice.hit_table(inputs.draft, heldout, split.vocab, calibration.temperature, samples,
                                 int(inputs.cfg.seed) + 1)
    out = {}
    for domain, mask in sim.domain_index(heldout).items():
        out[domain] = {}
        for factors in tree_choice.CANDIDATES:
            accepted = tree_choice.simulate(hits, heldout, mask, factors)
            speedup = pass_speedup(accepted, len(factors), nodes(factors), calibration.cost, tree=set(factors) != {1})
            out[domain][tree_key(factors)] = {"accepted": round(accepted, 4), "nodes": nodes(factors),
                                              "predicted_speedup": round(speedup, 3)}
    return out


def cost_profile(inputs: Inputs, vocab: torch.Tensor | None) -> dict:
    """The cost profile γ and the policy are chosen for: calibrate.cost.profile when given (another
    device's, checked against these models' shapes), else measured here in the serving dtype, with the decoder's
    host work per pass at the serving sampling. The draft's shape, not its weights, sets it."""
    settings = inputs.settings.calibration.cost
    if settings.profile:
        rows = len(vocab) if vocab is not None else None
        profile = read_profile(settings.profile, inputs.target, inputs.draft, rows)
        log(f"calibrating for the cost profile {settings.profile} ({profile['machine'].get('device_name')}, "
            f"{profile['machine'].get('dtype')})" + ("" if "host" in profile else
                                                     "; it has no host block: the decoder's work between forwards "
                                                     "is priced at 0"))
    else:
        plan = CostPlan(tuple(settings.tokens_fed), tuple(settings.contexts), int(settings.repeats),
                        int(settings.warmup), seed=int(inputs.cfg.seed))
        profile = measure_cost_profile(inputs.target, inputs.draft, vocab, plan, host_sampling=inputs.sampling)
    if "host" in profile:
        host = profile["host"]
        log(f"decoder host work per pass (target steps): plain {host['plain']:.3f}, chain "
            + ", ".join(f"{n} drafted {h:.3f}" for n, h in host["chain"].items()) + ", tree "
            + ", ".join(f"{n} nodes {h:.3f}" for n, h in host["tree"].items()))
    warning = canary_warning(profile)
    if warning:
        log(f"warning: {warning}")
    return profile


def predict_speedup(inputs: Inputs, split: Split, heldout: sim.HeldOut, alpha: torch.Tensor, calibration: Calibration,
                    trees: dict[str, dict]) -> dict:
    """Per domain, the predicted speedup of its chosen drafting on `heldout`: the tree's from `trees`
    (tree_candidates), else the draft-length policy's (distill/policy.py)."""
    recipes = calibration.recipes
    thresholds = sorted({r.chain.threshold for r in recipes.values() if r.chain.policy == "confidence"})
    keep = keep_at(inputs.draft, heldout, calibration.temperature, thresholds, split.vocab) if thresholds else {}
    predicted = {}
    for domain, mask in sim.domain_index(heldout).items():
        recipe = recipes.get(domain, recipes[sim.OVERALL])
        if recipe.tree:
            predicted[domain] = trees[domain][tree_key(recipe.tree)]["predicted_speedup"]
            continue
        policy = recipe.chain
        drafted, accepted = simulate(alpha, keep.get(policy.threshold), heldout, mask, policy.max)
        predicted[domain] = round(pass_speedup(accepted, drafted, drafted, calibration.cost), 3)
    return predicted
