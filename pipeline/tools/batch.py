"""Batched speculative decoding against batched plain decoding at several batch sizes, side by side in one run.

    python -m pipeline.tools batch [tool.batch_sizes=[1,2,4,8] tool.draft=<export> tool.target=<model dir>]
    python -m pipeline.tools batch tool.calibrated=true [tool.domain=default]

On the first user turns of a prompt JSONL (chat template applied; prompts of different lengths). For each batch
size B the prompts are cut into batches of B rows and each batch is decoded by both methods back to back in eval's
rotating order (pipeline/tools/common.py `measure`), over tool.repeats rounds, after a warm-up. Prints per B the tokens/s of each method, the speedup
(speculative tokens/s over plain, pooled over the batches) with its paired bootstrap 95% CI over the batches, the
acceptance and, greedy, whether the rows' outputs were identical (they must be: greedy batched speculation is
lossless per row). Asserts nothing about wall-clock. The break-even batch is where speculation stops paying as B
grows (pipeline/batch_profile.py `break_even`); the smallest B whose CI lies below 1 is printed beside it.

Default: greedy, a fixed tool.gamma, and the prediction from a batch profile timed here (pipeline/batch_profile.py: at
each B the forwards of 1 and γ + 1 new tokens per row, a draft step and the batched loop's host work per pass)
through `batch_cost`, priced by the one cost model with the accepted drafts per pass measured at the smallest B;
`no host` beside it is the same γ priced by its forwards alone.

tool.calibrated=true: the export's per-batch-size calibration (speculative.json `batching`, distill/batching.py) for one
domain, at the export's serving sampling and draft temperature. At each B speculation runs with the best γ there
(`gamma_if_on`), so the measured break-even is seen even where the calibration says "off"; the calibrated policy
is that measurement where it drafts and batched plain decoding (the same computation as the baseline: 1×) where
it is off. The prediction is the calibration's own (`predicted_speedup`, from the batch profile it was made with;
`no host`: its `predicted_speedup_no_host`, absent from a calibration made before host work was timed).
"""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from eval.metrics import _speedup_stat, bootstrap_ci
from pipeline.batch_profile import batch_cost, break_even, forwards_only, measure_batch_profile
from pipeline.chat import encode_chat
from pipeline.decoding import GREEDY, DraftPlan, autoregressive_generate_batch, pass_speedup, speculative_generate_batch
from pipeline.errors import PipelineError
from pipeline.spec import SpeculativeSpec
from pipeline.tools.common import check_given_dirs, first_turns, load_pair, measure as measure_rotated, model_dir


def draft_vocab(draft_dir: Path) -> torch.Tensor | None:
    """The FR-Spec head subset of an exported draft (speculative.json `vocab_subset`), as eval uses it."""
    spec = SpeculativeSpec.read(draft_dir)
    return torch.tensor(spec.vocab_subset, dtype=torch.long) if spec is not None and spec.vocab_subset else None


def batches_of(prompts: list, size: int) -> list[list]:
    return [prompts[i:i + size] for i in range(0, len(prompts) - size + 1, size)]


def methods_at(pair, gamma: int, args) -> dict:
    """The two decoders of one batch size as eval's harness calls them, fn(rows, domain, n, seed) -> (tokens, stats);
    both draw from a generator of the batch's seed, so a sampled batch is decoded from the same seed by each."""
    common = {"sampling": args.sampling, "eos_token_id": pair.stop}

    def plain(rows, _domain, n, seed):
        out = autoregressive_generate_batch(pair.target, rows, max_new_tokens=n,
                                            generator=torch.Generator().manual_seed(seed), **common)
        return [t.tolist() for t in out.tokens], out.stats

    def speculative(rows, _domain, n, seed):
        out = speculative_generate_batch(pair.target, pair.draft, rows,
                                         plan=DraftPlan(gamma, args.draft_temperature, args.vocab), max_new_tokens=n,
                                         generator=torch.Generator().manual_seed(seed), **common)
        return [t.tolist() for t in out.tokens], out.stats

    return {"plain": plain, "speculative": speculative}


def measure(pair, prompts: list, args) -> dict:
    """{B: {plain, speculative: [(tokens, seconds) per timed batch], accepted, drafted, identical}}."""
    out = {}
    for size in args.batch_sizes:
        requests = [{"ids": rows, "domain": "default", "seed": 1000 * repeat + k}
                    for repeat in range(args.repeats) for k, rows in enumerate(batches_of(prompts, size))]
        records = measure_rotated(methods_at(pair, args.gamma_at[size], args), requests, args.max_new_tokens,
                                  pair.clock)
        stats = [s for r in records["speculative"] for s in r["stats"]]
        accepted, drafted = sum(s.n_accepted for s in stats), sum(s.n_drafted for s in stats)
        identical = all(a["tokens"] == b["tokens"] for a, b in zip(records["plain"], records["speculative"]))
        out[size] = {**{name: [(sum(map(len, r["tokens"])), r["time_s"]) for r in recs]
                        for name, recs in records.items()},
                     "acceptance": accepted / drafted if drafted else 0.0,
                     "identical": identical if args.sampling.greedy else None,
                     "accepted": accepted, "drafting_passes": sum(d > 0 for s in stats for d in s.drafted)}
    return out


def predict(target, draft, measured: dict, args, clock) -> dict:
    """{B: {c, r, predicted, no_host}} from a batch profile timed at each B (batch_cost, host work included) and
    the accepted drafts per pass at the smallest B."""
    first = measured[min(measured)]
    accepted = first["accepted"] / first["drafting_passes"] if first["drafting_passes"] else 0.0
    profile = measure_batch_profile(target, draft, list(measured), sorted({g + 1 for g in args.gamma_at.values()}),
                                    clock, args.vocab, sampling=args.sampling)
    out = {}
    for size in measured:
        gamma, cost = args.gamma_at[size], batch_cost(profile, size)
        out[size] = {"target_step_ms": cost["target_step_ms"], "c": cost["c"], "r": cost["verify_ratio"][gamma],
                     "accepted_per_pass": accepted, "predicted": pass_speedup(accepted, gamma, gamma, cost),
                     "no_host": pass_speedup(accepted, gamma, gamma, forwards_only(cost))}
    return out


def predict_calibrated(spec: SpeculativeSpec, domain: str, sizes) -> dict:
    """{B: {c, r, predicted, gamma}} as the export's batching calibration priced them (no timing here)."""
    block = spec.batching
    name = domain if domain in block["by_domain"] else "default"
    out = {}
    for size in sizes:
        key = str(size)
        gamma = block["gamma_if_on"][name][key]
        cost = block["cost"]["by_batch"][key]
        out[size] = {"c": cost["c"], "r": cost["verify_ratio"][str(gamma)], "gamma": gamma,
                     "policy_gamma": block["by_domain"][name][key],
                     "predicted": block["predicted_speedup"][name][key],
                     "no_host": block.get("predicted_speedup_no_host", {}).get(name, {}).get(key)}
    return out


def summarize(measured: dict) -> dict:
    rows = {}
    for size, m in measured.items():
        (tok_s, sec_s), (tok_p, sec_p) = (np.array(m[k], dtype=float).T for k in ("speculative", "plain"))
        samples = (tok_s, sec_s, tok_p, sec_p)
        rows[size] = {"plain_tok_s": tok_p.sum() / sec_p.sum(), "spec_tok_s": tok_s.sum() / sec_s.sum(),
                      "speedup": float(_speedup_stat(*samples)), "ci95": bootstrap_ci(samples, _speedup_stat),
                      "n_batches": len(tok_s), "acceptance": m["acceptance"], "identical": m["identical"]}
    losing = [size for size, r in rows.items() if r["ci95"] and r["ci95"][1] < 1.0]
    return {"by_batch": rows, "ci_below_one": min(losing) if losing else None,
            "break_even": break_even({size: r["speedup"] for size, r in rows.items()})}


def _ci(r: dict) -> str:
    return "[n<2]" if r["ci95"] is None else f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"


def within_one_step(sizes: list[int], predicted, measured) -> bool:
    """Whether two break-even batches lie at most one grid step apart (None = beyond the largest B)."""
    index = {size: i for i, size in enumerate(sorted(sizes))} | {None: len(sizes)}
    return abs(index[predicted] - index[measured]) <= 1


def report(summary: dict, args) -> str:
    subset = "full vocabulary" if args.vocab is None else f"FR-Spec subset of {len(args.vocab):,} tokens"
    lines = [f"{args.sampling}, draft temperature {args.draft_temperature}, max_new_tokens={args.max_new_tokens}, "
             f"{args.n_prompts} prompts, repeats={args.repeats}, torch threads={torch.get_num_threads()}, "
             f"{args.dtype}, draft head: {subset}" + (f", calibrated for {args.domain}" if args.calibrated else ""),
             f"{'B':>3} {'γ':>2} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup [95% CI]':>26} {'n':>3} "
             f"{'accept':>7} {'identical':>9} {'c(B)':>6} {'r(B)':>6} {'predicted':>9} {'no host':>8}"
             + ("  policy" if args.calibrated else "")]
    predicted = summary["predicted"]
    for size, r in summary["by_batch"].items():
        p = predicted[size]
        line = (f"{size:>3} {args.gamma_at[size]:>2} {r['plain_tok_s']:>12.1f} {r['spec_tok_s']:>11.1f} "
                f"{r['speedup']:>8.3f}× {_ci(r):>16} {r['n_batches']:>3} {r['acceptance']:>7.3f} "
                f"{str(r['identical']):>9} {p['c']:>6.3f} {p['r']:>6.2f} {p['predicted']:>8.3f}× "
                f"{'-' if p['no_host'] is None else format(p['no_host'], '.3f') + '×':>8}")
        if args.calibrated:
            line += (f"  γ={p['policy_gamma']}: {r['speedup']:.3f}× {_ci(r)}" if p["policy_gamma"]
                     else "  off: plain decoding (1×)")
        lines.append(line)
    predicted_break = break_even({size: p["predicted"] for size, p in predicted.items()})  # on this run's grid
    sizes = list(summary["by_batch"])
    lines.append(f"break-even batch: measured {summary['break_even']} (smallest B whose CI is below 1: "
                 f"{summary['ci_below_one']}), predicted {predicted_break}: "
                 f"{'within' if within_one_step(sizes, predicted_break, summary['break_even']) else 'not within'} "
                 "one step of the grid" + (f" (calibrated grid: {summary['calibrated_break_even']})"
                                           if args.calibrated else ""))
    if args.calibrated:
        slower = [size for size, r in summary["by_batch"].items()
                  if predicted[size]["policy_gamma"] and r["ci95"] and r["ci95"][1] < 1.0]
        lines.append(f"calibrated policy slower than batched plain beyond the CI at: {slower or 'none'}")
    return "\n".join(lines)


def options(cfg) -> SimpleNamespace:
    args = SimpleNamespace(**cfg.tool)
    for key in ("n_prompts", "max_new_tokens", "gamma", "repeats"):
        if getattr(args, key) < 1:
            raise PipelineError(f"tool.{key}={getattr(args, key)} is not an integer >= 1")
    args.batch_sizes = list(args.batch_sizes or [])
    if not args.batch_sizes or min(args.batch_sizes) < 1 or max(args.batch_sizes) > args.n_prompts:
        raise PipelineError(f"tool.batch_sizes={args.batch_sizes} must be integers in [1, tool.n_prompts "
                            f"{args.n_prompts}]")
    return args


def plan(args, draft_dir: Path) -> SpeculativeSpec | None:
    """Sets what each B runs (args.gamma_at, sampling, draft temperature, vocab); the export's spec, if any."""
    spec = SpeculativeSpec.read(draft_dir)
    args.vocab = draft_vocab(draft_dir) if args.vocab_subset else None
    if not args.calibrated:
        args.sampling, args.draft_temperature = GREEDY, None
        args.gamma_at = {size: args.gamma for size in args.batch_sizes}
        return spec
    if spec is None or not spec.batching:
        raise PipelineError(f"{draft_dir} has no per-batch-size calibration (speculative.json `batching`): run "
                            f"`python -m pipeline.tools batching tool.draft={draft_dir}` first")
    missing = sorted(set(args.batch_sizes) - set(spec.batching["batch_sizes"]))
    if missing:
        raise PipelineError(f"tool.batch_sizes {missing} are not calibrated (speculative.json batching has "
                            f"{spec.batching['batch_sizes']}): pass calibrated batch sizes or recalibrate")
    name = args.domain if args.domain in spec.batching["by_domain"] else "default"
    args.sampling, args.draft_temperature = spec.sampling, spec.for_domain("draft_temperature", args.domain)
    args.gamma_at = {size: spec.batching["gamma_if_on"][name][str(size)] for size in args.batch_sizes}
    return spec


def run(cfg) -> dict:
    args = options(cfg)
    check_given_dirs(cfg)
    spec = plan(args, model_dir(cfg, "draft"))  # a bad plan fails before any model loads
    turns = first_turns(args.prompts, args.n_prompts)
    pair = load_pair(cfg)
    args.dtype = str(pair.dtype).removeprefix("torch.")
    prompts = [encode_chat(pair.tokenizer, [{"role": "user", "content": turn["text"]}])[0].to(pair.device)
               for turn in turns]
    measured = measure(pair, prompts, args)
    summary = summarize(measured)
    if args.calibrated:
        summary["predicted"] = predict_calibrated(spec, args.domain, args.batch_sizes)
        name = args.domain if args.domain in spec.batching["break_even"] else "default"
        summary["calibrated_break_even"] = spec.batching["break_even"][name]
    else:
        summary["predicted"] = predict(pair.target, pair.draft, measured, args, pair.clock)
    print(report(summary, args))
    return summary
