"""Adaptive draft temperature against the calibrated fixed τ, per domain, on the same requests.

    python -m eval.tau_bench --target artifacts/models/<target> --draft artifacts/draft [--per-domain 4] [--shape chain]

At the draft's calibrated serving temperature (speculative.json `sampling`, T = 0.7 for the default export), every
held-out domain decodes its first user turns twice, interleaved per request (the order alternates): under the online
guard at its default settings with the calibrated τ of the domain fixed, and the same with `adaptive_tau` on. Both
use the domain's calibrated plan (`--shape tree`: its token tree where it has one, else its draft-length policy;
`--shape chain`: its draft-length policy), its guard prior and the FR-Spec subset, and one seed per request shared by
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

from eval.bench import DEFAULT_PROMPTS, load_pair
from eval.metrics import bootstrap_ci
from eval.stage import tree_prior
from pipeline.chat import encode_chat, stop_token_ids
from pipeline.decoding import Guard, GuardSettings, GuardStats, speculative_generate
from pipeline.errors import OneLineParser, PipelineError, one_line_errors, require_positive
from pipeline.prompts import load_prompts
from pipeline.sampling import derive_seed
from pipeline.spec import SpeculativeSpec
from pipeline.timing import synced_clock

METHODS = ("fixed", "adaptive")


def domain_turns(path: Path, per_domain: int) -> dict[str, list[str]]:
    """{domain: the first user turn of its first `per_domain` prompts}, domains in file order."""
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


def decode_domain(target, draft, tokenizer, prompts: list[str], plan: dict, sampling, vocab, domain: str) -> dict:
    """{method: per-request rows (tokens, seconds, target passes, accepted, drafted)} and adaptive τ's decisions."""
    clock, stop = synced_clock(torch.device("cpu")), stop_token_ids(tokenizer, target)
    rows, decisions = {m: [] for m in METHODS}, GuardStats()
    for i, turn in enumerate(prompts):
        ids = encode_chat(tokenizer, [{"role": "user", "content": turn}])
        for method in METHODS if i % 2 == 0 else reversed(METHODS):
            generator = torch.Generator().manual_seed(derive_seed("tau_bench", domain, i))
            start = clock()
            out = speculative_generate(target, draft, ids, sampling=sampling, drafting=plan["drafting"],
                                       max_new_tokens=plan["max_new_tokens"], draft_vocab=vocab,
                                       draft_temperature=plan["draft_temperature"], eos_token_id=stop,
                                       generator=generator, guard=plan["guards"][method])
            s = out.stats
            rows[method].append((len(out.tokens), clock() - start, s.target_passes, s.n_accepted, s.n_drafted))
            if method == "adaptive":
                decisions = decisions.add(s.guard)
    return {"rows": {m: np.array(r, dtype=float) for m, r in rows.items()}, "decisions": decisions}


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


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SpeculativeSpec.read(args.draft)
    if spec is None or not spec.draft_temperature or spec.sampling.greedy:
        raise PipelineError(f"{args.draft} has no sampled calibration (speculative.json with a draft τ): "
                            "nothing to adapt")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    target, draft, tokenizer = load_pair(args, torch.device("cpu"), dtype)
    vocab = torch.tensor(spec.vocab_subset, dtype=torch.long) if spec.vocab_subset else None
    turns = domain_turns(args.prompts, args.per_domain)
    plans = {domain: domain_plan(spec, domain, args.shape) | {"max_new_tokens": args.max_new_tokens}
             for domain in turns}
    hello = encode_chat(tokenizer, [{"role": "user", "content": "Hello, who are you?"}])
    for warm in plans.values():  # allocator, kernels, lazy imports and every plan's shapes out of the timed runs
        for guard in warm["guards"].values():
            speculative_generate(target, draft, hello, sampling=spec.sampling, drafting=warm["drafting"],
                                 max_new_tokens=16, draft_vocab=vocab, draft_temperature=warm["draft_temperature"],
                                 guard=guard)
    results, pooled, total = {}, {m: [] for m in METHODS}, GuardStats()
    for domain, prompts in turns.items():
        done = decode_domain(target, draft, tokenizer, prompts, plans[domain], spec.sampling, vocab, domain)
        results[domain] = summary(done["rows"], done["decisions"]) | {"tau": plans[domain]["draft_temperature"]}
        for m in METHODS:
            pooled[m].append(done["rows"][m])
        total = total.add(done["decisions"])
        print(f"[tau_bench] {domain}: {format_row(domain, results[domain])}", file=sys.stderr, flush=True)
    results["overall"] = summary({m: np.concatenate(pooled[m]) for m in METHODS}, total) | {"tau": None}
    return {"sampling": spec.sampling.to_dict(), "shape": args.shape, "domains": results}


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


def main(argv=None):
    parser = OneLineParser(prog="python -m eval.tau_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF model directory of the target")
    parser.add_argument("--draft", required=True, help="the exported draft's directory (with speculative.json)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--per-domain", type=int, default=4, help="requests per domain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--shape", choices=["tree", "chain"], default="tree",
                        help="tree: each domain's calibrated token tree where it has one; chain: its draft-length "
                             "policy")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = parser.parse_args(argv)
    args.draft_layers = 2  # load_pair's fallback when there is no draft; --draft is required here
    with one_line_errors("tau_bench"):
        require_positive(args, "per_domain", "max_new_tokens")
        print(report(run(args)))


if __name__ == "__main__":
    main()
