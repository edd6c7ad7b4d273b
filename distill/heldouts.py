"""What the distill and calibrate stages both read: the collected rows, the target, the serving sampling, and the
held-out parts with the target's serving distribution, built by both from the same row indices (training.json), so
keep_best, τ and γ are chosen on the same calibration part and reported on the same reporting part.
"""
from __future__ import annotations

import copy
import functools
import gc
import json
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from distill import simulator as sim
from distill.job import HeldOuts, Inputs
from distill.settings import DistillSettings, ServingSettings, SplitSettings, loss_temperature
from pipeline.modelio.chat import stop_token_ids
from pipeline.errors import PipelineError
from pipeline.modelio.models import load_role, model_identity
from pipeline.sampling import Sampling
from pipeline.control.split import split_by_prompt, split_heldout


log = functools.partial(print, "[distill]", flush=True)  # one progress line, tagged with its stage


def load_collected(collect_dir: str | Path):
    """The collect stage's dataset and manifest, or a one-line error naming the fix."""
    from datasets import load_from_disk

    collect_dir = Path(collect_dir)
    if not (collect_dir / "dataset").exists():
        raise PipelineError(f"no collected data at {collect_dir}/dataset: run `python -m pipeline stage=collect` "
                            "first (or point paths.collect at a collect output)")
    try:
        dataset = load_from_disk(str(collect_dir / "dataset"))
    except Exception as e:
        raise PipelineError(f"cannot read {collect_dir}/dataset ({type(e).__name__}): rerun stage=collect") from None
    missing = {"prompt_id", "domain", "prompt_ids", "completion_ids"} - set(dataset.column_names)
    if missing:
        raise PipelineError(f"collected dataset lacks columns {sorted(missing)}: rerun stage=collect")
    if len(dataset) == 0:
        raise PipelineError(f"collected dataset at {collect_dir} is empty: collect some prompts first")
    manifest_file = collect_dir / "manifest.json"
    manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else {}
    return dataset, manifest


def serving_sampling(serving: ServingSettings, manifest: dict) -> Sampling:
    """The serving settings the draft is tuned for: distill.serving.* where set, else the collect manifest's."""
    chosen = dict(manifest.get("sampling") or {})
    chosen.update({k: v for k, v in vars(serving).items() if v is not None})
    return Sampling.from_dict(chosen)


def load_target_inputs(cfg: DictConfig, tracker, stage: str) -> Inputs:
    """Checked settings (those `stage` reads), the collected rows and the target; no draft yet (each stage loads its
    own)."""
    from accelerate import PartialState

    settings = DistillSettings.from_config(cfg, stage)
    state = PartialState()
    dataset, manifest = load_collected(cfg.paths.collect)
    sampling = serving_sampling(settings.serving, manifest)
    settings = replace(settings, objective=replace(
        settings.objective, loss_temperature=loss_temperature(settings.objective, sampling.temperature)))
    target, tokenizer, target_path = load_role(cfg, "target")
    if state.num_processes > 1 and state.device.type == "cuda":
        target = target.to(state.device)
    target.requires_grad_(False)
    largest_id = max(max((max(ids) for ids in dataset[column] if ids), default=0)
                     for column in ("prompt_ids", "completion_ids"))
    if largest_id >= target.config.vocab_size:
        raise PipelineError(f"collected token id {largest_id} is outside the target's {target.config.vocab_size:,}-token "
                            "vocabulary: the data was collected with another tokenizer; rerun stage=collect")
    return Inputs(cfg, settings, tracker, state, dataset, manifest, sampling,
                  target, tokenizer, {**model_identity(target_path), "name": cfg.model.target.get("name")}, None,
                  None, None, stop_token_ids(tokenizer, target))


def split_collected(collected, split: SplitSettings, seed: int) -> tuple[list[int], list[int]]:
    """Row indices (train, held-out) of the collected rows by distill.split; rows of the draft's tokens
    (collect.onpolicy) are never held out."""
    origins = collected["origin"] if "origin" in collected.column_names else None
    return split_by_prompt(collected["prompt_id"], collected["domain"], float(split.heldout_fraction),
                           split.heldout_max_prompts_per_domain, seed, origins)


def build_heldouts(inputs: Inputs, heldout_idx: list[int], request_tokens: int | None = None) -> HeldOuts:
    """The target's serving distribution on the calibration and reporting parts of the held-out rows, each
    completion cut to its first `request_tokens` (None: as distill.objective truncates it)."""
    held = inputs.collected.select(heldout_idx)
    held = held.remove_columns([c for c in ("final_hidden",) if c in held.column_names])  # row dicts stay small
    calibration_idx, reporting_idx, disjoint = split_heldout(held["prompt_id"], held["domain"],
                                                             float(inputs.settings.split.calibration_share),
                                                             int(inputs.cfg.seed))
    if not disjoint:
        log("note: a domain has a single held-out prompt, used both to calibrate and to report (collect more "
            "prompts per domain for an unbiased report)")
    heldout, truncation = inputs.settings.heldout, inputs.truncation
    if request_tokens:
        truncation = replace(truncation, max_completion_length=min(truncation.max_completion_length, request_tokens))

    def part(indices):
        return sim.build_heldout(inputs.target, [held[i] for i in indices], inputs.sampling, truncation,
                                 int(heldout.support), int(heldout.batch_size), inputs.tokenizer.pad_token_id)

    calibration, reporting = part(calibration_idx), part(reporting_idx)
    sizes = {"disjoint": disjoint, "completion_tokens": truncation.max_completion_length,
             **{name: {"rows": len(h.rows), "positions": h.n_positions}
                for name, h in (("calibration", calibration), ("reporting", reporting))},
             # which prompts: eval.prompts_file=heldout measures on the reporting part's, where the predictions are
             "prompt_ids": {name: sorted({held["prompt_id"][i] for i in indices})
                            for name, indices in (("calibration", calibration_idx), ("reporting", reporting_idx))}}
    return HeldOuts(calibration, reporting, sizes)


def as_served(draft, dtype: torch.dtype):
    """The draft in the serving dtype (the target's), as the decoder and the exports run it: a copy when the dtypes
    differ. Training autocasts to that dtype, so the function it optimised is the rounded one too; the fp32 master
    weights run in fp32 are neither (docs/journal.md, "The draft judged as it serves")."""
    if next(draft.parameters()).dtype == dtype:
        return draft
    # each float tensor converted straight into the copy: no second fp32 model in memory; shared tensors (tied
    # embeddings) stay shared
    memo = {id(t): (torch.nn.Parameter(t.detach().to(dtype), requires_grad=False) if isinstance(t, torch.nn.Parameter)
                    else t.detach().to(dtype))
            for t in [*draft.parameters(), *draft.buffers()] if t.is_floating_point()}
    return copy.deepcopy(draft, memo)


def served_acceptance(draft, dtype: torch.dtype, heldout: sim.HeldOut, temperatures: list[float],
                      vocab: torch.Tensor | None) -> list[torch.Tensor]:
    """sim.acceptance of the draft as served, its copy freed on return: a copy of a draft in training holds reference
    cycles (accelerate binds the autocast forward to the model as an attribute, and the copy's is bound to the copy),
    which refcounting never frees, so each held-out evaluation would keep one until a rare full collection."""
    served = as_served(draft, dtype)
    alphas = sim.acceptance(served, heldout, temperatures, vocab)
    if served is not draft:
        del served
        gc.collect()
    return alphas


def serving_alpha(inputs: Inputs, heldout: sim.HeldOut, vocab: torch.Tensor | None) -> torch.Tensor:
    """α per held-out position of the draft as served, sampling at the serving temperature."""
    return served_acceptance(inputs.draft, inputs.serving_dtype, heldout, [inputs.sampling.temperature], vocab)[0]


def serving_acceptance(inputs: Inputs, heldout: sim.HeldOut, vocab: torch.Tensor | None) -> dict[str, dict]:
    """Per-domain summary of serving_alpha."""
    return sim.summarize(serving_alpha(inputs, heldout, vocab), heldout, int(inputs.settings.heldout.gamma))


def acceptances(summary: dict) -> dict[str, float]:
    return {k: v["acceptance"] for k, v in summary.items()}
