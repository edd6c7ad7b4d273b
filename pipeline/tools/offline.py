"""What the tools that judge drafts on held-out rows share (compare-drafts, acceptance-gap): a collect's held-out
parts exactly as the distill stage builds them."""
from __future__ import annotations

from distill.heldouts import build_heldouts, load_target_inputs, split_collected
from distill.job import HeldOuts, Inputs


def collect_heldouts(cfg) -> tuple[Inputs, HeldOuts]:
    """The stages' inputs (no draft: each tool loads its own) and the calibration and reporting parts of
    paths.collect's held-out prompts (the same prompts, split and target distribution the stages use)."""
    inputs = load_target_inputs(cfg, tracker=None)
    _, held_idx = split_collected(inputs.collected, inputs.settings.split, int(cfg.seed))
    return inputs, build_heldouts(inputs, held_idx)
