"""Sweeps on a subset of the eval's requests: γ (acceptance and speedup per draft length) and token-tree shapes
(measured speedup beside distill's prediction), each point interleaved with an autoregressive run of the same
request, timed with eval/harness.py's helpers."""
from __future__ import annotations

from eval import metrics as M
from eval.drafts import Evaluation
from eval.fidelity import first_prompts
from eval.harness import rotated, timed
from pipeline.sampling import derive_seed
from pipeline.timing import synced_clock


def _interleaved_runs(requests: list[dict], points: dict, methods: dict, evaluation: Evaluation, seed: int,
                      label: str) -> dict:
    """{"ar": [...], key: [...]}: each request decoded autoregressively and by the evaluated draft at every point
    {key: speculative keyword arguments}, in rotating order, with seeds of their own (not the main run's)."""
    from tqdm.auto import tqdm

    settings, clock = evaluation.settings, synced_clock(evaluation.device)
    runs: dict = {"ar": [], **{key: [] for key in points}}
    for k, request in enumerate(tqdm(requests, desc=f"{label} sweep", unit="req", dynamic_ncols=True)):
        request_seed = derive_seed(seed, f"eval-{label}-sweep", k)
        for key in rotated(list(runs), k):
            fn, kw = (methods["autoregressive"], {}) if key == "ar" else (methods[M.SPECULATIVE], points[key])
            tokens, stats, seconds = timed(fn, request["ids"], request["domain"], settings.max_new_tokens,
                                           request_seed, clock, **kw)
            runs[key].append({"tokens": tokens, "time_s": seconds, "stats": stats})
    return runs


def gamma_sweep(contexts: list[dict], methods: dict, evaluation: Evaluation, seed: int) -> dict:
    """Acceptance and speedup vs γ (tuned draft) on the first eval.sweep_prompts_per_domain prompts per domain,
    each γ interleaved with an autoregressive run of the same request."""
    settings = evaluation.settings
    requests = first_prompts(contexts, settings.sweep_prompts_per_domain)
    runs = _interleaved_runs(requests, {gamma: {"gamma": gamma} for gamma in settings.gammas}, methods,
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
    runs = _interleaved_runs(requests, points, methods, evaluation, seed, "tree")

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
