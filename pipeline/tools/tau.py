"""Adaptive draft temperature against the calibrated fixed τ, per domain, on the same requests.

    python -m pipeline.tools tau [tool.draft=<export> tool.per_domain=4 tool.shape=chain]

At the draft's calibrated serving temperature (speculative.json `sampling`, T = 0.7 for the default export), every
held-out domain decodes its first user turns twice, interleaved per request (the order alternates): under the online
guard at its default settings with the calibrated τ of the domain fixed, and the same with `adaptive_tau` on, in eval's
rotating order (pipeline/tools/common.py `measure`). Both use the domain's calibrated plan (`tool.shape=tree`: its
token tree where it has one, else its draft-length policy; `tool.shape=chain`: its draft-length policy), its guard prior and the FR-Spec subset, and one seed per request shared by
the two, so they draw alike until τ first moves. Prints per domain and overall the speedup ratio adaptive / fixed
(tokens per second) and the ratio of tokens per target pass (free of the clock), each with its paired 95% bootstrap
interval over requests, the acceptance of each, and adaptive τ's mean temperature and moves. Asserts nothing.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from eval.metrics import bootstrap_ci
from pipeline.chat import encode_chat
from pipeline.decoding import DraftPlan, Guard, GuardSettings, GuardStats, speculative_generate
from pipeline.errors import PipelineError
from pipeline.prompts import load_prompts
from pipeline.sampling import derive_seed
from pipeline.spec import SpeculativeSpec, tree_prior
from pipeline.tools.common import check_given_dirs, load_pair, measure, model_dir

METHODS = ("fixed", "adaptive")


def domain_turns(path: Path, per_domain: int) -> dict[str, list[str]]:
    """{domain: the first user turn of its first `per_domain` prompts}, domains in file order."""
    if not Path(path).is_file():
        raise PipelineError(f"tool.prompts={path} is not a file: run `python -m pipeline stage=prepare` or pass a "
                            "prompt JSONL")
    turns: dict[str, list[str]] = {}
    for row in load_prompts(path):
        kept = turns.setdefault(row.get("domain", "default"), [])
        if len(kept) < per_domain:
            kept.append(row["turns"][0])
    return turns


def domain_plan(spec: SpeculativeSpec, domain: str, shape: str) -> dict:
    """speculative_generate's keywords of one domain but the guard, and its two guards."""
    drafting = spec.drafting_for(domain) if shape == "tree" else spec.draft_length_for(domain)
    if drafting is None:
        raise PipelineError(f"the calibration decodes {domain} plainly or has no plan for it: nothing to compare")
    tree = list(drafting) if isinstance(drafting, tuple) else None  # priced as eval's guard_for prices it
    prior = (tree and tree_prior(spec.tree_candidates.get(domain) or spec.tree_candidates.get("overall"), tree)) or \
        spec.per_position_acceptance.get(domain) or spec.per_position_acceptance["overall"]
    fixed = Guard(spec.cost, tuple(prior), GuardSettings())
    return {"drafting": drafting, "draft_temperature": float(spec.for_domain("draft_temperature", domain)),
            "guards": {"fixed": fixed, "adaptive": replace(fixed, settings=replace(fixed.settings, adaptive_tau=True))}}


def decode_domain(pair, prompts: list[str], plan: dict, sampling, vocab, domain: str) -> dict:
    """{method: per-request rows (tokens, seconds, target passes, accepted, drafted)} and adaptive τ's decisions."""
    def method(guard):
        def fn(ids, _domain, n, seed):
            out = speculative_generate(pair.target, pair.draft, ids, sampling=sampling,
                                       plan=DraftPlan(plan["drafting"], plan["draft_temperature"], vocab, guard),
                                       max_new_tokens=n, eos_token_id=pair.stop,
                                       generator=torch.Generator().manual_seed(seed))
            return out.tokens.tolist(), out.stats
        return fn

    requests = [{"ids": encode_chat(pair.tokenizer, [{"role": "user", "content": turn}]).to(pair.device),
                 "domain": domain, "seed": derive_seed("tau_bench", domain, i)} for i, turn in enumerate(prompts)]
    records = measure({m: method(plan["guards"][m]) for m in METHODS}, requests, plan["max_new_tokens"], pair.clock)
    rows = {m: np.array([(len(r["tokens"]), r["time_s"], r["stats"].target_passes, r["stats"].n_accepted,
                          r["stats"].n_drafted) for r in records[m]], dtype=float) for m in METHODS}
    decisions = GuardStats()
    for r in records["adaptive"]:
        decisions = decisions.add(r["stats"].guard)
    return {"rows": rows, "decisions": decisions}


def rate_ratio(a_num, a_den, f_num, f_den, axis=-1):
    """(Σ a_num / Σ a_den) / (Σ f_num / Σ f_den) over the same requests."""
    adaptive = np.sum(a_num, axis=axis) / np.sum(a_den, axis=axis)
    return adaptive / (np.sum(f_num, axis=axis) / np.sum(f_den, axis=axis))


def summary(rows: dict, decisions: GuardStats) -> dict:
    a, f = rows["adaptive"], rows["fixed"]
    speed, per_pass = (a[:, 0], a[:, 1], f[:, 0], f[:, 1]), (a[:, 0], a[:, 2], f[:, 0], f[:, 2])
    out = {"requests": len(a), "speedup": float(rate_ratio(*speed)), "speedup_ci95": bootstrap_ci(speed, rate_ratio),
           "per_pass": float(rate_ratio(*per_pass)), "per_pass_ci95": bootstrap_ci(per_pass, rate_ratio)}
    for name, r in (("fixed", f), ("adaptive", a)):
        out[f"acceptance_{name}"] = r[:, 3].sum() / r[:, 4].sum() if r[:, 4].sum() else 0.0
        out[f"tokens_per_s_{name}"] = r[:, 0].sum() / r[:, 1].sum()
    d = decisions.to_dict()
    return out | {"mean_tau": d.get("mean_draft_temperature"), "tau_up": d["tau_up"], "tau_down": d["tau_down"]}


def run(cfg) -> dict:
    args = cfg.tool
    if args.per_domain < 1 or args.max_new_tokens < 1 or args.shape not in ("tree", "chain"):
        raise PipelineError(f"tool.per_domain={args.per_domain} and tool.max_new_tokens={args.max_new_tokens} must be "
                            f"integers >= 1 and tool.shape={args.shape} tree or chain")
    check_given_dirs(cfg)
    draft_dir = model_dir(cfg, "draft")
    spec = SpeculativeSpec.read(draft_dir)
    if spec is None or not spec.draft_temperature or spec.sampling.greedy:
        raise PipelineError(f"{draft_dir} has no sampled calibration (speculative.json with a draft τ): "
                            "nothing to adapt")
    turns = domain_turns(args.prompts, args.per_domain)
    plans = {domain: domain_plan(spec, domain, args.shape) | {"max_new_tokens": args.max_new_tokens}
             for domain in turns}
    pair = load_pair(cfg)
    vocab = torch.tensor(spec.vocab_subset, dtype=torch.long) if spec.vocab_subset else None
    results, pooled, total = {}, {m: [] for m in METHODS}, GuardStats()
    for domain, prompts in turns.items():
        done = decode_domain(pair, prompts, plans[domain], spec.sampling, vocab, domain)
        results[domain] = summary(done["rows"], done["decisions"]) | {"tau": plans[domain]["draft_temperature"]}
        for m in METHODS:
            pooled[m].append(done["rows"][m])
        total = total.add(done["decisions"])
        print(f"[tau] {domain}: {format_row(domain, results[domain])}", file=sys.stderr, flush=True)
    results["overall"] = summary({m: np.concatenate(pooled[m]) for m in METHODS}, total) | {"tau": None}
    result = {"sampling": spec.sampling.to_dict(), "shape": args.shape, "domains": results}
    print(report(result))
    return result


def _ci(value: float, ci) -> str:
    return f"{value:.3f}× [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}×"


def format_row(domain: str, r: dict) -> str:
    tau = "—" if r["tau"] is None else f"{r['tau']:.3f}"
    mean_tau = "—" if r["mean_tau"] is None else f"{r['mean_tau']:.3f}"
    return (f"| {domain} | {r['requests']} | {tau} | {mean_tau} | {r['tau_up']} / {r['tau_down']} | "
            f"{r['acceptance_fixed']:.3f} | {r['acceptance_adaptive']:.3f} | "
            f"{_ci(r['per_pass'], r['per_pass_ci95'])} | {_ci(r['speedup'], r['speedup_ci95'])} |")


def report(result: dict) -> str:
    lines = [f"T = {result['sampling']['temperature']}, shape: {result['shape']}",
             "| domain | requests | calibrated τ | adaptive: mean τ | moves up / down | acceptance fixed "
             "| acceptance adaptive | tokens per pass adaptive / fixed [95% CI] | speedup adaptive / fixed [95% CI] |",
             "|---|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [format_row(d, r) for d, r in result["domains"].items()])
