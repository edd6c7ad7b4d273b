"""Sweeps on a subset of the eval's requests: γ (acceptance and speedup per draft length), token-tree shapes
(measured speedup beside distill's prediction) and batch sizes (batched speculation against batched plain
decoding), each point interleaved with a plain run of the same request, timed with eval/harness.py's helpers."""
from __future__ import annotations

from functools import partial

from eval import metrics as M
from eval.drafts import Evaluation
from eval.fidelity import first_prompts
from eval.harness import by_method, time_requests
from pipeline.measure.batch_profile import BatchPlan, batch_cost, break_even, forwards_only, measure_batch_profile
from pipeline.decoding import DraftPlan, autoregressive_generate_batch, pass_speedup, speculative_generate_batch
from pipeline.sampling import derive_seed
from pipeline.timing import synced_clock


def _interleaved_runs(requests: list[dict], methods: dict, evaluation: Evaluation, seed: int, label: str,
                      warmup: bool = False) -> dict:
    """{name: [{tokens, time_s, stats}] per request}: each request decoded by every method {name: fn(ids, domain, n,
    seed)} through the harness, with seeds of their own (not the main run's); `warmup`: an untimed first decode
    (new shapes, a batch size, choose their kernels there)."""
    settings = evaluation.settings
    requests = [r | {"seed": derive_seed(seed, f"eval-{label}-sweep", k)} for k, r in enumerate(requests)]
    records = time_requests(requests, methods, settings.max_new_tokens, synced_clock(evaluation.device),
                            f"{label} sweep", settings.warmup_tokens if warmup else None)
    return by_method(records)


def _against_plain(methods: dict, points: dict) -> dict:
    """{"ar": plain decoding, key: the evaluated draft with that point's keyword arguments}."""
    speculative = methods[M.SPECULATIVE]
    return {"ar": methods["autoregressive"], **{key: partial(speculative, **kw) for key, kw in points.items()}}


def gamma_sweep(contexts: list[dict], methods: dict, evaluation: Evaluation, seed: int) -> dict:
    """Acceptance and speedup vs γ (tuned draft) on the first eval.sweep_prompts_per_domain prompts per domain."""
    settings = evaluation.settings
    requests = first_prompts(contexts, settings.sweep_prompts_per_domain)
    runs = _interleaved_runs(requests, _against_plain(methods, {g: {"gamma": g} for g in settings.gammas}),
                             evaluation, seed, "gamma")
    return {"gammas": settings.gammas, "n_prompts_per_domain": settings.sweep_prompts_per_domain,
            "n_requests": len(requests),
            "by_gamma": {str(gamma): M.sweep_point(runs[gamma], runs["ar"]) for gamma in settings.gammas}}


def tree_sweep(contexts: list[dict], methods: dict, evaluation: Evaluation, seed: int) -> dict:
    """Measured speedup of each tree of eval.trees (evaluated draft) beside distill's prediction for it
    (speculative.json `tree_candidates`, request-weighted over the domains), on the sweep's requests."""
    settings = evaluation.settings
    spec = evaluation.drafts[M.SPECULATIVE].spec
    candidates = (spec.tree_candidates if spec is not None and spec.sampling == evaluation.sampling else {}) or {}
    requests = first_prompts(contexts, settings.sweep_prompts_per_domain)
    points = {",".join(map(str, tree)): {"tree": tuple(int(b) for b in tree)} for tree in settings.trees}
    runs = _interleaved_runs(requests, _against_plain(methods, points), evaluation, seed, "tree")

    def predicted(key: str) -> float | None:
        values = [candidates.get(r["domain"], candidates.get("default", {})).get(key, {}).get("predicted_speedup")
                  for r in requests]
        return None if not values or None in values else sum(values) / len(values)

    by_tree = {}
    for key in points:
        point = M.sweep_point(runs[key], runs["ar"])
        point["drafted_per_pass"] = M.speculative_counters(runs[key], 1.0)["drafted_per_pass"]
        by_tree[key] = point | {"predicted_speedup": predicted(key)}
    return {"trees": settings.trees, "n_prompts_per_domain": settings.sweep_prompts_per_domain,
            "n_requests": len(requests), "by_tree": by_tree}


# ---------------------------------------------------------------- batch sizes

def batch_methods(evaluation: Evaluation, plan: DraftPlan) -> dict:
    """Batched plain and speculative decoding as fn(rows, domain, n, seed) -> (tokens per row, stats per row)."""
    common = {"sampling": evaluation.sampling, "eos_token_id": evaluation.stop}

    def plain(rows, _domain, n, seed):
        out = autoregressive_generate_batch(evaluation.target, rows, max_new_tokens=n,
                                            generator=evaluation.generator(seed), **common)
        return [t.tolist() for t in out.tokens], out.stats

    def speculative(rows, _domain, n, seed):
        out = speculative_generate_batch(evaluation.target, evaluation.drafts[M.SPECULATIVE].model, rows, plan=plan,
                                         max_new_tokens=n, generator=evaluation.generator(seed), **common)
        return [t.tolist() for t in out.tokens], out.stats

    return {"plain": plain, "speculative": speculative}


def batch_point(runs: dict, greedy: bool) -> dict:
    """{plain, speculative: [(tokens, seconds) per batch], acceptance, identical, accepted, drafting_passes}."""
    stats = [s for r in runs["speculative"] for s in r["stats"]]
    accepted, drafted = sum(s.n_accepted for s in stats), sum(s.n_drafted for s in stats)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["plain"], runs["speculative"]))
    return {**{name: [(sum(map(len, r["tokens"])), r["time_s"]) for r in recs] for name, recs in runs.items()},
            "acceptance": accepted / drafted if drafted else 0.0, "identical": same if greedy else None,
            "accepted": accepted, "drafting_passes": sum(d > 0 for s in stats for d in s.drafted)}


def predict_calibrated(batching: dict, sizes) -> dict:
    """{B: {c, r, gamma, policy_gamma, predicted, no_host}} as speculative.json `batching` priced them."""
    name, out = "default", {}
    for size in sizes:
        key = str(size)
        gamma, cost = batching["gamma_if_on"][name][key], batching["cost"]["by_batch"][key]
        out[size] = {"c": cost["c"], "r": cost["verify_ratio"][str(gamma)], "gamma": gamma,
                     "policy_gamma": batching["by_domain"][name][key],
                     "predicted": batching["predicted_speedup"][name][key],
                     "no_host": batching.get("predicted_speedup_no_host", {}).get(name, {}).get(key)}
    return out


def predict_from_profile(target, draft, measured: dict, gamma_at: dict, vocab, sampling, clock) -> dict:
    """{B: {c, r, gamma, predicted, no_host}} from a batch profile timed here (host work priced by batch_cost) and the
    accepted drafts per pass measured at the smallest B."""
    first = measured[min(measured)]
    accepted = first["accepted"] / first["drafting_passes"] if first["drafting_passes"] else 0.0
    plan = BatchPlan(tuple(measured), tuple(sorted({g + 1 for g in gamma_at.values()})), sampling=sampling)
    profile = measure_batch_profile(target, draft, plan, clock, vocab)
    out = {}
    for size in measured:
        gamma, cost = gamma_at[size], batch_cost(profile, size)
        out[size] = {"c": cost["c"], "r": cost["verify_ratio"][gamma], "gamma": gamma,
                     "predicted": pass_speedup(accepted, gamma, gamma, cost),
                     "no_host": pass_speedup(accepted, gamma, gamma, forwards_only(cost))}
    return out


def within_one_step(sizes: list[int], predicted, measured) -> bool:
    """Whether two break-even batches lie at most one grid step apart (None = beyond the largest B)."""
    index = {size: i for i, size in enumerate(sorted(sizes))} | {None: len(sizes)}
    return abs(index[predicted] - index[measured]) <= 1


def summarize_batches(measured: dict, predicted: dict | None = None) -> dict:
    """Per B the speedup with its paired CI over the batches; the measured and (with `predicted`) predicted
    break-even batch, and the smallest B whose CI lies below 1."""
    rows = {}
    for size, m in measured.items():
        (tok_s, sec_s), (tok_p, sec_p) = (list(zip(*m[k])) for k in ("speculative", "plain"))
        speedup, ci = M.paired_ratio((tok_s, sec_s, tok_p, sec_p))
        rows[size] = {"plain_tok_s": sum(tok_p) / sum(sec_p), "spec_tok_s": sum(tok_s) / sum(sec_s), "speedup": speedup,
                      "ci95": ci, "n_batches": len(tok_s), "acceptance": m["acceptance"], "identical": m["identical"],
                      **(predicted or {}).get(size, {})}
    losing = [size for size, r in rows.items() if r["ci95"] and r["ci95"][1] < 1.0]
    out = {"by_batch": rows, "ci_below_one": min(losing) if losing else None,
           "break_even": break_even({size: r["speedup"] for size, r in rows.items()})}
    if predicted:
        out["predicted_break_even"] = break_even({size: p["predicted"] for size, p in predicted.items()})
        out["within_one_step"] = within_one_step(list(rows), out["predicted_break_even"], out["break_even"])
    return out


def batch_sweep(contexts: list[dict], evaluation: Evaluation, seed: int) -> dict:
    """Batched speculation against batched plain decoding at each B of eval.batch_sizes: the first turns of the
    sweep's prompts cut into batches of B, each decoded by both in rotating order, the evaluated draft at the γ its
    per-batch-size calibration gives (speculative.json `batching`, domain `default`, the best γ even where it says
    "off", so the break-even shows) where it has one for this sampling, else its plan's γ. Predicted: that
    calibration's prices, else a batch profile timed here (pipeline/measure/batch_profile.py)."""
    settings, draft = evaluation.settings, evaluation.drafts[M.SPECULATIVE]
    rows = [c["ids"][0] for c in first_prompts(contexts, settings.sweep_prompts_per_domain) if c["turn"] == 0]
    sizes = [size for size in settings.batch_sizes if size <= len(rows)]
    if len(sizes) < len(settings.batch_sizes):
        missing = sorted(set(settings.batch_sizes) - set(sizes))
        print(f"[eval] batch sweep: {len(rows)} prompts make no batch of {missing}: raise "
              "eval.sweep_prompts_per_domain")
    batching = draft.spec.batching if draft.spec is not None and draft.spec.sampling == evaluation.sampling else None
    calibrated = predict_calibrated(batching, sizes) if batching and set(map(str, sizes)) <= set(
        map(str, batching["batch_sizes"])) else None
    plan = evaluation.plans[M.SPECULATIVE]["default"]
    gamma_at = {size: calibrated[size]["gamma"] if calibrated else max(plan.gamma, 1) for size in sizes}
    measured = {}
    for size in sizes:
        batches = [{"ids": rows[i:i + size], "domain": "default"} for i in range(0, len(rows) - size + 1, size)]
        methods = batch_methods(evaluation, DraftPlan(gamma_at[size], plan.draft_temperature, plan.draft_vocab))
        runs = _interleaved_runs(batches, methods, evaluation, seed, f"batch-{size}", warmup=True)
        measured[size] = batch_point(runs, evaluation.sampling.greedy)
    if not measured:
        return {"batch_sizes": [], "n_prompts": len(rows), "by_batch": {}}
    predicted = calibrated or predict_from_profile(evaluation.target, draft.model, measured, gamma_at, plan.draft_vocab,
                                                   evaluation.sampling, synced_clock(evaluation.device))
    return {"batch_sizes": sizes, "n_prompts": len(rows), "prediction": "calibration" if calibrated else "profile",
            **summarize_batches(measured, predicted)}
