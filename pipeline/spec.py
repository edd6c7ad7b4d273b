"""`speculative.json`: the contract between the distill stage (writer) and every user of a draft export
(the eval stage, the model card, anyone serving the draft).

It travels next to the draft's HF weights. Per-domain entries are `{domain: value, ..., "default": value}`;
`default` serves domains the calibration never saw. Fields (docs/architecture.md has the full schema):

    version                this file's format; a reader refuses other versions with one line
    target                 identity of the target the draft was tuned for (name, path, sizes, source_sha256)
    sampling               the serving distribution the calibration is for: temperature, top_k, top_p
    draft                  how the draft was built (init, layers / path, parameters)
    vocab_subset           FR-Spec target ids of the draft head, or null (weights stay full-vocabulary)
    distilled              false for the undistilled reference export (draft_init)
    gamma                  best fixed draft length γ per domain (null: not calibrated)
    draft_length           the draft-length policy per domain: {"policy", "max", "threshold"} (pipeline/decoding/draft_length.py)
    tree                   per domain, the token tree's branching factors, or null for a chain (greedy serving only)
    draft_temperature      draft sampling temperature τ, per domain (null: not calibrated)
    selected               "distilled" | "init": which weights were exported (distill.keep_best)
    acceptance             held-out Σmin(p, q) per domain: before, after, after_training, after_calibrated, and
                           full_head (the exported checkpoint through its full head, as engines run it)
    mean_accepted_length   {"gamma": γ, "before": {...}, "after": {...}} predicted tokens per target pass
    per_position_acceptance  P_k per domain (the chance the first k drafts of a block are accepted)
    predicted_speedup      per domain, of the chosen drafting (if the domain speculates), from the measured cost
    speculate              per domain, false when no drafting is predicted ≥ 1 + speculate_margin: plain decoding
    cost                   c, forward times, verify ratios, device, dtype
    training               loss, teacher, steps, train_tokens, minutes, rows, data_tokens, train_fraction, ...
    learning_curve         [{step, train_tokens, train_minutes, acceptance, by_domain}] (distill/progress.py)
    tree_candidates        {domain: {"3,1": {accepted, nodes, predicted_speedup}}}: every candidate tree on the
                           reporting part, for the serving the trees were calibrated for (empty otherwise)
    heldout                sizes of the calibration and reporting splits
    engines                per serving engine, its calibration: {"llamacpp": {"by_domain": {domain: {"speculate",
                           "n_max", "p_min", "predicted_speedup"}}, "cost": ..., "flags": {...}}} (optional)
    batching               the draft length per batch size: {"batch_sizes", "by_domain": {domain: {B: γ or 0 = plain}},
                           "break_even", "cost", ...} (distill/batching.py; optional, {} = not calibrated)
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from pipeline.atomic import write_json
from pipeline.decoding.draft_length import DraftLength
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling

FILENAME = "speculative.json"
VERSION = 2
DEFAULT = "default"


@dataclass
class SpeculativeSpec:
    target: dict
    sampling: Sampling
    draft: dict
    vocab_subset: list[int] | None = None
    distilled: bool = True
    gamma: dict[str, int] | None = None
    draft_length: dict[str, dict] | None = None
    tree: dict[str, list | None] | None = None
    draft_temperature: dict[str, float] | None = None
    selected: str = "distilled"
    acceptance: dict = field(default_factory=dict)
    mean_accepted_length: dict = field(default_factory=dict)
    per_position_acceptance: dict = field(default_factory=dict)
    predicted_speedup: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    learning_curve: list = field(default_factory=list)
    tree_candidates: dict = field(default_factory=dict)  # optional: exports before it still read
    engines: dict = field(default_factory=dict)  # optional: {engine: calibration for it}, e.g. llamacpp (distill)
    speculate: dict = field(default_factory=dict)  # optional: per domain, False = plain decoding (calibrated off)
    batching: dict = field(default_factory=dict)  # optional: per domain and batch size, γ (0 = plain decoding)
    heldout: dict = field(default_factory=dict)
    version: int = VERSION

    def for_domain(self, key: str, domain: str):
        """A per-domain calibration value (`gamma`, `draft_temperature`): the domain's, else `default`, else None."""
        values = getattr(self, key)
        if not values:
            return None
        return values.get(domain, values.get(DEFAULT))

    def draft_length_for(self, domain: str) -> DraftLength | None:
        """The calibrated draft-length policy of a domain (else `default`), or None when not calibrated."""
        entry = self.for_domain("draft_length", domain)
        return None if entry is None else DraftLength.from_dict(entry)

    def speculates(self, domain: str) -> bool:
        """False when the calibration chose plain decoding for the domain (no drafting predicted to pay)."""
        on = self.for_domain("speculate", domain)
        return True if on is None else bool(on)

    def drafting_for(self, domain: str) -> DraftLength | tuple | None:
        """What speculative_generate's `drafting` takes for a domain: its token tree (branching factors) when
        it has one, else its draft-length policy; None when the domain is calibrated off (plain decoding) or not
        calibrated."""
        if not self.speculates(domain):
            return None
        tree = self.for_domain("tree", domain)
        return tuple(tree) if tree else self.draft_length_for(domain)

    def gamma_for_batch(self, domain: str, batch: int) -> int | None:
        """The calibrated γ of a domain (else `default`) at a batch size, 0 = plain decoding: the setting of the
        smallest calibrated batch size ≥ batch (costs grow with B), the largest's beyond it; None when not
        calibrated for batches."""
        table = (self.batching.get("by_domain") or {}) if self.batching else {}
        table = table.get(domain, table.get(DEFAULT))
        if not table:
            return None
        sizes = sorted(int(b) for b in table)
        return int(table[str(next((b for b in sizes if b >= batch), sizes[-1]))])

    def to_dict(self) -> dict:
        out = asdict(self)
        out["sampling"] = self.sampling.to_dict()
        return out

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / FILENAME
        write_json(path, self.to_dict())
        return path

    @classmethod
    def from_dict(cls, data: dict, where: str = FILENAME) -> "SpeculativeSpec":
        if not isinstance(data, dict):
            raise PipelineError(f"{where} is not a JSON object: re-export the draft with stage=distill")
        version = data.get("version")
        if version != VERSION:
            raise PipelineError(f"{where} has format version {version} (this code reads {VERSION}): re-export the "
                                "draft with `python -m pipeline stage=distill`, or delete the file to use the "
                                "draft uncalibrated")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(data))
        if unknown or missing:
            problem = ", ".join(filter(None, [f"unknown keys {unknown}" if unknown else "",
                                              f"missing keys {missing}" if missing else ""]))
            raise PipelineError(f"{where} does not match format version {VERSION} ({problem}): re-export the draft "
                                "with `python -m pipeline stage=distill`")
        values = dict(data)
        for entry in (values.get("draft_length") or {}).values():
            try:
                DraftLength.from_dict(entry)
            except (PipelineError, TypeError, AttributeError) as e:
                raise PipelineError(f"{where}: invalid draft_length entry {entry!r} ({e}): re-export the draft") from None
        try:
            values["sampling"] = Sampling.from_dict(values["sampling"] or {})
        except (AttributeError, TypeError, ValueError, PipelineError) as e:
            raise PipelineError(f"{where}: invalid sampling {data['sampling']!r} ({e}): re-export the draft") from None
        return cls(**values)

    @classmethod
    def read(cls, directory: str | Path) -> "SpeculativeSpec | None":
        """The directory's speculative.json, or None when it has none (a plain HF model directory)."""
        path = Path(directory) / FILENAME
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PipelineError(f"{path} is not valid JSON ({e.msg}): re-export the draft or delete the file") from None
        return cls.from_dict(data, str(path))
