"""Drafts side by side on one collect's held-out rows (docs/architecture.md, end of "The distill and calibrate
stages' data flow"): held-out acceptance Σ min(p, q) per domain and each draft's difference from the first with a
paired bootstrap CI over the rows. A draft is an export or a distill stage's trained draft (`${paths.trained}/draft`).

    python -m pipeline.tools compare-drafts paths.collect=<collect> 'tool.drafts=[<export A>,<export B>]'
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from distill import simulator as sim
from distill.heldouts import build_heldouts, load_target_inputs, split_collected
from pipeline.settings import register, setting
from pipeline.modelio.trained import RECORD, read_record
from pipeline.errors import PipelineError
from pipeline.modelio.models import load_model
from pipeline.decoding.spec import SpeculativeSpec


@dataclass(frozen=True)
class CompareDraftsSettings:
    """compare-drafts: drafts side by side on one collect's held-out rows, with paired bootstrap CIs.

    Held-out acceptance per domain on the rows of paths.collect."""
    drafts: tuple[str, ...] = setting([], "two or more draft exports; the first is the one the others are compared with")
    part: str = setting("reporting", "the held-out part judged on: reporting | calibration")
    temperature: str = setting("serving", "the drafts' temperature: serving (the target's) | calibrated (each export's "
                               "own tau) | argmax (drafting the argmax, llama.cpp's rule: alpha = p_T(argmax q))")
    json: str | None = setting(None, "also write the table to this file")


register("tools", CompareDraftsSettings, name="compare-drafts", package="tool")


TEMPERATURES = ("serving", "calibrated", "argmax")


def draft_acceptance(path: str, heldout: sim.HeldOut, dtype: torch.dtype, temperature: str) -> torch.Tensor:
    """α per held-out position [N] of the draft at `path` (an export, or draft/ or draft_init/ of a distill stage's
    ${paths.trained}, uncalibrated), through its own FR-Spec head, the draft at the serving temperature, its own
    calibrated τ, or drafting its argmax (llama.cpp's and SGLang's rule: α = p_T(argmax q))."""
    calibrated = temperature == "calibrated"
    spec = SpeculativeSpec.read(path)
    if spec is None and (calibrated or not (Path(path).parent / RECORD).is_file()):
        raise PipelineError(f"{path} is not a draft export (no speculative.json) nor, at the serving temperature, a "
                            "trained draft (no training.json beside it): pass paths.draft or paths.trained/draft")
    subset = spec.vocab_subset if spec is not None else read_record(Path(path).parent)["vocab_subset"]
    draft = load_model(path, dtype=dtype)
    vocab = torch.tensor(subset) if subset else None
    if calibrated:
        taus = {d: spec.recipe(d).draft_temperature for d in [*set(heldout.domains), sim.OVERALL]}
        return sim.acceptance_at(draft, heldout, taus, vocab)
    tau = 0.0 if temperature == "argmax" else heldout.sampling.temperature
    with torch.no_grad():
        return sim.acceptance(draft, heldout, [tau], vocab)[0]


def compare(alphas: dict[str, torch.Tensor], heldout: sim.HeldOut) -> dict:
    """{domain: {"rows", "positions", "acceptance": {draft: α}, "difference": {draft: [Δ, [lo, hi]]}}}."""
    names = list(alphas)
    table = {}
    for domain, mask in sim.domain_index(heldout).items():
        sums = {name: sim.row_sums(alpha, heldout, mask) for name, alpha in alphas.items()}
        counts = sums[names[0]][1]
        table[domain] = {"rows": len(counts), "positions": int(counts.sum()),
                         "acceptance": {name: float(s.sum() / counts.sum()) for name, (s, _) in sums.items()},
                         "difference": {name: list(sim.paired_difference(sums[names[0]][0], sums[name][0], counts))
                                        for name in names[1:]}}
    return table


def short_names(paths: list[str]) -> list[str]:
    """The fewest trailing path parts that tell the drafts apart (exports are usually all called `draft`)."""
    parts = [Path(p).parts for p in paths]
    for n in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-n:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return list(paths)


def fit(name: str, width: int) -> str:
    """`name` in at most `width` characters, keeping its end: the part short_names added to tell drafts apart."""
    return name if len(name) <= width else "…" + name[-(width - 1):]


def render(table: dict, names: list[str]) -> str:
    short = short_names(names)
    header = f"{'domain':<15}{'rows':>6}{'positions':>11}" + "".join(f"{fit(s, 18):>20}" for s in short) + \
        "".join(f"{'Δ ' + fit(s, 28):>32}" for s in short[1:])
    lines = [header]
    for domain, entry in table.items():
        line = f"{domain:<15}{entry['rows']:>6}{entry['positions']:>11}"
        line += "".join(f"{entry['acceptance'][n]:>20.3f}" for n in names)
        for n in names[1:]:
            delta, ci = entry["difference"][n]
            lo, hi = ci or (float("nan"), float("nan"))
            line += f"{f'{delta:+.3f} [{lo:+.3f}, {hi:+.3f}]':>32}"
        lines.append(line)
    return "\n".join(lines)


def run(cfg) -> dict:
    options = cfg.tool
    drafts = [str(d) for d in options.drafts or []]
    part = str(options.part)
    if len(drafts) < 2 or len(set(drafts)) < len(drafts):
        raise PipelineError("name two or more different draft exports: 'tool.drafts=[<export A>,<export B>]'")
    if part not in ("reporting", "calibration"):
        raise PipelineError(f"tool.part={part!r}: use reporting or calibration")
    if options.temperature not in TEMPERATURES:
        raise PipelineError(f"tool.temperature={options.temperature!r}: use one of {', '.join(TEMPERATURES)}")
    # The stages' held-out prompts, split and target distribution; no draft: each is loaded on its own.
    inputs = load_target_inputs(cfg, None, "calibrate")
    _, held_idx = split_collected(inputs.collected, inputs.settings.split, int(cfg.seed))
    heldout = getattr(build_heldouts(inputs, held_idx), part)
    dtype = next(inputs.target.parameters()).dtype
    alphas = {path: draft_acceptance(path, heldout, dtype, str(options.temperature)) for path in drafts}
    table = compare(alphas, heldout)
    print(f"held-out {part} part of {cfg.paths.collect}: {len(heldout.rows)} rows, {heldout.n_positions} positions, "
          f"{inputs.sampling}, draft temperature {options.temperature}; Δ = draft − "
          f"{short_names(drafts)[0]} [95% paired bootstrap over rows]")
    print(render(table, drafts))
    result = {"collect": str(cfg.paths.collect), "part": part, "sampling": inputs.sampling.to_dict(),
              "draft_temperature": str(options.temperature), "drafts": drafts, "domains": table}
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=2))
    return result
