"""What the distill tools beside the stage share (distill.acceptance_gap, distill.compare_drafts): the composed
config of `python -m <tool> <hydra overrides>`, and a collect's held-out parts exactly as the stage builds them."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from distill.job import HeldOuts, Inputs
from distill.split import split_by_prompt
from distill.stage import build_heldouts, load_inputs


def tool_config(overrides: list[str]):
    """conf/config.yaml with `overrides` (MLflow off: a tool reads runs, it does not make one)."""
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("config", overrides=["tracking.enabled=false", *overrides])


def collect_heldouts(cfg) -> tuple[Inputs, HeldOuts]:
    """The stage's inputs and the calibration and reporting parts of paths.collect's held-out prompts (the same
    prompts, split and target distribution the distill stage used)."""
    inputs = load_inputs(cfg, tracker=None)
    split = inputs.settings.split
    _, held_idx = split_by_prompt(inputs.collected["prompt_id"], inputs.collected["domain"],
                                  float(split.heldout_fraction), split.heldout_max_prompts_per_domain, int(cfg.seed))
    return inputs, build_heldouts(inputs, SimpleNamespace(heldout_idx=held_idx))
