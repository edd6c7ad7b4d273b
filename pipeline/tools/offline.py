"""What the tools that judge drafts on held-out rows share (compare-drafts, acceptance-gap): a collect's held-out
parts exactly as the distill stage builds them."""
from __future__ import annotations

from types import SimpleNamespace

from distill.job import HeldOuts, Inputs
from distill.split import split_by_prompt
from distill.stage import build_heldouts, load_inputs


def collect_heldouts(cfg) -> tuple[Inputs, HeldOuts]:
    """The stage's inputs and the calibration and reporting parts of paths.collect's held-out prompts (the same
    prompts, split and target distribution the distill stage used)."""
    inputs = load_inputs(cfg, tracker=None)
    split = inputs.settings.split
    _, held_idx = split_by_prompt(inputs.collected["prompt_id"], inputs.collected["domain"],
                                  float(split.heldout_fraction), split.heldout_max_prompts_per_domain, int(cfg.seed))
    return inputs, build_heldouts(inputs, SimpleNamespace(heldout_idx=held_idx))
