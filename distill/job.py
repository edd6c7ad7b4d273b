"""The frozen values the distill and calibrate stages' steps hand each other: what a stage read (`Inputs`), how the
collected rows were split (`Split`), the held-out parts (`HeldOuts`) and the serving settings chosen on the calibration
part (`Calibration`); a step that changes one returns a new value (dataclasses.replace). The draft model is the one
mutable member: training updates its weights in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from distill import simulator as sim
from distill.aligned import Truncation
from distill.settings import DistillSettings
from pipeline.decoding.spec import Recipe
from pipeline.sampling import Sampling


@dataclass(frozen=True)
class Inputs:
    """Checked settings, the collected rows, the target and the initial draft."""
    cfg: DictConfig
    settings: DistillSettings  # `cfg.distill` and `cfg.calibrate`, checked (distill/settings.py)
    tracker: object
    state: object  # accelerate.PartialState
    collected: object  # datasets.Dataset from the collect stage
    manifest: dict
    sampling: Sampling  # the serving distribution the draft is tuned for
    target: torch.nn.Module
    tokenizer: object
    target_ident: dict
    draft: torch.nn.Module | None  # None until a stage loads its draft (distill/heldouts.py load_target_inputs)
    draft_tokenizer: object
    draft_info: dict | None
    stops: list[int]

    @property
    def is_main(self) -> bool:
        return self.state.is_main_process

    @property
    def truncation(self) -> Truncation:
        objective = self.settings.objective
        return Truncation(int(objective.max_prompt_length), int(objective.max_completion_length))

    @property
    def serving_dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype


@dataclass(frozen=True)
class Split:
    """The train rows (with their teacher-label columns once labelled), held-out row indices, the FR-Spec
    subset and the checkpoint fingerprint."""
    train: object  # datasets.Dataset (None in the calibrate stage: it reads no train rows)
    heldout_idx: list[int]
    fingerprint: str
    vocab: torch.Tensor | None = None
    all_train: object = None  # a learning-curve point: every train row, of which it trains on the rows `share`
    share: list[int] | None = None
    label_cpu_s: float | None = None  # the collect's CPU seconds for the labels of the rows it trains on

    @property
    def vocab_list(self) -> list[int] | None:
        return None if self.vocab is None else self.vocab.tolist()


@dataclass(frozen=True)
class HeldOuts:
    calibration: sim.HeldOut  # chooses keep_best, τ and γ
    reporting: sim.HeldOut  # gives the reported numbers
    sizes: dict  # rows and positions of each part, and whether they are disjoint (speculative.json `heldout`)


@dataclass(frozen=True)
class Calibration:
    """The serving recipe chosen on the calibration part, per domain and overall (the one Recipe type
    speculative.json carries); the cost summary it was chosen with; the head row the export gives tokens outside
    the FR-Spec subset."""
    recipes: dict[str, Recipe]
    cost: dict
    head_fill: torch.Tensor | None = None  # distill.simulator.out_of_subset_fill of these weights; None: no subset

    @property
    def temperature(self) -> dict[str, float]:
        """τ per domain and overall, as the simulators take it."""
        return {domain: recipe.draft_temperature for domain, recipe in self.recipes.items()}
