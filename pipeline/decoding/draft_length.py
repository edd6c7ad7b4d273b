"""How many tokens the draft proposes per target pass: `fixed` (γ = `max`, Leviathan et al. 2023), `confidence`
(draft until the proposed token's probability falls below `threshold`, that token included, at most `max`: HF's
`assistant_confidence_threshold`, AdaEDL/SVIP-style) and `heuristic` (HF's schedule: start at `max`, +2 after a
fully accepted pass, −1 otherwise). Every drafted token is verified the same way whatever the policy.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pipeline.errors import PipelineError

POLICIES = ("fixed", "confidence", "heuristic")
HEURISTIC_CAP = 64  # HF grows its heuristic γ without a bound; a cap keeps one lucky streak from drafting forever


@dataclass(frozen=True)
class DraftLength:
    """One draft-length policy with its parameters (speculative.json `draft_length` entries)."""
    policy: str = "fixed"
    max: int = 4
    threshold: float | None = None  # confidence only

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise PipelineError(f"unknown draft-length policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if not isinstance(self.max, int) or isinstance(self.max, bool) or self.max < 1:
            raise PipelineError(f"draft-length max={self.max!r} must be an integer >= 1: use e.g. 4 (fixed) or 16")
        if self.policy == "confidence" and (self.threshold is None or not 0.0 < float(self.threshold) < 1.0):
            raise PipelineError(f"confidence threshold={self.threshold!r} must be in (0, 1): use e.g. 0.4")

    @classmethod
    def from_dict(cls, values: dict) -> "DraftLength":
        unknown = set(values) - {"policy", "max", "threshold"}
        if unknown:
            raise PipelineError(f"draft_length entry has unknown keys {sorted(unknown)}: use policy, max, threshold")
        return cls(**values)  # missing keys take the class's defaults: γ's fallback is written once, above

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.policy == "confidence":
            return f"confidence ≥ {self.threshold:g}, ≤ {self.max}"
        return f"{self.policy} {self.max}"

    def make(self) -> "Policy":
        """A fresh policy object for one generate call (the heuristic keeps state across its passes)."""
        if self.policy == "fixed":
            return Policy(self.max)
        if self.policy == "confidence":
            return ConfidencePolicy(self.max, float(self.threshold))
        return HeuristicPolicy(self.max)

    def hf_generation_config(self) -> dict:
        """The HF assisted-generation settings that do the same (read from the assistant's generation_config)."""
        heuristic = self.policy == "heuristic"
        return {"num_assistant_tokens": self.max,
                "num_assistant_tokens_schedule": "heuristic" if heuristic else "constant",
                "assistant_confidence_threshold": 0.0 if heuristic else float(self.threshold or 0.0)}


class Policy:
    """The fixed policy, and the interface: `budget()` before a block, `keep_going(confidence)` after each
    draft token, `update(drafted, accepted)` after the verify pass."""
    needs_confidence = False  # fixed and heuristic never look at the draft's probabilities: no extra work

    def __init__(self, length: int):
        self.length = int(length)

    def budget(self) -> int:
        return self.length

    def keep_going(self, confidence: torch.Tensor | None) -> bool:
        return True

    def update(self, drafted: int, accepted: int) -> None:
        pass


class ConfidencePolicy(Policy):
    needs_confidence = True

    def __init__(self, length: int, threshold: float):
        super().__init__(length)
        self.threshold = threshold

    def keep_going(self, confidence: torch.Tensor | None) -> bool:
        # The one value the loop must read on the host to stop early (on CUDA, a sync per draft token, as HF's).
        return bool(confidence >= self.threshold)


class HeuristicPolicy(Policy):
    def update(self, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.length = min(self.length + 2, HEURISTIC_CAP)
        elif drafted:
            self.length = max(1, self.length - 1)


# The confidence policy where no calibration chose one: HF assisted generation's default threshold (0.4), so the
# two decoders stop alike, and the largest cap distill calibrates (calibrate.draft_length.max_lengths).
UNCALIBRATED_CONFIDENCE = DraftLength("confidence", 16, 0.4)
