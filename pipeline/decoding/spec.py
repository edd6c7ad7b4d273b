"""`speculative.json` (the serving recipe: one per domain, plus what it is valid for and the engines' own) and
`evidence.json` (what the recipe was chosen from), beside a draft's HF weights. `SpeculativeSpec` is the one schema:
each field's `metadata["file"]` says where it lives, and docs/architecture.md's table is kept equal to it
(tests/test_spec_schema.py). `spec.plan(domain, sampling)` applies a recipe: the DraftPlan every decoder takes.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import torch

from pipeline.atomic import write_json
from pipeline.decoding.draft_length import DraftLength
from pipeline.decoding.guard import Guard, GuardSettings
from pipeline.decoding.plan import PLAIN, DraftPlan
from pipeline.decoding.tree import tree_key
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling

FILENAME = "speculative.json"
EVIDENCE = "evidence.json"
VERSION = 3
DEFAULT = "default"
OFF = "off"  # a recipe's drafting when the calibration chose plain decoding
CALIBRATED = object()  # spec.plan's drafting: the recipe's own
SERVING, PROOF = FILENAME, EVIDENCE  # metadata["file"]: a speculative.json key, an evidence.json key


def _in(where: str, **kw):
    return field(metadata={"file": where}, **kw)


@dataclass(frozen=True)
class Recipe:
    """One domain's serving recipe, speculative.json's `recipes[domain]`, as calibrated for the spec's sampling:
    whether to draft at all (False: plain decoding, "off"), the chain's draft-length policy, the best fixed γ, the
    token tree (branching factors; None: the chain) and the draft temperature τ. `spec.plan` turns it into the
    DraftPlan a decoder takes; every engine export reads the same object."""
    speculate: bool = True
    chain: DraftLength | None = None
    gamma: int | None = None
    tree: tuple | None = None
    draft_temperature: float | None = None

    @property
    def drafting(self) -> DraftLength | tuple | None:
        """What the recipe drafts: its tree, else its chain; None when it is off (or has neither)."""
        return (self.tree or self.chain) if self.speculate else None

    def to_dict(self) -> dict:
        """speculative.json's entry: `drafting` ("off", the chain policy or the tree), and each part by name."""
        chain = self.chain.to_dict() if self.chain is not None else None
        drafting = OFF if not self.speculate else list(self.tree) if self.tree else chain
        return {"drafting": drafting, "chain": chain, "gamma": self.gamma, "draft_temperature": self.draft_temperature,
                "tree": list(self.tree) if self.tree else None}

    @classmethod
    def from_dict(cls, entry: dict, where: str) -> "Recipe":
        """An entry of `recipes` (one without `tree`, as format 3 wrote for chain-only calibrations, takes a list
        `drafting` as its tree)."""
        drafting = entry.get("drafting")
        tree = entry["tree"] if "tree" in entry else drafting if isinstance(drafting, list) else None
        try:
            chain = None if entry.get("chain") is None else DraftLength.from_dict(entry["chain"])
        except (PipelineError, TypeError, AttributeError) as e:
            raise PipelineError(f"{where}: invalid drafting entry {entry.get('chain')!r} ({e}): re-export the "
                                "draft") from None
        return cls(drafting != OFF, chain, entry.get("gamma"), tuple(tree) if tree else None,
                   entry.get("draft_temperature"))


@dataclass
class SpeculativeSpec:
    """One draft export's calibration: what it is valid for, a Recipe per domain (and `default`), the engines' own
    recipes (speculative.json), and what they were chosen from (evidence.json)."""
    target: dict = _in(SERVING)
    sampling: Sampling = _in(SERVING)
    draft: dict = _in(SERVING)
    vocab_subset: list[int] | None = _in(SERVING, default=None)
    distilled: bool = _in(SERVING, default=True)
    recipes: dict[str, Recipe] = _in(SERVING, default_factory=dict)  # per domain and `default`
    selected: str = _in(SERVING, default="distilled")
    acceptance: dict = _in(PROOF, default_factory=dict)
    mean_accepted_length: dict = _in(PROOF, default_factory=dict)
    per_position_acceptance: dict = _in(PROOF, default_factory=dict)
    predicted_speedup: dict = _in(PROOF, default_factory=dict)
    cost: dict = _in(PROOF, default_factory=dict)
    training: dict = _in(PROOF, default_factory=dict)
    learning_curve: list = _in(PROOF, default_factory=list)
    tree_candidates: dict = _in(PROOF, default_factory=dict)
    engines: dict = _in(SERVING, default_factory=dict)  # {engine: its own recipe}, e.g. llamacpp, vllm, hf
    batching: dict = _in(SERVING, default_factory=dict)  # per domain and batch size, γ (0 = plain decoding)
    heldout: dict = _in(PROOF, default_factory=dict)
    version: int = _in(SERVING, default=VERSION)

    def recipe(self, domain: str) -> Recipe:
        """The domain's recipe, else the `default` one, else an uncalibrated Recipe() (a chain of DraftLength's
        default, drafting everywhere)."""
        return self.recipes.get(domain) or self.recipes.get(DEFAULT) or Recipe()

    def plan(self, domain: str, sampling: Sampling, *, drafting=CALIBRATED, guard: GuardSettings | None = None,
             vocab: bool = True) -> DraftPlan:
        """The DraftPlan that serves `domain` at `sampling` as calibrated. The recipe's tree, τ and "off" are
        used only when the calibration was for this sampling (a tree and a τ fit one distribution; at T = 0 the
        draft proposes its argmax, so no τ is used at all); elsewhere the domain drafts its chain policy.
        `drafting` replaces the recipe's shape (None = plain decoding), keeping its τ, vocabulary and guard;
        `guard` (its knobs) adds the online guard priced with this export's cost and acceptance; `vocab=False`
        drafts over the full vocabulary."""
        same, recipe = self.sampling == sampling, self.recipe(domain)
        if drafting is CALIBRATED:
            if same and not recipe.speculate:
                return PLAIN
            tree = recipe.tree if same else None
            drafting = tree or recipe.chain or DraftLength(max=recipe.gamma or DraftLength.max)
        if drafting is None:
            return PLAIN
        tau = recipe.draft_temperature if same and not sampling.greedy else None
        plan = DraftPlan(drafting, None if tau is None else float(tau), self.vocab() if vocab else None)
        return DraftPlan(plan.drafting, plan.draft_temperature, plan.draft_vocab, self.guard(domain, plan, guard))

    def vocab(self) -> torch.Tensor | None:
        """vocab_subset as a LongTensor, one tensor per spec (the decoder keeps the head rows of a tensor it saw)."""
        if self.vocab_subset is None:
            return None
        if getattr(self, "_vocab", None) is None:
            self._vocab = torch.tensor(self.vocab_subset, dtype=torch.long)
        return self._vocab

    def guard(self, domain: str, plan: DraftPlan, settings: GuardSettings | None) -> Guard | None:
        """The online guard of a domain's plan: this export's cost profile and acceptance as its prior (a token
        tree's own per-depth acceptance where the calibration simulated it, else the chain's per-position
        acceptance); None without settings or a calibration to price passes with."""
        if settings is None or not plan.speculates or not self.cost.get("c"):
            return None
        candidates = self.tree_candidates.get(domain) or self.tree_candidates.get("overall")
        prior = (plan.tree and tree_prior(candidates, list(plan.tree))) or \
            self.per_position_acceptance.get(domain) or self.per_position_acceptance.get("overall")
        return Guard(self.cost, tuple(prior), settings) if prior else None

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

    # ------------------------------------------------------------ the two files

    def to_dict(self) -> dict:
        """speculative.json: the serving recipe."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["file"] == SERVING}
        return out | {"sampling": self.sampling.to_dict(), "recipes": {d: r.to_dict() for d, r in self.recipes.items()}}

    def evidence(self) -> dict:
        """evidence.json: what the recipe was chosen from."""
        return {"version": self.version} | {f.name: getattr(self, f.name) for f in fields(self)
                                            if f.metadata["file"] == PROOF}

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / FILENAME
        write_json(Path(directory) / EVIDENCE, self.evidence())
        write_json(path, self.to_dict())
        return path

    @classmethod
    def from_dict(cls, data: dict, where: str = FILENAME, evidence: dict | None = None) -> "SpeculativeSpec":
        """speculative.json's content (format 3, with evidence.json's), or a format-2 file (one flat object), as
        a spec; one line naming the fix for anything else."""
        if not isinstance(data, dict):
            raise PipelineError(f"{where} is not a JSON object: re-export the draft with stage=calibrate")
        version = data.get("version")
        if version == 2:  # format 2 kept every field flat in one file, the recipes as per-domain maps per part
            return cls._checked(_from_format_2(data, where) | {"version": VERSION}, where)
        if version != VERSION:
            raise PipelineError(f"{where} has format version {version} (this code reads {VERSION} and 2): re-export "
                                "the draft with `python -m pipeline stage=calibrate`, or delete the file to use the "
                                "draft uncalibrated")
        values = dict(data) | {"recipes": _recipes(data.get("recipes"), where)}
        values |= {k: v for k, v in (evidence or {}).items() if k != "version"}
        return cls._checked(values, where)

    @classmethod
    def _checked(cls, values: dict, where: str) -> "SpeculativeSpec":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(values))
        if unknown or missing:
            problem = ", ".join(filter(None, [f"unknown keys {unknown}" if unknown else "",
                                              f"missing keys {missing}" if missing else ""]))
            raise PipelineError(f"{where} does not match format version {VERSION} ({problem}): re-export the draft "
                                "with `python -m pipeline stage=calibrate`")
        try:
            values["sampling"] = Sampling.from_dict(values["sampling"] or {})
        except (AttributeError, TypeError, ValueError, PipelineError) as e:
            raise PipelineError(f"{where}: invalid sampling {values['sampling']!r} ({e}): re-export the draft") from None
        return cls(**values)

    @classmethod
    def read(cls, directory: str | Path) -> "SpeculativeSpec | None":
        """The directory's speculative.json (with evidence.json beside it), or None when it has none (a plain HF
        model directory)."""
        path = Path(directory) / FILENAME
        if not path.exists():
            return None
        data = _json(path)
        proof = Path(directory) / EVIDENCE
        return cls.from_dict(data, str(path), _json(proof) if proof.exists() else None)


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON ({e.msg}): re-export the draft or delete the file") from None


def _recipes(recipes, where: str) -> dict[str, Recipe]:
    """speculative.json's `recipes` as Recipe objects."""
    if recipes is None or not isinstance(recipes, dict) or not all(isinstance(r, dict) for r in recipes.values()):
        raise PipelineError(f"{where}: `recipes` is not {{domain: recipe}}: re-export the draft")
    return {domain: Recipe.from_dict(entry, where) for domain, entry in recipes.items()}


def _from_format_2(data: dict, where: str) -> dict:
    """A format-2 file's fields with its per-domain maps (`gamma`, `draft_length`, `tree`, `draft_temperature`,
    `speculate`) folded into recipes."""
    parts = {"gamma": "gamma", "draft_length": "chain", "tree": "tree", "draft_temperature": "draft_temperature"}
    maps = {name: data.get(name) or {} for name in (*parts, "speculate")}
    domains = sorted({d for values in maps.values() for d in values})
    entries = {d: {key: maps[name].get(d) for name, key in parts.items()} for d in domains}
    for d, entry in entries.items():
        entry["drafting"] = OFF if maps["speculate"].get(d) is False else None
    return ({k: v for k, v in data.items() if k not in (*parts, "speculate")}
            | {"recipes": _recipes(entries, where)})


def tree_prior(candidates: dict | None, tree: list) -> list[float] | None:
    """P_d, the chance a pass of `tree` accepts a node at depth d, from the calibration's expected accepted
    nodes A of the tree truncated to each depth (tree_candidates): P_d = A(d) − A(d − 1). None when a truncation
    was not simulated (the chain's acceptance then stands in, which understates a tree's: more siblings, more
    chances)."""
    accepted = [(candidates or {}).get(tree_key(tree[:depth]), {}).get("accepted") for depth in range(1, len(tree) + 1)]
    if not accepted or None in accepted:
        return None
    return [min(max(a - b, 0.0), 1.0) for a, b in zip(accepted, [0.0] + accepted[:-1])]
