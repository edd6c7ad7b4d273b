"""Where the plan and the decoder disagree: per domain of the reporting part, the plan's acceptance averaged over
every block start and over the starts the decoder visits (distill/policy.py `visit_weights`), beside the decoder's
own accepted/drafted on the same rows' prompts (the export's τ and FR-Spec head, as many tokens as each completion),
with a bootstrap CI over prompts.

    python -m pipeline.tools acceptance-gap [tool.gammas=[1,2] tool.repeats=2 tool.json=<file>]
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from distill import calibrate as cal
from eval.intervals import acceptance_stat, bootstrap_ci
from distill.policy import simulate
from pipeline.tools.offline import collect_heldouts
from pipeline.decoding import DraftPlan, speculative_generate
from pipeline.errors import PipelineError
from pipeline.models import load_model
from pipeline.sampling import derive_seed
from pipeline.spec import SpeculativeSpec


def predicted(alpha, heldout, mask, gamma: int) -> dict:
    drafted, uniform = simulate(alpha, None, heldout, mask, gamma, renewal=False)
    visited_drafted, renewal = simulate(alpha, None, heldout, mask, gamma)
    return {"every_start": uniform / drafted, "visited_starts": renewal / visited_drafted}


def decoded(inputs, draft, spec, heldout, gamma: int, repeats: int, seed: int) -> dict[str, list[tuple[int, int]]]:
    """{domain: [(accepted, drafted) per request]} from the decoder on every reporting row's prompt."""
    from tqdm.auto import tqdm

    vocab = torch.tensor(spec.vocab_subset) if spec.vocab_subset else None
    out: dict[str, list[tuple[int, int]]] = {}
    for i, (row, domain) in enumerate(tqdm(list(zip(heldout.rows, heldout.domains)), desc=f"decoder γ={gamma}")):
        for r in range(repeats):
            generator = torch.Generator().manual_seed(derive_seed(seed, "gap", i, r) % 2**63)
            stats = speculative_generate(inputs.target, draft, torch.tensor([row["prompt_ids"]]),
                                         sampling=inputs.sampling,
                                         plan=DraftPlan(gamma, spec.for_domain("draft_temperature", domain), vocab),
                                         max_new_tokens=len(row["completion_ids"]), eos_token_id=inputs.stops,
                                         generator=generator).stats
            out.setdefault(domain, []).append((stats.n_accepted, stats.n_drafted))
    return out


def ratio_ci(pairs: list[tuple[int, int]]) -> tuple[float, list[float] | None]:
    """accepted / drafted pooled over requests, with eval's paired bootstrap interval (None below 2 requests)."""
    accepted, drafted = np.array(pairs, dtype=float).T
    return float(acceptance_stat(accepted, drafted)), bootstrap_ci((accepted, drafted), acceptance_stat)


def run(cfg) -> dict:
    options = cfg.tool
    gammas, repeats = list(options.gammas), int(options.repeats)
    if not gammas or min(gammas) < 1 or repeats < 1:
        raise PipelineError(f"tool.gammas={gammas} and tool.repeats={repeats} must be integers >= 1")
    if not (Path(cfg.paths.draft) / "speculative.json").is_file():
        raise PipelineError(f"no draft export at {cfg.paths.draft}: run stage=distill first or set paths.draft=<dir>")
    inputs, heldouts = collect_heldouts(cfg)
    reporting = heldouts.reporting
    spec = SpeculativeSpec.read(cfg.paths.draft)
    draft = load_model(cfg.paths.draft, dtype=next(inputs.target.parameters()).dtype).eval()
    vocab = torch.tensor(spec.vocab_subset) if spec.vocab_subset else None
    taus = {d: spec.for_domain("draft_temperature", d) for d in [*set(reporting.domains), cal.OVERALL]}
    alpha = cal.acceptance_at(draft, reporting, taus, vocab)
    result = {"rows": len(reporting.rows), "positions": reporting.n_positions, "sampling": inputs.sampling.to_dict(),
              "by_gamma": {}}
    for gamma in gammas:
        runs = decoded(inputs, draft, spec, reporting, gamma, repeats, int(cfg.seed))
        runs[cal.OVERALL] = [pair for pairs in runs.values() for pair in pairs]
        table = {}
        for domain, mask in cal.domain_index(reporting).items():
            measured, ci = ratio_ci(runs[domain])
            table[domain] = {**predicted(alpha, reporting, mask, gamma), "decoder": measured, "decoder_ci95": ci,
                             "requests": len(runs[domain])}
        result["by_gamma"][str(gamma)] = table
    print(render(result))
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=2))
    return result


def render(result: dict) -> str:
    lines = [f"held-out reporting part: {result['rows']} rows, {result['positions']} positions, {result['sampling']}"]
    for gamma, table in result["by_gamma"].items():
        lines.append(f"\nγ = {gamma}: acceptance (accepted / drafted)\n{'domain':<15}{'plan, every start':>19}"
                     f"{'plan, visited starts':>22}{'decoder [95% CI]':>26}")
        for domain, row in table.items():
            lo, hi = row["decoder_ci95"] or (float("nan"), float("nan"))
            lines.append(f"{domain:<15}{row['every_start']:>19.3f}{row['visited_starts']:>22.3f}"
                         f"{row['decoder']:>12.3f} [{lo:.3f}, {hi:.3f}]")
    return "\n".join(lines)

