"""The models an evaluation decodes with: the target, the evaluated draft, the undistilled draft when there is
one, and any further drafts named in eval.extra_drafts (methods `speculative_<name>`), each with its
speculative.json calibration and FR-Spec head subset."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from eval.settings import EvalSettings
from pipeline.modelio.chat import stop_token_ids
from pipeline.errors import PipelineError
from pipeline.modelio.models import (check_compatible, derive_draft, load_model, load_role, load_tokenizer,
                             model_identity, resolve_model)
from pipeline.sampling import Sampling
from pipeline.decoding.spec import SpeculativeSpec


@dataclass
class Draft:
    model: torch.nn.Module
    identity: dict
    spec: SpeculativeSpec | None = None  # the export's speculative.json; None for a plain HF directory
    vocab: torch.Tensor | None = None  # FR-Spec head subset (target ids)


@dataclass
class Evaluation:
    """Everything the benchmark decodes with, loaded once."""
    settings: EvalSettings
    sampling: Sampling  # the serving distribution every method samples from
    device: torch.device
    dtype: torch.dtype
    target: torch.nn.Module
    tokenizer: object
    target_path: Path
    target_identity: dict
    drafts: dict[str, Draft]  # "speculative" (evaluated), "speculative_init" (undistilled, when there is one),
                              #   "speculative_<name>" (eval.extra_drafts)
    stop: list[int]  # token ids that end a turn
    plans: dict = field(default_factory=dict)  # {method: {domain: DraftPlan}} (eval/stage.py make_plans)
    budget: dict | None = None  # set when eval.max_minutes stopped the benchmark early
    stalls: dict | None = None  # the stall rule's verdicts (eval/harness.py retime_stalls); None when it is off

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _check_vocabulary(path: Path, role: str, model, target, tokenizer) -> None:
    try:
        draft_tokenizer = load_tokenizer(path)
    except Exception:  # a weights-only directory: fall back to comparing the output heads
        print(f"[eval] note: {path} has no tokenizer; checking only that its vocabulary size matches the target's")
        if model.config.vocab_size != target.config.vocab_size:
            raise PipelineError(f"{role} {path} predicts over {model.config.vocab_size:,} tokens, the target over "
                                f"{target.config.vocab_size:,}: use a draft that shares the target's tokenizer")
        return
    check_compatible(tokenizer, draft_tokenizer, target, model)


def _draft_from_dir(path: Path, role: str, target, tokenizer, device, dtype, settings: EvalSettings,
                    target_sha: str | None) -> Draft:
    model = load_model(path, device, dtype)
    _check_vocabulary(path, role, model, target, tokenizer)
    spec = SpeculativeSpec.read(path)
    identity = {**model_identity(path), "source": str(path), "n_params": _n_params(model)}
    if spec is None:
        return Draft(model, identity)
    tuned_for = spec.target.get("source_sha256")
    if tuned_for and target_sha and tuned_for != target_sha:
        print(f"[eval] note: {path} was distilled for another target (sha256 {tuned_for[:12]}…, "
              f"this target {target_sha[:12]}…); its calibration may not fit")
    vocab = None
    if spec.vocab_subset and settings.use_vocab_subset:
        vocab = torch.tensor(spec.vocab_subset, dtype=torch.long, device=device)
    return Draft(model, identity, spec, vocab)


def _derived(cfg: DictConfig, target) -> Draft:
    layers = list(cfg.model.draft.derive.layers or [])
    model = derive_draft(target, layers)
    identity = {"source": f"derived from target layers {layers} (not distilled)",
                "architecture": type(model).__name__, "num_hidden_layers": len(layers),
                "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size,
                "n_params": _n_params(model)}
    return Draft(model, identity)


def _draft_source(cfg: DictConfig, settings: EvalSettings) -> tuple[Path | None, str]:
    """(model directory, role) of the draft under evaluation; no directory means a draft derived from the target."""
    choice, export = settings.draft, Path(cfg.paths.draft)
    if choice == "derive":
        return None, "eval.draft"
    if choice:
        if not (Path(choice) / "config.json").exists():
            raise PipelineError(f"eval.draft={choice} is not a model directory (no config.json): point it at a "
                                "Hugging Face model directory, or use eval.draft=derive")
        return Path(choice), "eval.draft"
    if (export / "config.json").exists():
        return export, "draft"
    if cfg.model.draft.get("init") == "pretrained":
        path = resolve_model(cfg.model.draft, "draft", cfg.paths)
        print(f"[eval] note: no exported draft at {export}; evaluating the preset's pretrained draft {path}")
        return path, "draft"
    print(f"[eval] note: no exported draft at {export}; evaluating a draft derived from target layers "
          f"{list(cfg.model.draft.derive.layers or [])} (run stage=distill, or set eval.draft=<dir>)")
    return None, "draft"


def _init_source(cfg: DictConfig, settings: EvalSettings, evaluated: Path | None) -> Path | None:
    """The undistilled draft's directory, when there is one other than the evaluated draft."""
    choice = settings.draft_init
    if choice == "none":
        return None
    path = Path(choice or cfg.paths.draft_init)
    if choice and not (path / "config.json").exists():
        raise PipelineError(f"eval.draft_init={choice} is not a model directory (no config.json): "
                            "point it at the undistilled draft, or use eval.draft_init=none")
    same = evaluated is not None and path.resolve() == evaluated.resolve()
    return path if (path / "config.json").exists() and not same else None


def extra_sources(cfg: DictConfig, settings: EvalSettings) -> dict[str, Path]:
    """eval.extra_drafts {name: model directory | `pretrained`} -> {method name: directory}; checked before any
    model loads (the names are checked by EvalSettings). `pretrained` is the preset's pretrained draft as published
    (all layers, full head)."""
    out = {}
    for name, choice in settings.extra_drafts.items():
        if choice == "pretrained":
            if cfg.model.draft.get("init") != "pretrained":
                raise PipelineError(f"eval.extra_drafts.{name}=pretrained: the model preset "
                                    f"{cfg.model.get('name')} has no pretrained draft; give a model directory")
            out[f"speculative_{name}"] = resolve_model(cfg.model.draft, "draft", cfg.paths)
        elif not (Path(str(choice)) / "config.json").exists():
            raise PipelineError(f"eval.extra_drafts.{name}={choice} is not a model directory (no config.json): "
                                "point it at a draft export (e.g. another run's paths.draft) or use `pretrained`")
        else:
            out[f"speculative_{name}"] = Path(str(choice))
    return out


def load_models(cfg: DictConfig, settings: EvalSettings, sampling: Sampling) -> Evaluation:
    extras = extra_sources(cfg, settings)
    target, tokenizer, target_path = load_role(cfg, "target")
    device, dtype = next(target.parameters()).device, next(target.parameters()).dtype
    target_identity = {**model_identity(target_path), "source": str(target_path), "n_params": _n_params(target)}

    def from_dir(path: Path, role: str) -> Draft:
        return _draft_from_dir(path, role, target, tokenizer, device, dtype, settings,
                               target_identity.get("source_sha256"))

    path, role = _draft_source(cfg, settings)
    drafts = {"speculative": _derived(cfg, target) if path is None else from_dir(path, role)}
    init_path = _init_source(cfg, settings, path)
    if init_path is not None:
        drafts["speculative_init"] = from_dir(init_path, "draft_init")
    drafts.update({name: from_dir(path, f"eval.extra_drafts.{name.removeprefix('speculative_')}")
                   for name, path in extras.items()})
    return Evaluation(settings=settings, sampling=sampling, device=device, dtype=dtype, target=target,
                      tokenizer=tokenizer, target_path=target_path, target_identity=target_identity, drafts=drafts,
                      stop=stop_token_ids(tokenizer, target))
