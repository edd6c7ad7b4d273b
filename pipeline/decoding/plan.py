"""DraftPlan: one domain's drafting decision, the one object every decoder entry point takes, so a calibration
(`spec.plan(domain, sampling)`), an eval override and a user decide the same four things in one place.

    plan = DraftPlan(4)                                 # a chain of 4 drafts per pass
    plan = DraftPlan((3, 2, 1), draft_temperature=0.8)  # a token tree, the draft sampled at τ = 0.8
    plan = PLAIN                                        # plain decoding: a domain calibrated "off"
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.decoding.draft_length import DraftLength
from pipeline.decoding.guard import Guard
from pipeline.decoding.tree import Tree, parse_tree
from pipeline.errors import PipelineError


def as_drafting(drafting) -> DraftLength | Tree:
    """A drafting shape from what a user may pass: a DraftLength policy, an int γ (fixed), a Tree, a tuple of
    branching factors per depth, or a list of parent indices."""
    if isinstance(drafting, (DraftLength, Tree)):
        return drafting
    if isinstance(drafting, int) and not isinstance(drafting, bool):
        if drafting < 1:
            raise PipelineError(f"gamma (draft tokens per pass) must be >= 1, got {drafting}: use e.g. DraftPlan(4)")
        return DraftLength("fixed", drafting)
    if isinstance(drafting, (tuple, list)):
        return parse_tree(drafting)
    raise PipelineError(f"drafting must be a DraftLength, an int γ, a Tree, a tuple of branching factors or a parent "
                        f"list, got {type(drafting).__name__}: use e.g. DraftPlan(4) or DraftPlan((3, 2, 1))")


@dataclass(frozen=True)
class DraftPlan:
    """How the draft drafts for one request. `drafting`: a DraftLength policy (an int γ = fixed γ), a token tree
    (a tuple of branching factors, a parent list or a Tree) or None = plain decoding. `draft_temperature` τ
    (None = the sampling's) changes only q. `draft_vocab` (FR-Spec, Zhao et al. 2025) is a 1-D LongTensor of
    the target ids the draft may propose. `guard` (pipeline/decoding/guard.py) may draft fewer tokens, or none,
    while the drafts do not pay. None of them can change the output distribution: each draft is verified."""
    drafting: DraftLength | Tree | tuple | None = DraftLength()
    draft_temperature: float | None = None
    draft_vocab: torch.Tensor | None = field(default=None, compare=False)
    guard: Guard | None = None

    def __post_init__(self):
        drafting = self.drafting
        if drafting is not None:
            shape = as_drafting(drafting)  # one-line errors for a bad γ or tree
            drafting = tuple(drafting) if isinstance(drafting, tuple) else shape  # factors kept: they name the tree
            object.__setattr__(self, "drafting", drafting)
        tau = self.draft_temperature
        if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or tau < 0):
            raise PipelineError(f"draft_temperature must be >= 0 or None, got {tau!r}: pass e.g. None")
        if self.guard is not None and not isinstance(self.guard, Guard):
            raise PipelineError(f"guard must be a pipeline.decoding.Guard or None, got {type(self.guard).__name__}")

    @property
    def speculates(self) -> bool:
        return self.drafting is not None

    @property
    def shape(self) -> DraftLength | Tree | None:
        """What the decoder runs: a draft-length policy, a Tree, or None (plain decoding)."""
        return None if self.drafting is None else as_drafting(self.drafting)

    @property
    def tree(self) -> tuple | None:
        """The tree's branching factors (or parents), None for a chain or plain decoding."""
        return None if self.drafting is None or isinstance(self.drafting, DraftLength) else \
            (self.drafting.parents if isinstance(self.drafting, Tree) else self.drafting)

    @property
    def gamma(self) -> int:
        """The most drafts per pass: a policy's cap, a tree's depth, 0 for plain decoding."""
        shape = self.shape
        return 0 if shape is None else shape.max if isinstance(shape, DraftLength) else shape.depth

    def as_chain(self) -> DraftLength:
        """The plan as a chain, for engines that run chains only (HF assisted generation): its policy, else a
        fixed γ of its depth (at least 1)."""
        return self.drafting if isinstance(self.drafting, DraftLength) else DraftLength("fixed", max(self.gamma, 1))

    def describe(self) -> str:
        if self.drafting is None:
            return "off"
        if isinstance(self.drafting, DraftLength):
            return self.drafting.describe()
        return "tree (" + ", ".join(map(str, self.tree)) + ")"

    def to_dict(self) -> dict:
        """The plan as JSON (metrics.json's per-method entries)."""
        chain = self.drafting if isinstance(self.drafting, DraftLength) else None
        return {"speculate": self.speculates, "gamma": self.gamma,
                "draft_length": chain.to_dict() if chain else None,
                "tree": list(self.tree) if self.tree is not None else None,
                "draft_temperature": self.draft_temperature,
                "vocab_subset": None if self.draft_vocab is None else int(self.draft_vocab.numel()),
                "guard": self.guard.to_dict() if self.guard else None}


PLAIN = DraftPlan(None)  # plain decoding through the speculative entry points (a domain calibrated "off")
