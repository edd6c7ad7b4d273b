"""What the tools that judge drafts on held-out rows share (compare-drafts, acceptance-gap): a collect's held-out
parts exactly as the distill stage builds them."""
from __future__ import annotations

from distill.heldouts import build_heldouts, load_target_inputs
from distill.job import HeldOuts, Inputs
from distill.split import split_by_prompt


def collect_heldouts(cfg) -> tuple[Inputs, HeldOuts]:
    """The stages' inputs (no draft: each tool loads its own) and the calibration and reporting parts of
    paths.collect's held-out prompts (the same prompts, split and target distribution the stages use)."""
    inputs = load_target_inputs(cfg, tracker=None)
    split = inputs.settings.split
    _, held_idx = split_by_prompt(inputs.collected["prompt_id"], inputs.collected["domain"],
                                  float(split.heldout_fraction), split.heldout_max_prompts_per_domain, int(cfg.seed))
    return inputs, build_heldouts(inputs, held_idx)
