"""Distill stage: `python -m pipeline stage=distill` (or `accelerate launch -m pipeline stage=distill`).

collected rows -> train / held-out split by prompt -> draft (conf/model `draft:`) -> held-out acceptance
before -> TRL-style distillation (distill/trainer.py) -> acceptance after -> cost ratio c, draft temperature
and γ per domain (distill/calibrate.py) -> export to ${paths.draft} (+ the undistilled draft to
${paths.draft_init}) -> per-domain before/after table.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from distill import calibrate as cal
from distill.draft import build_draft, freeze_shared, restore_full_head, use_subset_head, vocab_subset
from distill.export import model_card, save_draft
from distill.losses import check_loss
from pipeline.atomic import write_json
from pipeline.chat import stop_token_ids
from pipeline.errors import PipelineError
from pipeline.models import check_compatible, load_role, model_identity

TEACHERS = ("online", "topk")
# Settings that change the result; everything else (logging, eval cadence, time guard) may change
# between a crash and its resume.
RESUME_NEUTRAL = {"resume", "keep_checkpoints", "eval_steps", "logging_steps", "save_steps", "save_total_limit", "max_train_minutes",
                  "heldout_support", "eval_batch_size", "gammas", "tau_ratios", "tau_refine", "cost"}


def log(msg: str) -> None:
    print(f"[distill] {msg}", flush=True)


# ---------------------------------------------------------------- inputs
def check_config(d: DictConfig) -> None:
    check_loss(d.loss, d.beta, d.topk_tail, d.teacher)
    if d.teacher not in TEACHERS:
        raise PipelineError(f"unknown distill.teacher={d.teacher!r}: use online or topk")
    if not 0.0 <= float(d.lmbda) <= 1.0:
        raise PipelineError(f"distill.lmbda={d.lmbda} is not a share in [0, 1]: use e.g. 0 (off) or 0.5")
    if float(d.lmbda) > 0 and d.loss == "ce":
        raise PipelineError("on-policy batches (distill.lmbda > 0) are labelled by the target's distribution, which "
                            "loss=ce does not use: pick loss=fkl|rkl|jsd|tvd or set distill.lmbda=0")
    if not 0.0 < float(d.heldout_fraction) < 1.0:
        raise PipelineError(f"distill.heldout_fraction={d.heldout_fraction} must be in (0, 1): use e.g. 0.15")
    if float(d.loss_temperature) <= 0:
        raise PipelineError(f"distill.loss_temperature={d.loss_temperature} must be > 0: use e.g. 1.0")


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


def serving_sampling(d: DictConfig, manifest: dict) -> cal.Sampling:
    """The serving settings the draft is tuned for: distill.serving.* when set, else the collect manifest's."""
    collected = manifest.get("sampling") or {}
    serving = d.get("serving") or {}

    def pick(key, default):
        value = serving.get(key)
        return collected.get(key, default) if value is None else value

    return cal.Sampling(float(pick("temperature", 0.0) or 0.0), int(pick("top_k", 0) or 0),
                        float(pick("top_p", 1.0) or 1.0))


def split_by_prompt(prompt_ids: list[str], domains: list[str], fraction: float, max_heldout: int | None,
                    seed: int) -> tuple[list[int], list[int]]:
    """Row indices (train, held-out): per domain, the prompts with the smallest hash(seed, prompt_id) are
    held out (at least one where the domain has two or more prompts), so all turns and samples of a prompt
    stay on one side and the split does not depend on row order."""
    by_domain: dict[str, set[str]] = {}
    for pid, dom in zip(prompt_ids, domains):
        by_domain.setdefault(dom, set()).add(pid)
    held = set()
    for dom, pids in by_domain.items():
        order = sorted(pids, key=lambda p: hashlib.sha256(f"{seed}/{p}".encode()).hexdigest())
        n = 0 if len(order) < 2 else max(1, round(fraction * len(order)))
        if max_heldout:
            n = min(n, int(max_heldout))
        held.update(order[:n])
    train = [i for i, p in enumerate(prompt_ids) if p not in held]
    heldout = [i for i, p in enumerate(prompt_ids) if p in held]
    return train, heldout


def fingerprint(cfg: DictConfig, target_ident: dict, manifest: dict, n_rows: int) -> str:
    d = {k: v for k, v in OmegaConf.to_container(cfg.distill, resolve=True).items() if k not in RESUME_NEUTRAL}
    blob = json.dumps({"target": target_ident.get("source_sha256") or target_ident.get("path"),
                       "draft": OmegaConf.to_container(cfg.model.draft, resolve=True), "distill": d,
                       "collect": manifest, "rows": n_rows, "seed": cfg.seed}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def topk_labels(target, rows, k: int, batch_size: int, pad: int, max_prompt: int, max_completion: int):
    """The target's top-k ids and T=1 log-probs at each completion position (collect's white-box labels),
    for a dataset collected without them."""
    from distill.trainer import completion_hidden, layout

    ids_out, lps_out = [], []
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        prompts = [list(r["prompt_ids"])[-max_prompt:] for r in chunk]
        comps = [list(r["completion_ids"])[:max_completion] for r in chunk]
        batch = {k_: v.to(next(target.parameters()).device) for k_, v in layout(prompts, comps, pad).items()}
        logits = target.lm_head(completion_hidden(target, batch)).float().log_softmax(-1)
        top = logits.topk(k, -1)
        for i, c in enumerate(comps):
            ids_out.append(top.indices[i, :len(c)].int().tolist())
            lps_out.append(top.values[i, :len(c)].half().float().tolist())
    return ids_out, lps_out


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
    from accelerate import PartialState

    d = cfg.distill
    check_config(d)
    t_start = time.time()
    state = PartialState()
    main = state.is_main_process
    dataset, manifest = load_collected(cfg.paths.collect)
    sampling = serving_sampling(d, manifest)
    target, tokenizer, target_path = load_role(cfg, "target")
    if state.num_processes > 1 and state.device.type == "cuda":
        target = target.to(state.device)
    target.requires_grad_(False)
    target_ident = {**model_identity(target_path), "name": cfg.model.target.get("name")}
    draft, draft_tokenizer, draft_info = build_draft(cfg.model.draft, target, tokenizer, cfg.paths, seed=cfg.seed)
    check_compatible(tokenizer, draft_tokenizer, target, draft)
    vocab_size = target.config.vocab_size
    max_id = max(max(max(r) for r in dataset["prompt_ids"] if r), max((max(r) for r in dataset["completion_ids"] if r),
                                                                      default=0))
    if max_id >= vocab_size:
        raise PipelineError(f"collected token id {max_id} is outside the target's {vocab_size:,}-token vocabulary: "
                            "the data was collected with another tokenizer; rerun stage=collect for this target")

    # ---- split, vocabulary subset, undistilled export
    train_idx, held_idx = split_by_prompt(dataset["prompt_id"], dataset["domain"], float(d.heldout_fraction),
                                          d.get("heldout_max_prompts_per_domain"), int(cfg.seed))
    if not held_idx:
        raise PipelineError("no domain has two or more collected prompts, so nothing can be held out: "
                            "collect more prompts per domain")
    keep_cols = [c for c in ("prompt_ids", "completion_ids", "topk_ids", "topk_logprobs") if c in dataset.column_names]
    # Nothing here may write into the collected dataset's folder: datasets' map/filter/flatten cache files would
    # land there and make DVC see collect's output as modified. Rows are chosen in Python and materialised once
    # into our own cache (add_column needs that), one file per process.
    train = dataset.select(train_idx).select_columns(keep_cols)
    nonempty = [i for i, (p, c) in enumerate(zip(train["prompt_ids"], train["completion_ids"])) if p and c]
    train = train.select(nonempty)
    held = dataset.select(held_idx)
    stops = stop_token_ids(tokenizer, target)
    k_subset = int(cfg.model.draft.get("vocab_subset") or 0)
    vocab = (vocab_subset(train["completion_ids"], k_subset, vocab_size, stops, train["prompt_ids"])
             if k_subset else None)
    fp = fingerprint(cfg, target_ident, manifest, len(dataset))
    scratch = Path(cfg.paths.cache) / "distill"
    scratch.mkdir(parents=True, exist_ok=True)
    train = train.flatten_indices(cache_file_name=str(scratch / f"train-{fp}-rank{state.process_index}.arrow"))
    log(f"{len(train)} train rows ({sum(map(len, train['completion_ids'])):,} completion tokens), {len(held)} held-out "
        f"rows over {len(set(held['domain']))} domains; draft {draft_info}, "
        f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params; serving T={sampling.temperature}"
        + (f"; FR-Spec head {len(vocab)} tokens" if vocab is not None else ""))

    # ---- held-out target distributions and acceptance before
    gamma = int(d.gamma)
    heldout = None
    before = {}
    if main:
        heldout = cal.build_heldout(target, [held[i] for i in range(len(held))], held["domain"], sampling,
                                    int(d.heldout_support), int(d.eval_batch_size), int(d.max_prompt_length),
                                    int(d.max_completion_length), tokenizer.pad_token_id)
        before = cal.summarize(cal.acceptance(draft, heldout, [sampling.temperature], vocab)[0], heldout, gamma)
        tracker.log_metrics(cal.heldout_metrics(before, gamma, "heldout_before"), step=0)
        log(f"held-out acceptance before: {before[cal.OVERALL]['acceptance']:.3f} "
            f"({heldout.n_positions} positions, p truncation ≤ {float(heldout.p_tail.mean()):.4f})")
        init_spec = {"target": target_ident, "serving_temperature": sampling.temperature,
                     "sampling": vars(sampling), "draft": draft_info,
                     "vocab_subset": vocab.tolist() if vocab is not None else None, "distilled": False,
                     "acceptance": {"before": {k: v["acceptance"] for k, v in before.items()}}}
        save_draft(copy.deepcopy(draft).to(next(target.parameters()).dtype), draft_tokenizer, cfg.paths.draft_init,
                   init_spec, None, target.generation_config)

    # ---- teacher labels
    teacher = d.teacher
    if teacher == "topk" and d.loss != "ce" and float(d.loss_temperature) != 1.0:
        log(f"note: cached top-k labels are T=1 log-probs; at loss_temperature={d.loss_temperature} their tail is an "
            "even-spread estimate (distill/losses.py); distill.teacher=online is exact")
    if teacher == "topk" and d.loss != "ce" and "topk_ids" not in train.column_names:
        t0 = time.time()
        ids, lps = topk_labels(target, train, int(d.topk), int(d.eval_batch_size), tokenizer.pad_token_id,
                               int(d.max_prompt_length), int(d.max_completion_length))
        train = train.add_column("topk_ids", ids).add_column("topk_logprobs", lps)
        log(f"computed top-{d.topk} target labels for {len(train)} rows in {time.time() - t0:.0f}s "
            "(the collected data has none)")
    if d.loss == "ce" or teacher == "online":
        train = train.remove_columns([c for c in ("topk_ids", "topk_logprobs") if c in train.column_names])
    train = train.add_column("length", [min(len(p), int(d.max_prompt_length)) + min(len(c), int(d.max_completion_length))
                                        for p, c in zip(train["prompt_ids"], train["completion_ids"])])

    # ---- train
    keep = d.keep_best and main  # only the main process evaluates and exports
    init_state = {k: v.detach().to("cpu", copy=True) for k, v in draft.state_dict().items()} if keep else None
    history, train_tokens, steps, minutes = train_draft(cfg, d, draft, target, tokenizer, train, vocab, stops,
                                                       heldout, fp, tracker, main, sampling, gamma, state)
    if not main:
        return {}

    # ---- after (or the init, when training made held-out acceptance worse), calibration, cost, γ
    after_alpha = cal.acceptance(draft, heldout, [sampling.temperature], vocab)[0]
    after = cal.summarize(after_alpha, heldout, gamma)
    trained = {k: v["acceptance"] for k, v in after.items()}
    selected = "distilled"
    if init_state is not None and after[cal.OVERALL]["acceptance"] < before[cal.OVERALL]["acceptance"]:
        log(f"held-out acceptance fell in training ({before[cal.OVERALL]['acceptance']:.3f} → "
            f"{after[cal.OVERALL]['acceptance']:.3f}): exporting the initial draft (distill.keep_best=false ships the "
            "trained one)")
        draft.load_state_dict(init_state)
        after, selected = before, "init"
    calib = cal.calibrate_temperature(draft, heldout, list(d.tau_ratios), vocab, int(d.tau_refine))
    gammas = [int(g) for g in d.gammas]
    # timed as served: measure_cost_ratio casts a copy of the draft to the target's dtype
    cost = cal.measure_cost_ratio(target, draft, vocab, int(d.cost.context_length), int(d.cost.steps),
                                  max_verify=max(gammas) if d.cost.verify else 0)
    cost["device"] = str(next(target.parameters()).device)
    best, speedups = {}, {}
    for dom, alpha in calib["alpha"].items():
        mask = cal.domain_index(heldout)[dom]
        per_position = cal.per_position_acceptance(alpha, heldout, mask, max(gammas))
        best[dom], speedups[dom] = cal.best_gamma(per_position, cost["c"], gammas, cost.get("verify_ratio"))

    def per_domain(values: dict) -> dict:
        out = {k: v for k, v in values.items() if k != cal.OVERALL}
        out["default"] = values[cal.OVERALL]
        return out

    spec = {
        "target": target_ident,
        "serving_temperature": sampling.temperature,
        "sampling": vars(sampling),
        "draft_temperature": per_domain(calib["temperature"]),
        "gamma": per_domain(best),
        "vocab_subset": vocab.tolist() if vocab is not None else None,
        "acceptance": {"before": {k: v["acceptance"] for k, v in before.items()},
                       "after": {k: v["acceptance"] for k, v in after.items()},
                       "after_calibrated": calib["acceptance"], "after_training": trained},
        "selected": selected,
        "mean_accepted_length": {"gamma": gamma, "before": {k: v["mean_accepted_length"] for k, v in before.items()},
                                 "after": {k: v["mean_accepted_length"] for k, v in after.items()}},
        "per_position_acceptance": {k: v["per_position_acceptance"] for k, v in after.items()},
        "predicted_speedup": {dom: round(s[best[dom]], 3) for dom, s in speedups.items()},
        "cost": cost,
        "draft": {**draft_info, "parameters": sum(p.numel() for p in draft.parameters())},
        "training": {"loss": d.loss, "teacher": teacher, "lmbda": float(d.lmbda), "steps": steps,
                     "train_tokens": train_tokens, "minutes": round(minutes, 2), "rows": len(train),
                     "fingerprint": fp},
        "learning_curve": [{"step": s, "train_tokens": t, "acceptance": m.get(f"heldout/acceptance/{cal.OVERALL}")}
                           for s, t, m in history],
        "heldout": {"rows": len(heldout.rows), "positions": heldout.n_positions},
    }
    serving_dtype = next(target.parameters()).dtype  # what eval loads the draft as (bf16 on CUDA / bf16 CPUs)
    save_draft(draft.to(serving_dtype), draft_tokenizer, cfg.paths.draft, spec,
               model_card(spec, f"{cfg.model.draft.name} (distilled)"), target.generation_config)
    if not d.keep_checkpoints:
        shutil.rmtree(Path(cfg.paths.artifacts) / "distill_ckpt" / fp, ignore_errors=True)
    print_table(spec, before, after, calib, best)
    metrics = {**cal.heldout_metrics(after, gamma, "heldout_after"), "c": cost["c"], "train_tokens": train_tokens,
               "train_minutes": minutes,
               **{f"draft_temperature/{k}": v for k, v in calib["temperature"].items()},
               **{f"calibrated_acceptance/{k}": v for k, v in calib["acceptance"].items()},
               **{f"best_gamma/{k}": v for k, v in best.items()}}
    tracker.log_metrics(metrics)
    tracker.log_artifact(str(Path(cfg.paths.draft) / "speculative.json"))
    tracker.log_artifact(str(Path(cfg.paths.draft) / "README.md"))
    log(f"exported {cfg.paths.draft} (undistilled: {cfg.paths.draft_init}) in {time.time() - t_start:.0f}s")
    return {"acceptance_before": before[cal.OVERALL]["acceptance"], "acceptance_after": after[cal.OVERALL]["acceptance"],
            "c": cost["c"], "train_tokens": train_tokens, "train_minutes": minutes, "draft": str(cfg.paths.draft)}


def mixed_bf16(d: DictConfig, target) -> bool:
    """bf16 autocast over fp32 master weights: `auto` follows the serving dtype (CUDA, or a CPU with native bf16)."""
    choice = d.get("bf16", "auto")
    return next(target.parameters()).dtype == torch.bfloat16 if choice == "auto" else bool(choice)


def train_draft(cfg, d, draft, target, tokenizer, train, vocab, stops, heldout, fp, tracker, main, sampling, gamma,
                state):
    """Runs DistillTrainer (resuming from the last checkpoint of this configuration); returns
    (learning curve, training tokens, optimizer steps, minutes)."""
    from transformers.trainer_utils import get_last_checkpoint

    from distill.trainer import AcceptanceCallback, DistillConfig, DistillTrainer, TimeBudgetCallback

    out_dir = Path(cfg.paths.artifacts) / "distill_ckpt" / fp
    if not d.resume and out_dir.exists() and main:
        shutil.rmtree(out_dir)
    state.wait_for_everyone()
    last = get_last_checkpoint(str(out_dir)) if out_dir.exists() else None
    if d.freeze_shared:
        trainable = freeze_shared(draft)
    else:
        trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    device = next(target.parameters()).device
    if not d.get("max_steps") and not d.get("max_epochs"):
        raise PipelineError("distill.max_steps and distill.max_epochs are both null: set at least one")
    max_steps = int(d.max_steps) if d.get("max_steps") else -1
    if d.get("max_epochs"):  # small collections: stop after max_epochs passes (held-out acceptance has flattened)
        per_step = int(d.batch_size) * int(d.grad_accum) * state.num_processes
        by_epochs = max(1, math.ceil(float(d.max_epochs) * len(train) / per_step))
        max_steps = by_epochs if max_steps < 0 else min(max_steps, by_epochs)
    args = DistillConfig(
        output_dir=str(out_dir), max_steps=max_steps,
        per_device_train_batch_size=int(d.batch_size), gradient_accumulation_steps=int(d.grad_accum),
        learning_rate=float(d.learning_rate), weight_decay=float(d.weight_decay), warmup_steps=float(d.warmup),
        lr_scheduler_type=d.lr_scheduler, max_grad_norm=float(d.max_grad_norm),
        logging_steps=int(d.logging_steps), save_strategy="steps", save_steps=int(d.save_steps),
        save_total_limit=int(d.save_total_limit), report_to="none", seed=int(cfg.seed), data_seed=int(cfg.seed),
        remove_unused_columns=False, train_sampling_strategy="group_by_length", length_column_name="length",
        bf16=mixed_bf16(d, target), use_cpu=device.type == "cpu", dataloader_num_workers=0,
        ddp_find_unused_parameters=False, disable_tqdm=not main,
        loss=d.loss, beta=float(d.beta), loss_temperature=float(d.loss_temperature), teacher=d.teacher,
        topk_tail=d.topk_tail, lmbda=float(d.lmbda), on_policy_temperature=float(d.on_policy_temperature),
        max_prompt_length=int(d.max_prompt_length), max_completion_length=int(d.max_completion_length),
        max_train_minutes=d.get("max_train_minutes"))

    def evaluate(model):
        alpha = cal.acceptance(model, heldout, [sampling.temperature], vocab)[0]
        return cal.heldout_metrics(cal.summarize(alpha, heldout, gamma), gamma)

    acceptance_cb = AcceptanceCallback(evaluate, tracker, int(d.eval_steps), is_main=main, printer=log)
    original_head = use_subset_head(draft, vocab)
    draft.train()
    needs_target = d.teacher == "online" or float(d.lmbda) > 0
    trainer = DistillTrainer(draft, args, train, teacher_model=target if needs_target else None, vocab=vocab,
                             stop_ids=stops, processing_class=tokenizer,
                             callbacks=[acceptance_cb, TimeBudgetCallback(d.get("max_train_minutes"))])
    acceptance_cb.trainer = trainer
    log(f"training {trainable / 1e6:.1f}M parameters: loss={d.loss}, teacher={d.teacher}, lmbda={d.lmbda}, "
        f"{'resuming from ' + last if last else 'from scratch'} -> {out_dir}")
    t0, cpu0 = time.time(), time.process_time()
    result = trainer.train(resume_from_checkpoint=last)
    minutes, cpu_minutes = (time.time() - t0) / 60, (time.process_time() - cpu0) / 60
    restore_full_head(draft, original_head)
    draft.eval()
    steps = int(result.global_step)
    resumed_from = int(Path(last).name.split("-")[-1]) if last else 0
    local = torch.tensor(float(trainer.train_tokens), device=trainer.args.device)
    tokens = int(trainer.accelerator.reduce(local, "sum").item()) if state.num_processes > 1 else int(local)
    record = out_dir / "train_tokens.json"
    if resumed_from >= steps and record.exists():  # nothing left to train: the earlier run's count
        tokens = json.loads(record.read_text())["train_tokens"]
    elif resumed_from:  # a resumed run counted only its own batches: scale to the whole run by steps
        tokens = int(tokens * steps / (steps - resumed_from))
    if main:
        write_json(record, {"steps": steps, "train_tokens": tokens})
    tracker.log_metrics({"train_steps": steps, "train_tokens": tokens, "on_policy_batches": trainer.on_policy_batches})
    if main:
        log(f"trained {steps} steps, {tokens:,} completion tokens, {minutes:.1f} min "
            f"({tokens / max(minutes, 1e-9) / 60:.0f} tokens/s; {cpu_minutes:.1f} CPU-minutes)")
    return acceptance_cb.history, tokens, steps, minutes


def print_table(spec, before, after, calib, best) -> None:
    rows = [d for d in after if d != cal.OVERALL] + [cal.OVERALL]
    print(f"\n{'domain':<16}{'acc before':>11}{'acc after':>11}{'calibrated':>11}{'len@γ4 bef':>11}"
          f"{'len@γ4 aft':>11}{'τ':>7}{'γ':>4}")
    for dom in rows:
        print(f"{dom:<16}{before[dom]['acceptance']:>11.3f}{after[dom]['acceptance']:>11.3f}"
              f"{calib['acceptance'][dom]:>11.3f}{before[dom]['mean_accepted_length']:>11.2f}"
              f"{after[dom]['mean_accepted_length']:>11.2f}{calib['temperature'][dom]:>7.2f}{best[dom]:>4}")
    print(f"c = {spec['cost']['c']:.3f} (draft {spec['cost']['draft_forward_ms']:.1f} ms, "
          f"target {spec['cost']['target_forward_ms']:.1f} ms)\n")
