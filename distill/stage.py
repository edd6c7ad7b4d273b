"""Distill stage: `python -m pipeline stage=distill` (or `accelerate launch -m pipeline stage=distill`).

    inputs      = load_inputs(cfg)                        settings, collected rows, target, initial draft
    split       = split_rows(inputs)                      train rows, held-out rows, FR-Spec subset, fingerprint
    heldouts    = build_heldouts(inputs, split)           the target's serving p on the calibration and reporting parts
    before      = measure_before(...)                     held-out acceptance of the undistilled draft
    export_undistilled(...)                               ${paths.draft_init}, uncalibrated for now
    split       = attach_teacher_labels(inputs, split)    the train rows with their teacher labels
    training    = train_draft(inputs, split, ...)         distillation (distill/trainer.py), resumable
    selected    = select_weights(...)                     keep_best on the calibration part
    profile     = cost_profile(inputs, split.vocab)       this device's pass costs (or a given profile)
    calibration = calibrate(inputs, split, ...)           τ, γ, draft-length policy and tree per domain
    spec        = build_spec(...)                         speculative.json: every number on the reporting part
    spec, files = calibrate_engines(...)                  + the engines asked for (llama.cpp) and draft.gguf
    spec        = calibrate_batching(inputs, split, spec) + γ per batch size (distill.calibration.batch_sizes)
    export(...)                                           ${paths.draft} + model card + the per-domain table
    export_calibrated_init(...)                           ${paths.draft_init} again, with its own calibration

Every step returns what it produces (distill/job.py holds the frozen types); only the draft's weights change
in place, by training and by select_weights.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from distill import calibrate as cal
from distill.batching import calibrate_batching
from distill.draft import build_draft, vocab_subset
from distill.engines import calibrate_engines
from distill.export import exported_weights, format_table, model_card, save_draft
from distill.job import Calibration, HeldOuts, Inputs, Split
from distill.labels import attach_teacher_labels
from distill.serving import calibrate, cost_profile, predict_speedup, tree_candidates
from distill.settings import DistillSettings, ServingSettings
from distill.split import nested_subset, split_by_prompt, split_heldout
from distill.training import TrainingResult, generation_length, train_draft
from pipeline.chat import stop_token_ids
from pipeline.cost_profile import FILENAME
from pipeline.errors import PipelineError
from pipeline.models import check_compatible, load_role, model_identity
from pipeline.sampling import Sampling
from pipeline.spec import DEFAULT, SpeculativeSpec
from pipeline.timing import Laps

FINGERPRINTED = ("objective", "trainer", "split")  # the groups that decide the trained weights (conf/distill)
# Knobs added to those groups after checkpoints existed, with the value that means "off": hashed only when set, so
# adding a knob does not orphan every checkpoint trained before it.
ADDED_LATER = {("objective", "adaspec_reference"): None}


def log(msg: str) -> None:
    print(f"[distill] {msg}", flush=True)


# ---------------------------------------------------------------- the stage
def run(cfg: DictConfig, tracker) -> dict:
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # row-level map/filter bars would drown the training progress bar
    try:
        return _run(cfg, tracker)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _run(cfg: DictConfig, tracker) -> dict:
    t_start, laps = time.time(), Laps()
    inputs = load_inputs(cfg, tracker)
    split = split_rows(inputs)
    laps.lap("load")
    heldouts = build_heldouts(inputs, split) if inputs.is_main else None
    before = measure_before(inputs, heldouts, split.vocab)
    if inputs.is_main:
        export_undistilled(inputs, split, heldouts, before)
    laps.lap("heldout")
    split = attach_teacher_labels(inputs, split, log)
    laps.lap("labels")
    settings = inputs.settings.calibration
    keeps_initial = inputs.is_main and (settings.keep_best or settings.calibrate_init)
    initial_weights = snapshot(inputs.draft) if keeps_initial else None
    training = train_draft(inputs, split, heldouts.reporting if heldouts else None, log)
    laps.lap("training")
    if not inputs.is_main:
        return {}
    selected = select_weights(inputs, heldouts, split.vocab, before, initial_weights)
    profile = cost_profile(inputs, split.vocab)
    laps.lap("cost_profile")
    calibration = calibrate(inputs, split, heldouts.calibration, profile)
    laps.lap("calibration")
    spec = build_spec(inputs, split, heldouts, before, training, selected, calibration)
    laps.lap("report")
    spec, engine_files = calibrate_engines(inputs, split, heldouts, spec, calibration.head_fill, log)
    spec = calibrate_batching(inputs, split, spec, log)
    laps.lap("engines")
    calibration_dtype = next(inputs.draft.parameters()).dtype
    export(inputs, split, spec, profile, calibration.head_fill, engine_files)
    laps.lap("export")
    if settings.calibrate_init:
        export_calibrated_init(inputs, split, heldouts, before, initial_weights, calibration_dtype, profile,
                               calibration if selected["selected"] == "init" else None)
        laps.lap("init_calibration")
    log(f"exported {cfg.paths.draft} (undistilled: {cfg.paths.draft_init}) in {time.time() - t_start:.0f}s: "
        f"{laps.summary()}")
    tracker.log_metrics({f"distill_seconds/{name}": seconds for name, seconds in laps.parts.items()})
    return {"acceptance_before": spec.acceptance["before"][cal.OVERALL],
            "acceptance_after": spec.acceptance["after"][cal.OVERALL], "c": spec.cost["c"],
            "train_tokens": training.tokens, "train_minutes": training.minutes, "draft": str(cfg.paths.draft)}


# ---------------------------------------------------------------- inputs
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


def load_inputs(cfg: DictConfig, tracker) -> Inputs:
    """Checked settings, the collected rows, the target and the initial draft."""
    from accelerate import PartialState

    settings = DistillSettings.from_config(cfg.distill)
    state = PartialState()
    dataset, manifest = load_collected(cfg.paths.collect)
    target, tokenizer, target_path = load_role(cfg, "target")
    if state.num_processes > 1 and state.device.type == "cuda":
        target = target.to(state.device)
    target.requires_grad_(False)
    draft, draft_tokenizer, draft_info = build_draft(cfg.model.draft, target, tokenizer, cfg.paths, seed=cfg.seed)
    check_compatible(tokenizer, draft_tokenizer, target, draft)
    largest_id = max(max((max(ids) for ids in dataset[column] if ids), default=0)
                     for column in ("prompt_ids", "completion_ids"))
    if largest_id >= target.config.vocab_size:
        raise PipelineError(f"collected token id {largest_id} is outside the target's {target.config.vocab_size:,}-token "
                            "vocabulary: the data was collected with another tokenizer; rerun stage=collect")
    return Inputs(cfg, settings, tracker, state, dataset, manifest, serving_sampling(settings.serving, manifest),
                  target, tokenizer, {**model_identity(target_path), "name": cfg.model.target.get("name")}, draft,
                  draft_tokenizer, draft_info, stop_token_ids(tokenizer, target))


# ---------------------------------------------------------------- split
def fingerprint(cfg: DictConfig, target_ident: dict, manifest: dict, n_rows: int) -> str:
    """Names the checkpoint directory: what decides the trained weights, nothing that only watches training."""
    settings = {group: OmegaConf.to_container(cfg.distill[group], resolve=True) for group in FINGERPRINTED}
    for (group, key), off in ADDED_LATER.items():
        if settings[group].get(key, off) == off:
            settings[group].pop(key, None)
    objective = settings["objective"]
    objective.pop("max_new_tokens", None)  # decides the weights only where the draft or target generates: then resolved
    if float(objective.get("lmbda") or 0) > 0 or objective.get("seq_kd"):
        objective["max_new_tokens"] = min(int(generation_length(cfg.distill.objective, manifest) or 1 << 30),
                                          int(objective["max_completion_length"]))
    blob = json.dumps({"target": target_ident.get("source_sha256") or target_ident.get("path"),
                       "draft": OmegaConf.to_container(cfg.model.draft, resolve=True), "distill": settings,
                       "collect": manifest, "rows": n_rows, "seed": cfg.seed}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def split_rows(inputs: Inputs) -> Split:
    """Train rows (materialised in our cache, never next to collect's output), held-out row indices, the
    FR-Spec subset and the checkpoint fingerprint."""
    collected, split = inputs.collected, inputs.settings.split
    seed = int(inputs.cfg.seed)
    train_idx, held_idx = split_by_prompt(collected["prompt_id"], collected["domain"], float(split.heldout_fraction),
                                          split.heldout_max_prompts_per_domain, seed)
    if not held_idx:
        raise PipelineError("no domain has two or more collected prompts, so nothing can be held out: "
                            "collect more prompts per domain")
    columns = [c for c in ("prompt_ids", "completion_ids", "topk_ids", "topk_logprobs", "final_hidden")
               if c in collected.column_names]
    ids = collected.select_columns(["prompt_ids", "completion_ids"])
    prompts, completions = ids["prompt_ids"], ids["completion_ids"]
    train_idx = [i for i in train_idx if prompts[i] and completions[i]]
    train = collected.select(train_idx).select_columns(columns)
    vocab = share = all_train = None
    k_subset = int(inputs.cfg.model.draft.get("vocab_subset") or 0)
    if k_subset:  # from every train row, also for a learning-curve point: its points then differ only in data
        vocab = vocab_subset(train["completion_ids"], k_subset, inputs.target.config.vocab_size, inputs.stops,
                             train["prompt_ids"])
    if float(split.train_fraction) < 1.0:  # a learning-curve point: nested subsets of the train prompts
        prompt_ids, domains = collected["prompt_id"], collected["domain"]
        share = nested_subset([prompt_ids[i] for i in train_idx], [domains[i] for i in train_idx],
                              float(split.train_fraction), seed)
        all_train, train = train, train.select(share)
    name = fingerprint(inputs.cfg, inputs.target_ident, inputs.manifest, len(collected))
    scratch = Path(inputs.cfg.paths.cache) / "distill"
    scratch.mkdir(parents=True, exist_ok=True)
    # datasets' cache files must not land in collect's folder (DVC would see its output as modified)
    train = train.flatten_indices(cache_file_name=str(scratch / f"train-{name}-rank{inputs.state.process_index}.arrow"))
    log(f"{len(train)} train rows ({sum(map(len, train['completion_ids'])):,} completion tokens), "
        f"{len(held_idx)} held-out rows; draft {inputs.draft_info}, "
        f"{sum(p.numel() for p in inputs.draft.parameters()) / 1e6:.1f}M params; serving {inputs.sampling}"
        + (f"; FR-Spec head {len(vocab)} tokens" if vocab is not None else ""))
    return Split(train, held_idx, name, vocab, all_train, share)


# ---------------------------------------------------------------- held-out acceptance
def build_heldouts(inputs: Inputs, split: Split) -> HeldOuts:
    """The target's serving distribution on the calibration and reporting parts (main process only)."""
    held = inputs.collected.select(split.heldout_idx)
    held = held.remove_columns([c for c in ("final_hidden",) if c in held.column_names])  # row dicts stay small
    calibration_idx, reporting_idx, disjoint = split_heldout(held["prompt_id"], held["domain"],
                                                             float(inputs.settings.split.calibration_share),
                                                             int(inputs.cfg.seed))
    if not disjoint:
        log("note: a domain has a single held-out prompt, used both to calibrate and to report (collect more "
            "prompts per domain for an unbiased report)")
    heldout = inputs.settings.heldout

    def part(indices):
        return cal.build_heldout(inputs.target, [held[i] for i in indices], [held["domain"][i] for i in indices],
                                 inputs.sampling, inputs.truncation, int(heldout.support), int(heldout.batch_size),
                                 inputs.tokenizer.pad_token_id)

    calibration, reporting = part(calibration_idx), part(reporting_idx)
    sizes = {"disjoint": disjoint, **{name: {"rows": len(h.rows), "positions": h.n_positions}
                                      for name, h in (("calibration", calibration), ("reporting", reporting))}}
    return HeldOuts(calibration, reporting, sizes)


def serving_acceptance(inputs: Inputs, heldout: cal.HeldOut, vocab: torch.Tensor | None) -> dict[str, dict]:
    """Per-domain summary of α with the draft sampling at the serving temperature."""
    alpha = cal.acceptance(inputs.draft, heldout, [inputs.sampling.temperature], vocab)[0]
    return cal.summarize(alpha, heldout, int(inputs.settings.heldout.gamma))


def measure_before(inputs: Inputs, heldouts: HeldOuts | None, vocab: torch.Tensor | None) -> dict:
    """Held-out acceptance of the undistilled draft on both parts ({} off the main process)."""
    if heldouts is None:
        return {}
    before = {"calibration": serving_acceptance(inputs, heldouts.calibration, vocab),
              "reporting": serving_acceptance(inputs, heldouts.reporting, vocab)}
    gamma = int(inputs.settings.heldout.gamma)
    inputs.tracker.log_metrics(cal.heldout_metrics(before["reporting"], gamma, "heldout_before"), step=0)
    log(f"held-out acceptance before: {before['reporting'][cal.OVERALL]['acceptance']:.3f} "
        f"(reporting part, {heldouts.reporting.n_positions} positions, p truncation ≤ "
        f"{float(heldouts.reporting.p_tail.mean()):.4f})")
    return before


def export_undistilled(inputs: Inputs, split: Split, heldouts: HeldOuts, before: dict) -> None:
    """${paths.draft_init}: the undistilled draft with its held-out acceptance (calibrated later, when
    distill.calibration.calibrate_init, by export_calibrated_init)."""
    spec = SpeculativeSpec(inputs.target_ident, inputs.sampling, inputs.draft_info, split.vocab_list, distilled=False,
                           selected="init", acceptance={"before": _acceptances(before["reporting"])},
                           heldout=heldouts.sizes)
    save_draft(copy.deepcopy(inputs.draft).to(inputs.serving_dtype), inputs.draft_tokenizer, inputs.cfg.paths.draft_init,
               spec, None, inputs.target.generation_config,
               head_fill=cal.out_of_subset_fill(inputs.draft, heldouts.calibration, split.vocab))


def snapshot(model) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def select_weights(inputs: Inputs, heldouts: HeldOuts, vocab: torch.Tensor | None, before: dict,
                   initial_weights: dict | None) -> dict:
    """keep_best on the calibration part: the initial weights when training lowered held-out acceptance.
    Returns {"selected", "after_training" (reporting part, trained weights), "after" (reporting part, the
    exported weights: the initial draft's numbers are the `before` ones)}."""
    trained_summary = serving_acceptance(inputs, heldouts.reporting, vocab)
    trained = _acceptances(trained_summary)
    after = serving_acceptance(inputs, heldouts.calibration, vocab)[cal.OVERALL]["acceptance"]
    first = before["calibration"][cal.OVERALL]["acceptance"]
    if inputs.settings.calibration.keep_best and initial_weights is not None and after < first:
        log(f"held-out acceptance fell in training ({first:.3f} → {after:.3f} on the calibration part): exporting "
            "the initial draft (distill.calibration.keep_best=false ships the trained one)")
        inputs.draft.load_state_dict(initial_weights)
        return {"selected": "init", "after_training": trained, "after": before["reporting"]}
    return {"selected": "distilled", "after_training": trained, "after": trained_summary}


# ---------------------------------------------------------------- report (reporting part) and export
def build_spec(inputs: Inputs, split: Split, heldouts: HeldOuts, before: dict, training: TrainingResult,
               selected: dict, calibration: Calibration, distilled: bool = True) -> SpeculativeSpec:
    """speculative.json: the calibration, and every reported number measured on the reporting part."""
    gamma, reporting, after = int(inputs.settings.heldout.gamma), heldouts.reporting, selected["after"]
    calibrated = cal.acceptance_at(inputs.draft, reporting, calibration.temperature, split.vocab)
    trees = tree_candidates(inputs, split, reporting, calibration)
    # what engines that run the exported checkpoint's full head get (export.py writes the subset into it)
    full_head = cal.acceptance_at(exported_weights(inputs.draft, split.vocab_list, calibration.head_fill), reporting,
                                  calibration.temperature)
    return SpeculativeSpec(
        inputs.target_ident, inputs.sampling,
        {**inputs.draft_info, "parameters": sum(p.numel() for p in inputs.draft.parameters())}, split.vocab_list,
        distilled=distilled, gamma=_with_default(calibration.gamma),
        draft_length=_with_default({k: v.to_dict() for k, v in calibration.draft_length.items()}),
        tree=_with_default(calibration.tree), tree_candidates=_with_default(trees) if trees else {},
        speculate=_with_default(calibration.speculate),
        draft_temperature=_with_default(calibration.temperature), selected=selected["selected"],
        acceptance={"before": _acceptances(before["reporting"]), "after": _acceptances(after),
                    "after_training": selected["after_training"],
                    "after_calibrated": _per_domain(calibrated, reporting), "full_head": _per_domain(full_head, reporting)},
        mean_accepted_length={"gamma": gamma, **{name: {k: v["mean_accepted_length"] for k, v in summary.items()}
                                                 for name, summary in (("before", before["reporting"]),
                                                                       ("after", after))}},
        per_position_acceptance={k: v["per_position_acceptance"] for k, v in after.items()},
        predicted_speedup=predict_speedup(inputs, split, reporting, calibrated, calibration, trees),
        cost=calibration.cost, training=training_record(inputs, split, training), learning_curve=training.curve,
        heldout=heldouts.sizes)


def training_record(inputs: Inputs, split: Split, training: TrainingResult) -> dict:
    """speculative.json `training`: the objective and what the run trained on."""
    objective = inputs.settings.objective
    return {"loss": objective.loss, "teacher": objective.teacher, "lmbda": float(objective.lmbda),
            "seq_kd": bool(objective.seq_kd), "adaspec_keep": objective.adaspec_keep,
            "steps": training.steps, "train_tokens": training.tokens, "minutes": round(training.minutes, 2),
            "rows": len(split.train), "data_tokens": sum(map(len, split.train["completion_ids"])),
            "train_fraction": float(inputs.settings.split.train_fraction), "fingerprint": split.fingerprint}


def export(inputs: Inputs, split: Split, spec: SpeculativeSpec, profile: dict, head_fill: torch.Tensor | None,
           engine_files: dict[str, Path]) -> None:
    """The tuned draft in the serving dtype with speculative.json, a model card and the files its engines serve
    (draft.gguf); the table; MLflow."""
    paths = inputs.cfg.paths
    save_calibrated(inputs, spec, profile, head_fill, paths.draft, "distilled", engine_files)
    if not inputs.settings.checkpoint.keep:
        shutil.rmtree(Path(paths.artifacts) / "distill_ckpt" / split.fingerprint, ignore_errors=True)
    print(format_table(spec))
    acceptance = spec.acceptance
    inputs.tracker.log_metrics({
        **{f"heldout_after/acceptance/{k}": v for k, v in acceptance["after"].items()},
        **{f"calibrated_acceptance/{k}": v for k, v in acceptance["after_calibrated"].items()},
        **{f"full_head_acceptance/{k}": v for k, v in acceptance["full_head"].items()},
        **{f"draft_temperature/{k}": v for k, v in spec.draft_temperature.items()},
        **{f"best_gamma/{k}": v for k, v in spec.gamma.items()},
        **{f"predicted_speedup/{k}": v for k, v in spec.predicted_speedup.items()},
        "c": spec.cost["c"], "train_tokens": spec.training["train_tokens"], "train_minutes": spec.training["minutes"]})
    inputs.tracker.log_artifact(str(Path(paths.draft) / "speculative.json"))
    inputs.tracker.log_artifact(str(Path(paths.draft) / "README.md"))


def save_calibrated(inputs: Inputs, spec: SpeculativeSpec, profile: dict, head_fill: torch.Tensor | None, path: str,
                    label: str, files: dict[str, Path] | None = None) -> None:
    """The draft in the serving dtype with its calibration, model card and cost profile (each argument is an
    earlier step's product)."""
    generation_config = copy.deepcopy(inputs.target.generation_config)
    hf_setting = ((spec.engines.get("hf") or {}).get("generation_config") or {}).get(DEFAULT)
    # HF assisted generation reads these from the assistant: HF's own calibration where there is one (a default
    # calibrated "off" keeps our decoder's; the card says to serve without the draft there)
    for key, value in (hf_setting or spec.draft_length_for(DEFAULT).hf_generation_config()).items():
        setattr(generation_config, key, value)
    save_draft(inputs.draft.to(inputs.serving_dtype), inputs.draft_tokenizer, path, spec,
               model_card(spec, f"{inputs.cfg.model.draft.name} ({label})"), generation_config,
               extra={FILENAME: profile}, head_fill=head_fill, files=files)


def export_calibrated_init(inputs: Inputs, split: Split, heldouts: HeldOuts, before: dict, initial_weights: dict,
                           dtype: torch.dtype, profile: dict, calibration: Calibration | None) -> None:
    """${paths.draft_init} again, now with its own serving calibration (τ, γ, policy, tree for the same cost
    profile): comparing the distilled draft against an uncalibrated one would credit distillation with what
    calibration alone buys. Each argument is an earlier step's product (the stage body)."""
    inputs.draft.to(dtype).load_state_dict(initial_weights)  # calibrated in the dtype the distilled draft was
    calibration = calibration or calibrate(inputs, split, heldouts.calibration, profile)  # given when keep_best
    none = TrainingResult(steps=0, tokens=0, minutes=0.0, curve=[])                        # shipped the initial weights
    selected = {"selected": "init", "after_training": _acceptances(before["reporting"]), "after": before["reporting"]}
    spec = build_spec(inputs, split, heldouts, before, none, selected, calibration, distilled=False)
    save_calibrated(inputs, spec, profile, calibration.head_fill, inputs.cfg.paths.draft_init, "undistilled, calibrated")
    log(f"exported {inputs.cfg.paths.draft_init} with its own calibration (predicted speedup "
        f"{spec.predicted_speedup.get(cal.OVERALL)}×)")


def _per_domain(alpha: torch.Tensor, heldout: cal.HeldOut) -> dict[str, float]:
    return {domain: float(alpha[mask].mean()) if mask.any() else 0.0 for domain, mask in cal.domain_index(heldout).items()}


def _acceptances(summary: dict) -> dict[str, float]:
    return {k: v["acceptance"] for k, v in summary.items()}


def _with_default(per_domain: dict) -> dict:
    out = {k: v for k, v in per_domain.items() if k != cal.OVERALL}
    out[DEFAULT] = per_domain[cal.OVERALL]
    return out
