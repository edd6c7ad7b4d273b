"""Distill stage: `python -m pipeline stage=distill` (or `accelerate launch -m pipeline stage=distill`). It trains;
the calibrate stage (distill/calibrate_stage.py) turns its weights into serving recipes.

    inputs   = load_inputs(cfg)                      settings, collected rows, target, initial draft
    split    = split_rows(inputs)                    train rows, held-out rows, FR-Spec subset, fingerprint
    heldouts = build_heldouts(inputs, split)         the target's serving p on the calibration and reporting parts
    before   = measure_before(...)                   held-out acceptance of the undistilled draft
    split    = attach_teacher_labels(inputs, split)  the train rows with their teacher labels
    training = train_draft(inputs, split, ...)       distillation (distill/trainer.py), resumable
    selected = select_weights(...)                   keep_best on the calibration part
    save_trained(...)                                ${paths.trained}: draft/, draft_init/, training.json

Only training changes the draft's weights, in place; the initial draft waits on disk (save_initial).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from distill import simulator as sim
from distill.draft import vocab_subset
from distill.export import save_draft
from distill.heldouts import (acceptances, build_heldouts, load_target_inputs, log, serving_acceptance,
                             serving_alpha, split_collected)
from distill.job import HeldOuts, Inputs, Split
from distill.labels import attach_teacher_labels
from distill.training import TrainingResult, generation_length, train_draft
from pipeline.atomic import atomic_dir, write_json
from pipeline.modelio.draft_init import build_draft
from pipeline.errors import PipelineError
from pipeline.modelio.models import check_compatible
from pipeline.control.split import nested_subset
from pipeline.timing import Laps
from pipeline.modelio.trained import RECORD, RECORD_VERSION

FINGERPRINTED = ("objective", "trainer", "split")  # the groups that decide the trained weights (distill/settings.py)
# Knobs added to those groups after checkpoints existed, with the value that means "off": hashed only when set, so
# adding a knob does not orphan every checkpoint trained before it.
ADDED_LATER = {("trainer", "lr_probe"): None, ("trainer", "stop_patience"): None, ("trainer", "extra"): {}}
# manifest keys that measure the collect run (its clock, disk and budget), not the rows it made: a rerun that only
# re-merges finished shards rewrites them (wall_s), and must not orphan the checkpoint of the distill run it resumes
COLLECT_RUN_MEASURES = ("wall_s", "generate_s", "tokens_per_s", "label_cost", "budget", "disk_bytes",
                        "disk_bytes_per_million_tokens")


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
    heldouts = build_heldouts(inputs, split.heldout_idx) if inputs.is_main else None
    before = measure_before(inputs, heldouts, split.vocab)
    initial = save_initial(inputs, split) if inputs.is_main else None
    laps.lap("heldout")
    split = attach_teacher_labels(inputs, split, log)
    laps.lap("labels")
    training = train_draft(inputs, split, heldouts, log)
    laps.lap("training")
    if not inputs.is_main:
        return {}
    selected = select_weights(inputs, heldouts, split.vocab, before)
    save_trained(inputs, split, heldouts, training, selected, initial)
    laps.lap("save")
    log(f"saved {cfg.paths.trained} in {time.time() - t_start:.0f}s: {laps.summary()}; "
        "`python -m pipeline stage=calibrate` turns it into the serving exports")
    tracker.log_metrics({f"distill_seconds/{name}": seconds for name, seconds in laps.parts.items()})
    tracker.log_metrics({**{f"heldout_after/acceptance/{k}": v for k, v in acceptances(selected["after"]).items()},
                         "train_tokens": training.tokens, "train_minutes": training.minutes})
    return {"acceptance_before": before["reporting"][sim.OVERALL]["acceptance"],
            "acceptance_after": selected["after"][sim.OVERALL]["acceptance"],
            "train_tokens": training.tokens, "train_minutes": training.minutes, "trained": str(cfg.paths.trained)}


# ---------------------------------------------------------------- inputs
def load_inputs(cfg: DictConfig, tracker) -> Inputs:
    """Checked settings, the collected rows, the target and the initial draft."""
    inputs = load_target_inputs(cfg, tracker, "distill")
    draft, draft_tokenizer, draft_info = build_draft(cfg.model.draft, inputs.target, inputs.tokenizer, cfg.paths,
                                                     seed=cfg.seed)
    check_compatible(inputs.tokenizer, draft_tokenizer, inputs.target, draft)
    return replace(inputs, draft=draft, draft_tokenizer=draft_tokenizer, draft_info=draft_info)


# ---------------------------------------------------------------- split
def fingerprint(cfg: DictConfig, target_ident: dict, manifest: dict, n_rows: int, loss_temperature: float) -> str:
    """Names the checkpoint directory: what decides the trained weights, nothing that only watches training."""
    settings = {group: OmegaConf.to_container(cfg.distill[group], resolve=True) for group in FINGERPRINTED}
    settings["objective"]["loss_temperature"] = loss_temperature  # `serving` resolved: the serving T decides it
    for (group, key), off in ADDED_LATER.items():
        if settings[group].get(key, off) == off:
            settings[group].pop(key, None)
    objective = settings["objective"]
    objective.pop("max_new_tokens", None)  # decides the weights only where the draft or target generates: then resolved
    if float(objective.get("lmbda") or 0) > 0 or objective.get("seq_kd"):
        objective["max_new_tokens"] = min(int(generation_length(cfg.distill.objective, manifest) or 1 << 30),
                                          int(objective["max_completion_length"]))
    collect = {key: value for key, value in manifest.items() if key not in COLLECT_RUN_MEASURES}
    blob = json.dumps({"target": target_ident.get("source_sha256") or target_ident.get("path"),
                       "draft": OmegaConf.to_container(cfg.model.draft, resolve=True), "distill": settings,
                       "collect": collect, "rows": n_rows, "seed": cfg.seed}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def split_rows(inputs: Inputs) -> Split:
    """Train rows (materialised in our cache, never next to collect's output), held-out row indices, the
    FR-Spec subset and the checkpoint fingerprint."""
    collected, split = inputs.collected, inputs.settings.split
    seed = int(inputs.cfg.seed)
    train_idx, held_idx = split_collected(collected, split, seed)
    origins = collected.unique("origin") if "origin" in collected.column_names else ["target"]
    if inputs.settings.objective.loss == "ce" and {"onpolicy", "text"} & set(origins):
        raise PipelineError("distill.objective.loss=ce learns the target's sampled tokens, but this collect has "
                            "on-policy rows or text rows (tokens the target did not sample: collect.onpolicy.share "
                            "> 0, collect.text.paths): use a divergence loss (fkl, tvd, ...) or a collect without them")
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
    used = train_idx if share is None else [train_idx[i] for i in share]
    cpu_s = label_cpu_seconds(collected, used, inputs.manifest)
    name = fingerprint(inputs.cfg, inputs.target_ident, inputs.manifest, len(collected),
                       inputs.settings.objective.loss_temperature)
    scratch = Path(inputs.cfg.paths.cache) / "distill"
    scratch.mkdir(parents=True, exist_ok=True)
    # datasets' cache files must not land in collect's folder (DVC would see its output as modified)
    train = train.flatten_indices(cache_file_name=str(scratch / f"train-{name}-rank{inputs.state.process_index}.arrow"))
    log(f"{len(train)} train rows ({sum(map(len, train['completion_ids'])):,} completion tokens), "
        f"{len(held_idx)} held-out rows; draft {inputs.draft_info}, "
        f"{sum(p.numel() for p in inputs.draft.parameters()) / 1e6:.1f}M params; serving {inputs.sampling}"
        + (f"; FR-Spec head {len(vocab)} tokens" if vocab is not None else ""))
    return Split(train, held_idx, name, vocab, all_train, share, cpu_s)


def label_cpu_seconds(collected, rows: list[int], manifest: dict) -> float | None:
    """What the labels of `rows` cost: per origin (target generation, the draft's samples, given text) the collect's
    CPU seconds per token (manifest `label_cost`) times the rows' completion tokens of that origin; None where the
    collect recorded no cost for an origin the rows have. Held-out rows are measurement, not training: not counted."""
    cost = manifest.get("label_cost") or {}
    columns = collected.select(rows).select_columns([c for c in ("origin", "completion_ids") if c in collected.column_names])
    tokens: dict[str, int] = {}
    for row in columns:
        origin = row.get("origin", "target")
        tokens[origin] = tokens.get(origin, 0) + len(row["completion_ids"])
    if any(not (cost.get(origin) or {}).get("cpu_s") for origin in tokens):
        return None
    return round(sum(n * cost[o]["cpu_s"] / cost[o]["tokens"] for o, n in tokens.items()), 1)


# ---------------------------------------------------------------- held-out acceptance
def measure_before(inputs: Inputs, heldouts: HeldOuts | None, vocab: torch.Tensor | None) -> dict:
    """Held-out acceptance of the undistilled draft: per position on the calibration part (keep_best's paired judge),
    per domain on the reporting part ({} off the main process)."""
    if heldouts is None:
        return {}
    before = {"calibration_alpha": serving_alpha(inputs, heldouts.calibration, vocab),  # keep_best's paired judge
              "reporting": serving_acceptance(inputs, heldouts.reporting, vocab)}
    gamma = int(inputs.settings.heldout.gamma)
    inputs.tracker.log_metrics(sim.heldout_metrics(before["reporting"], gamma, "heldout_before"), step=0)
    log(f"held-out acceptance before: {before['reporting'][sim.OVERALL]['acceptance']:.3f} "
        f"(reporting part, {heldouts.reporting.n_positions} positions, p truncation ≤ "
        f"{float(heldouts.reporting.p_tail.mean()):.4f})")
    return before


def select_weights(inputs: Inputs, heldouts: HeldOuts, vocab: torch.Tensor | None, before: dict) -> dict:
    """keep_best on the calibration part (distill/simulator.py keep_best): the initial weights unless training raised
    held-out acceptance. Returns {"selected", "verdict" (the judge's numbers), "after_training" (reporting part,
    trained weights), "after" (reporting part, the selected weights: the initial draft's are the `before` ones)}."""
    trained_summary = serving_acceptance(inputs, heldouts.reporting, vocab)
    trained = acceptances(trained_summary)
    calibration = inputs.settings.calibration
    verdict = sim.keep_best(before["calibration_alpha"], serving_alpha(inputs, heldouts.calibration, vocab),
                            heldouts.calibration, calibration.keep_best_rule)
    ci = verdict["ci95"] and "[{:+.3f}, {:+.3f}]".format(*verdict["ci95"])
    log(f"keep_best ({calibration.keep_best_rule}): the trained weights {verdict['difference']:+.3f} {ci or ''} over "
        f"the initial ones on the calibration part ({verdict['initial']:.3f} → {verdict['trained']:.3f})")
    if calibration.keep_best and verdict["selected"] == "init":
        log("keeping the initial draft (calibrate.keep_best=false ships the trained one)")
        return {"selected": "init", "verdict": verdict, "after_training": trained, "after": before["reporting"]}
    return {"selected": "distilled", "verdict": verdict, "after_training": trained, "after": trained_summary}


# ---------------------------------------------------------------- the stage's output
def training_record(inputs: Inputs, split: Split, training: TrainingResult) -> dict:
    """speculative.json `training`: the objective and what the run trained on."""
    objective = inputs.settings.objective
    return {"loss": objective.loss, "teacher": objective.teacher, "lmbda": float(objective.lmbda),
            "seq_kd": bool(objective.seq_kd),
            "steps": training.steps, "train_tokens": training.tokens, "minutes": round(training.minutes, 2),
            "rows": len(split.train), "data_tokens": sum(map(len, split.train["completion_ids"])),
            "train_fraction": float(inputs.settings.split.train_fraction), "fingerprint": split.fingerprint,
            "label_cpu_s": split.label_cpu_s, "train_cpu_s": training.curve[-1].get("train_cpu_s") if training.curve else None,
            "recipe": training.recipe}


def save_initial(inputs: Inputs, split: Split) -> Path:
    """The initial draft on disk before training (not in memory, where a copy costs a whole fp32 draft): the output's
    draft_init/, and what keep_best ships when training gains nothing. Saved again on a resume: build_draft makes the
    same weights. Beside the run's checkpoints, not inside them (a run without `checkpoint.resume` clears those)."""
    path = Path(inputs.cfg.paths.artifacts) / "distill_ckpt" / f"{split.fingerprint}.draft_init"
    save_draft(inputs.draft, inputs.draft_tokenizer, path, inputs.target.generation_config)
    return path


def save_trained(inputs: Inputs, split: Split, heldouts: HeldOuts, training: TrainingResult, selected: dict,
                 initial: Path) -> None:
    """${paths.trained}, replaced in one rename: draft/ (the selected weights, in the training dtype), draft_init/
    (the initial ones) and training.json (the record calibrate reads: the held-out rows, the FR-Spec subset, the
    selection, the training record and the learning curve)."""
    paths = inputs.cfg.paths
    record = {"version": RECORD_VERSION, "fingerprint": split.fingerprint, "rows": len(inputs.collected),
              "heldout_idx": list(split.heldout_idx), "heldout": heldouts.sizes, "vocab_subset": split.vocab_list,
              "draft": {**inputs.draft_info, "parameters": sum(p.numel() for p in inputs.draft.parameters())},
              "selected": selected["selected"], "after_training": selected["after_training"],
              "training": {**training_record(inputs, split, training), "keep_best": selected["verdict"]},
              "learning_curve": training.curve}
    with atomic_dir(paths.trained) as tmp:
        if selected["selected"] == "init":
            shutil.copytree(initial, tmp / "draft")
        else:
            save_draft(inputs.draft, inputs.draft_tokenizer, tmp / "draft", inputs.target.generation_config)
        shutil.copytree(initial, tmp / "draft_init")
        write_json(tmp / RECORD, record)
    if not inputs.settings.checkpoint.keep:
        shutil.rmtree(Path(paths.artifacts) / "distill_ckpt" / split.fingerprint, ignore_errors=True)
        shutil.rmtree(initial, ignore_errors=True)
