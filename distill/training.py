"""One distillation run of the stage: TrainingArguments from conf, DistillTrainer, resume, token accounting."""
from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping

import torch

from distill import calibrate as cal
from distill.calibrate import HeldOut
from distill.draft import freeze_shared
from distill.job import Inputs, Split
from distill.progress import AcceptanceCallback, ProgressCallback, RunProgress, TimeBudgetCallback
from distill.trainer import DistillConfig, DistillTrainer
from pipeline.heads import restore_full_head, use_subset_head


@dataclass
class TrainingResult:
    steps: int
    tokens: int  # completion tokens the loss saw, over the whole run (resumes included)
    minutes: float  # training minutes of the whole run (resumes included, held-out evaluation excluded)
    curve: list[dict]  # [{step, train_tokens, train_minutes, acceptance, by_domain}] on the reporting part


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


def training_arguments(job: Inputs, n_rows: int, out_dir: Path) -> DistillConfig:
    """conf's `trainer:` and `objective:` by name, the checkpoint cadence, and the plumbing only the stage knows."""
    settings = job.settings
    trainer = dict(settings.trainer)  # TrainingArguments names, and max_epochs, which is not one
    rows_per_step = (int(trainer["per_device_train_batch_size"]) * int(trainer["gradient_accumulation_steps"])
                     * job.state.num_processes)
    trainer["max_steps"] = step_budget(trainer, n_rows, rows_per_step)
    trainer.pop("max_epochs")
    trainer["bf16"] = mixed_bf16(trainer["bf16"], job.target)
    checkpoint = settings.checkpoint
    objective = asdict(settings.objective)
    objective["max_new_tokens"] = generation_length(settings.objective, job.manifest)
    return DistillConfig(
        output_dir=str(out_dir), **trainer, **objective,
        save_strategy="steps", save_steps=int(checkpoint.save_steps), save_total_limit=int(checkpoint.save_total_limit),
        logging_steps=int(checkpoint.logging_steps), seed=int(job.cfg.seed), data_seed=int(job.cfg.seed),
        report_to="none",  # the stage logs to MLflow itself (AcceptanceCallback)
        remove_unused_columns=False, length_column_name="length",  # the collator reads the label columns
        use_cpu=next(job.target.parameters()).device.type == "cpu", ddp_find_unused_parameters=False,
        disable_tqdm=not job.is_main)


def train_draft(job: Inputs, split: Split, reporting: HeldOut | None, log) -> TrainingResult:
    """Runs DistillTrainer on the split's train rows, resuming from the last checkpoint of this fingerprint;
    the main process watches held-out acceptance on `reporting`."""
    from transformers.trainer_utils import get_last_checkpoint

    out_dir = Path(job.cfg.paths.artifacts) / "distill_ckpt" / split.fingerprint
    if not job.settings.checkpoint.resume and out_dir.exists() and job.is_main:
        shutil.rmtree(out_dir)
    job.state.wait_for_everyone()
    last = get_last_checkpoint(str(out_dir)) if out_dir.exists() else None
    objective = job.settings.objective
    trainable = freeze_shared(job.draft) if objective.freeze_shared else sum(
        p.numel() for p in job.draft.parameters() if p.requires_grad)
    gamma = int(job.settings.heldout.gamma)

    def evaluate(model):
        alpha = cal.acceptance(model, reporting, [job.sampling.temperature], split.vocab)[0]
        return cal.heldout_metrics(cal.summarize(alpha, reporting, gamma), gamma)

    progress = RunProgress(last, job.state.num_processes)
    acceptance_cb = AcceptanceCallback(evaluate, job.tracker, int(job.settings.heldout.eval_steps), progress,
                                       is_main=job.is_main, printer=log)
    minutes = job.settings.checkpoint.max_train_minutes
    budget = TimeBudgetCallback(minutes, progress)
    arguments = training_arguments(job, len(split.train), out_dir)
    # the time or step budget was spent before the interruption (or this is a rerun to calibrate for other serving
    # settings)
    spent = bool(last and ((minutes and progress.seconds0 >= 60 * float(minutes))
                           or int(Path(last).name.split("-")[-1]) >= arguments.max_steps))
    full_head = use_subset_head(job.draft, split.vocab)
    job.draft.train()
    trainer = DistillTrainer(job.draft, arguments, split.train,
                             teacher_model=job.target, vocab=split.vocab, stop_ids=job.stops,
                             processing_class=job.tokenizer,
                             callbacks=[ProgressCallback(progress, job.is_main), acceptance_cb, budget])
    progress.trainer = trainer
    log(f"training {trainable / 1e6:.1f}M parameters: loss={objective.loss}, teacher={objective.teacher}, "
        f"lmbda={objective.lmbda}, {'resuming from ' + last if last else 'from scratch'} -> {out_dir}")
    cpu0 = time.process_time()
    if spent:  # the checkpoint's weights, no further step (Trainer.train resumed mid-epoch would take one more)
        trainer._load_from_checkpoint(last)
        steps = int(Path(last).name.split("-")[-1])
        acceptance_cb.on_train_end(arguments, SimpleNamespace(global_step=steps), None, model=job.draft)
    else:
        steps = int(trainer.train(resume_from_checkpoint=last).global_step)
    restore_full_head(job.draft, full_head)
    job.draft.eval()
    tokens, minutes = _run_tokens(job, trainer, progress), progress.seconds() / 60
    job.tracker.log_metrics({"train_steps": steps, "train_tokens": tokens, "on_policy_batches": trainer.on_policy_batches})
    if job.is_main:
        log(f"trained {steps} steps, {tokens:,} completion tokens, {minutes:.1f} min over the whole run "
            f"({tokens / max(minutes, 1e-9) / 60:.0f} tokens/s; this process {(time.process_time() - cpu0) / 60:.1f} "
            "CPU-minutes)")
    return TrainingResult(steps, tokens, minutes, progress.curve)


def _run_tokens(job, trainer, progress: RunProgress) -> int:
    """Completion tokens of the whole run: the resumed checkpoint's count plus every process's own batches."""
    local = torch.tensor(float(trainer.train_tokens), device=trainer.args.device)
    here = int(trainer.accelerator.reduce(local, "sum").item()) if job.state.num_processes > 1 else int(local)
    return progress.tokens0 + here
