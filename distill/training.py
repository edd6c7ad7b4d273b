"""One distillation run: TrainingArguments from conf, the step size fitted to the draft (`trainer.lr_probe`: Adam
moves every weight by about the learning rate each step, so a draft already close to its target can only lose at a
stub's rate; each share runs a few steps judged like keep_best, and training takes the best or none), the stop rule,
resume and token accounting.
"""
from __future__ import annotations

import gc
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping

import torch

from distill import simulator as sim
from distill.draft import freeze_shared
from distill.heldouts import served_acceptance
from distill.job import HeldOuts, Inputs, Split
from distill.progress import (AcceptanceCallback, BestWeightsCallback, HeapTrimCallback, ProgressCallback,
                              RunProgress, TimeBudgetCallback, from_main, put_back, trained_weights)
from distill.settings import OUR_TRAINER_KEYS
from distill.trainer import DistillConfig, DistillTrainer, restore_forward
from pipeline.heads import restore_full_head, use_subset_head
from pipeline.machine import release_freed_memory


@dataclass
class TrainingResult:
    steps: int
    tokens: int  # completion tokens the loss saw, over the whole run (resumes and the probe included)
    minutes: float  # training minutes of the whole run (resumes and the probe included, held-out evaluation excluded)
    curve: list[dict]  # [{step, train_tokens, train_minutes, acceptance, by_domain}] on the reporting part
    recipe: dict = field(default_factory=dict)  # the step size chosen and why, and the stop rule's record


def mixed_bf16(choice, target) -> bool:
    """bf16 autocast over fp32 master weights: `auto` follows the serving dtype (CUDA, or a CPU with native bf16)."""
    return next(target.parameters()).dtype == torch.bfloat16 if choice == "auto" else bool(choice)


def step_budget(trainer_settings: Mapping, n_rows: int, rows_per_step: int) -> int:
    """max_steps, capped at max_epochs passes over the train rows when that is fewer."""
    max_steps = int(trainer_settings["max_steps"]) if trainer_settings["max_steps"] else -1
    if trainer_settings["max_epochs"]:
        by_epochs = max(1, math.ceil(float(trainer_settings["max_epochs"]) * n_rows / rows_per_step))
        max_steps = by_epochs if max_steps < 0 else min(max_steps, by_epochs)
    return max_steps


def generation_length(objective, manifest: dict) -> int | None:
    """Tokens an on-policy (or seq-KD) continuation may run: objective.max_new_tokens (distill.objective, as settings
    or as config), else the collect's own max_new_tokens, so generated and collected batches are alike."""
    return objective.max_new_tokens or manifest.get("max_new_tokens")


def training_arguments(job: Inputs, n_rows: int, out_dir: Path, **overrides) -> DistillConfig:
    """conf's `trainer:` and `objective:` by name, the checkpoint cadence, and the plumbing only the stage knows;
    `overrides` replace any of them (the learning rate chosen, the probe's short constant-rate runs)."""
    settings = job.settings
    trainer = {k: v for k, v in settings.trainer.items() if k not in OUR_TRAINER_KEYS}  # TrainingArguments names
    rows_per_step = (int(trainer["per_device_train_batch_size"]) * int(trainer["gradient_accumulation_steps"])
                     * job.state.num_processes)
    trainer["max_steps"] = step_budget(settings.trainer, n_rows, rows_per_step)
    trainer["bf16"] = mixed_bf16(trainer["bf16"], job.target)
    checkpoint = settings.checkpoint
    objective = asdict(settings.objective)
    objective["max_new_tokens"] = generation_length(settings.objective, job.manifest)
    return DistillConfig(**{
        "output_dir": str(out_dir), **trainer, **objective,
        "save_strategy": "steps", "save_steps": int(checkpoint.save_steps),
        "save_total_limit": int(checkpoint.save_total_limit), "logging_steps": int(checkpoint.logging_steps),
        "seed": int(job.cfg.seed), "data_seed": int(job.cfg.seed),
        "report_to": "none",  # the stage logs to MLflow itself (AcceptanceCallback)
        "remove_unused_columns": False, "length_column_name": "length",  # the collator reads the label columns
        "use_cpu": next(job.target.parameters()).device.type == "cpu", "ddp_find_unused_parameters": False,
        "disable_tqdm": not job.is_main, **overrides})


# ---------------------------------------------------------------- the step size fitted to the draft
def probe_learning_rate(job: Inputs, split: Split, judge, out_dir: Path, progress: RunProgress, log) -> dict:
    """{"learning_rate", "configured", "probe_steps", "probe": {"initial": the initial weights' calibration-part
    acceptance, rate: after the probe's steps}}: lr_probe.factors × learning_rate tried largest first, lr_probe.steps
    constant-rate steps each from the initial weights; the first whose held-out acceptance beats the initial weights
    is chosen and training continues from its steps (a stub pays one held-out pass for the probe); when none does,
    the rate is 0 (no training) and the draft keeps its initial weights. Larger rates train a draft that tolerates them
    faster, and the stop rule catches a rate that gains early and loses later. The probe's steps count as training."""
    configured, probe = float(job.settings.trainer["learning_rate"]), job.settings.trainer["lr_probe"]
    initial, patched = trained_weights(job.draft), vars(job.draft).get("forward")
    scores, chosen = {0.0: judge(job.draft) if job.is_main else 0.0}, 0.0
    for factor in sorted((float(f) for f in probe["factors"]), reverse=True):
        rate = configured * factor
        arguments = training_arguments(job, len(split.train), out_dir / "probe", learning_rate=rate,
                                       max_steps=int(probe["steps"]), warmup_steps=0, lr_scheduler_type="constant",
                                       save_strategy="no", logging_strategy="no", disable_tqdm=True)
        trainer, started = _trainer(job, split, arguments, callbacks=[]), time.time()
        trainer.train()
        progress.seconds0 += time.time() - started  # held-out passes watch training: the budget counts the steps only
        restore_forward(job.draft, patched)  # accelerate's autocast wrapper: the next trainer adds its own
        progress.tokens0 += _run_tokens(job, trainer, RunProgress(None, job.state.num_processes))
        _free(trainer)  # its optimizer state (the draft's trained weights twice over) before the next one's
        scores[rate] = judge(job.draft) if job.is_main else 0.0
        if from_main(scores[rate] > scores[0.0], job.state.device):  # only the main process holds the held-out rows
            chosen = rate
            break
        put_back(job.draft, initial)
    log(f"learning-rate probe (held-out acceptance on the calibration part after {probe['steps']} steps from the "
        "initial weights): " + ", ".join(f"{_rate_name(r)} {a:.3f}" for r, a in scores.items())
        + (f" -> training on at {chosen:.1e}" if chosen else " -> no rate beats the initial weights: no training"))
    return {"learning_rate": chosen, "configured": configured, "probe_steps": int(probe["steps"]),
            "probe": {_rate_name(r): round(a, 4) for r, a in scores.items()}}


def _rate_name(rate: float) -> str:
    return "initial" if rate == 0 else f"{rate:.3g}"


def _trainer(job: Inputs, split: Split, arguments: DistillConfig, callbacks: list) -> DistillTrainer:
    return DistillTrainer(job.draft, arguments, split.train, teacher_model=job.target, vocab=split.vocab,
                          stop_ids=job.stops, processing_class=job.tokenizer, callbacks=callbacks)


def recipe_record(recipe: dict, stop: BestWeightsCallback | None) -> dict:
    """training.json `training.recipe`: the step size chosen and why, and what the stop rule did."""
    if stop is None:
        return dict(recipe)
    state = stop.state
    return {**recipe, "stop_patience": stop.patience, "stopped_at": state["stopped_at"],
            "kept_step": state["kept_step"], "kept_acceptance": state["kept"],
            "initial_acceptance": state["baseline"]}


# ---------------------------------------------------------------- training
def last_complete_checkpoint(out_dir: Path, remove_partial: bool = True) -> str | None:
    """The newest checkpoint the Trainer finished writing: it writes trainer_state.json last and not atomically, so
    a crash or a full disk mid-save leaves a newer folder without it, from which a resume would fail; such folders
    are removed (by the main process only: `remove_partial`) and the one before is resumed."""
    steps = {int(path.name.split("-")[1]): path for path in (out_dir.glob("checkpoint-*") if out_dir.exists() else [])
             if path.is_dir() and path.name.split("-")[1].isdigit()}
    complete = [step for step in sorted(steps) if (steps[step] / "trainer_state.json").exists()]
    newest = complete[-1] if complete else -1
    for step in (step for step in steps if step > newest and remove_partial):
        shutil.rmtree(steps[step], ignore_errors=True)
    return str(steps[newest]) if complete else None


def train_draft(job: Inputs, split: Split, heldouts: HeldOuts | None, log) -> TrainingResult:
    """Runs DistillTrainer on the split's train rows at the step size the probe fits to the draft, resuming from the
    last checkpoint of this fingerprint; the main process watches held-out acceptance (`heldouts`: the curve on the
    reporting part, the probe and the stop rule on the calibration part; None off the main process)."""
    out_dir = Path(job.cfg.paths.artifacts) / "distill_ckpt" / split.fingerprint
    if not job.settings.checkpoint.resume and out_dir.exists() and job.is_main:
        shutil.rmtree(out_dir)
    job.state.wait_for_everyone()
    last = last_complete_checkpoint(out_dir, remove_partial=job.is_main)
    objective, trainer_settings = job.settings.objective, job.settings.trainer
    trainable = freeze_shared(job.draft) if objective.freeze_shared else sum(
        p.numel() for p in job.draft.parameters() if p.requires_grad)
    evaluate, judge = _watchers(job, split, heldouts)
    progress = RunProgress(last, job.state.num_processes)
    acceptance_cb = AcceptanceCallback(evaluate, job.tracker, int(job.settings.heldout.eval_steps), progress,
                                       is_main=job.is_main, printer=log)
    minutes = job.settings.checkpoint.max_train_minutes
    full_head = use_subset_head(job.draft, split.vocab)
    job.draft.train()
    if progress.recipe is None:  # a resume keeps the step size its run chose
        progress.recipe = (probe_learning_rate(job, split, judge, out_dir, progress, log) if trainer_settings["lr_probe"]
                           else {"learning_rate": float(trainer_settings["learning_rate"])})
    rate = float(progress.recipe["learning_rate"])
    stop = _stop_rule(job, judge, progress, rate, log)
    arguments = training_arguments(job, len(split.train), out_dir, learning_rate=rate)
    # the time or step budget was spent before the interruption (or this is a rerun to calibrate for other serving
    # settings)
    spent = bool(last and ((minutes and progress.seconds0 >= 60 * float(minutes))
                           or int(Path(last).name.split("-")[-1]) >= arguments.max_steps))
    watchers = [acceptance_cb] + ([stop] if stop else [])  # the curve sees the last weights before the best are put back
    trainer = _trainer(job, split, arguments,
                       [ProgressCallback(progress, job.is_main), *watchers, TimeBudgetCallback(minutes, progress),
                        HeapTrimCallback()])
    progress.trainer = trainer
    log(f"training {trainable / 1e6:.1f}M parameters: loss={objective.loss}, teacher={objective.teacher}, "
        f"lmbda={objective.lmbda}, learning rate {rate:.1e}, "
        f"{'resuming from ' + last if last else 'from scratch'} -> {out_dir}")
    cpu0 = time.process_time()
    if rate == 0 or spent:  # no step: none beats the initial weights, or the budget was spent before a resume
        steps = int(Path(last).name.split("-")[-1]) if spent else 0
        if spent:  # the checkpoint's weights (Trainer.train resumed mid-epoch would take one more step)
            trainer._load_from_checkpoint(last)
        for watcher in watchers:
            watcher.on_train_end(arguments, SimpleNamespace(global_step=steps), None, model=job.draft)
    else:
        steps = int(trainer.train(resume_from_checkpoint=last).global_step)
    restore_full_head(job.draft, full_head)
    job.draft.eval()
    tokens, minutes = _run_tokens(job, trainer, progress), progress.seconds() / 60
    job.tracker.log_metrics({"train_steps": steps, "train_tokens": tokens, "on_policy_batches": trainer.on_policy_batches,
                             "train_learning_rate": rate})
    if job.is_main:
        log(f"trained {steps} steps, {tokens:,} completion tokens, {minutes:.1f} min over the whole run "
            f"({tokens / max(minutes, 1e-9) / 60:.0f} tokens/s; this process {(time.process_time() - cpu0) / 60:.1f} "
            "CPU-minutes)")
    result = TrainingResult(steps, tokens, minutes, progress.curve, recipe_record(progress.recipe, stop))
    # the optimizer state, gradients and best-weights snapshot (put back already) go before keep_best and the export
    progress.trainer = None
    if stop is not None:
        stop.weights = None
    _free(trainer)
    return result


def _free(trainer) -> None:
    """Drops a finished trainer's optimizer state, scheduler and the model's gradients, and collects the cycles
    (Trainer, callbacks, progress) that hold them: refcounting alone never frees those."""
    trainer.accelerator.free_memory()
    trainer.optimizer = trainer.lr_scheduler = None
    trainer.model.zero_grad(set_to_none=True)
    gc.collect()
    release_freed_memory()  # the freed optimizer state's pages, before keep_best and the export load more


def _watchers(job: Inputs, split: Split, heldouts: HeldOuts | None):
    """(evaluate: the curve's metrics on the reporting part, judge: keep_best's measure, overall acceptance on the
    calibration part) of a model as served (its serving dtype), at the serving temperature."""
    gamma, temperature, dtype = int(job.settings.heldout.gamma), [job.sampling.temperature], job.serving_dtype

    def evaluate(model):
        alpha = served_acceptance(model, dtype, heldouts.reporting, temperature, split.vocab)[0]
        return sim.heldout_metrics(sim.summarize(alpha, heldouts.reporting, gamma), gamma)

    def judge(model):
        alpha = served_acceptance(model, dtype, heldouts.calibration, temperature, split.vocab)[0]
        return sim.summarize(alpha, heldouts.calibration, gamma)[sim.OVERALL]["acceptance"]

    return evaluate, judge


def _stop_rule(job: Inputs, judge, progress: RunProgress, rate: float, log) -> BestWeightsCallback | None:
    """trainer.stop_patience's callback (None: off, or nothing to train), measured from the initial weights'
    acceptance (the probe's, when it ran)."""
    patience = job.settings.trainer["stop_patience"]
    if not patience or rate == 0:
        return None
    baseline = (progress.recipe.get("probe") or {}).get("initial")
    if baseline is None and progress.best is None:
        baseline = judge(job.draft) if job.is_main else 0.0
    return BestWeightsCallback(judge, int(job.settings.heldout.eval_steps), int(patience), baseline or 0.0, progress,
                               is_main=job.is_main, printer=log)


def _run_tokens(job, trainer, progress: RunProgress) -> int:
    """Completion tokens of the whole run: the resumed checkpoint's count plus every process's own batches."""
    local = torch.tensor(float(trainer.train_tokens), device=trainer.args.device)
    here = int(trainer.accelerator.reduce(local, "sum").item()) if job.state.num_processes > 1 else int(local)
    return progress.tokens0 + here
