"""Distillation with the HF Trainer: `DistillConfig` (the knobs) + `DistillTrainer` (only `compute_loss`
differs), in the style of TRL's GKDTrainer. Checkpointing, gradient accumulation, mixed precision and
multi-process training (`accelerate launch`) come from Trainer/accelerate. Batches use the aligned layout
of distill/batch.py.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, fields

import torch
from transformers import DynamicCache, Trainer, TrainerCallback, TrainingArguments

from distill.batch import Truncation, completion_hidden, layout
from distill.losses import check_loss, distillation_loss, sparse_teacher
from pipeline.heads import column_map, head_logits, head_rows
from pipeline.sampling import logits_to_probs, sample

LABEL_COLUMNS = ("topk_ids", "topk_logprobs", "subset_logmass")


# ---------------------------------------------------------------- batching
@dataclass
class DistillCollator:
    """Rows {prompt_ids, completion_ids[, topk_ids, topk_logprobs[, subset_logmass]]} -> aligned tensors.

    Returns the layout of distill/batch.py and, when every row has them, topk_ids [B, Lc, k],
    topk_logprobs [B, Lc, k] and subset_logmass [B, Lc].
    """
    pad_token_id: int
    truncation: Truncation

    def __call__(self, rows: list[dict]) -> dict:
        prompts, completions = zip(*(self.truncation(r) for r in rows))
        batch = layout(list(prompts), list(completions), self.pad_token_id)
        if all(r.get("topk_ids") is not None for r in rows):
            lc = batch["labels"].shape[1]
            k = len(rows[0]["topk_ids"][0])
            ids = torch.zeros(len(rows), lc, k, dtype=torch.long)
            lps = torch.full((len(rows), lc, k), -1e4)
            mass = torch.zeros(len(rows), lc)
            for i, r in enumerate(rows):
                n = len(completions[i])
                ids[i, :n] = torch.as_tensor(r["topk_ids"][:n], dtype=torch.long)
                lps[i, :n] = torch.as_tensor(r["topk_logprobs"][:n], dtype=torch.float32)
                if r.get("subset_logmass") is not None:
                    mass[i, :n] = torch.as_tensor(r["subset_logmass"][:n], dtype=torch.float32)
            batch["topk_ids"], batch["topk_logprobs"] = ids, lps
            if all(r.get("subset_logmass") is not None for r in rows):
                batch["subset_logmass"] = mass
        return batch


# ---------------------------------------------------------------- config and trainer
def _knob(help_text: str):
    # No default value here: conf/distill/default.yaml (`objective:`) is the one place that sets it.
    return field(default=None, metadata={"help": help_text})


@dataclass
class DistillConfig(TrainingArguments):
    """TrainingArguments plus the distillation knobs, named as in conf/distill/default.yaml `objective:`."""
    loss: str = _knob("fkl | rkl | jsd | tvd | ce")
    beta: float = _knob("JSD interpolation β (GKD eq. 1)")
    loss_temperature: float = _knob("softmax temperature inside the loss")
    teacher: str = _knob("online (target forward) | topk (cached labels)")
    topk: int = _knob("k of the cached labels when the stage computes them")
    topk_tail: str = _knob("bucket | renormalize (see distill/losses.py)")
    lmbda: float = _knob("share of batches the draft continues itself (on-policy)")
    on_policy_temperature: float = _knob("draft sampling temperature on-policy")
    freeze_shared: bool = _knob("freeze the embeddings and the head")
    max_prompt_length: int = _knob("prompt tokens kept (the last ones)")
    max_completion_length: int = _knob("completion tokens trained on")

    def __post_init__(self):
        super().__post_init__()
        unset = [f.name for f in fields(DistillConfig) if f.name in OBJECTIVE and getattr(self, f.name) is None]
        if unset:
            raise ValueError(f"DistillConfig needs {unset}: build it from conf/distill/default.yaml `objective:`")


OBJECTIVE = ("loss", "beta", "loss_temperature", "teacher", "topk", "topk_tail", "lmbda", "on_policy_temperature",
             "freeze_shared", "max_prompt_length", "max_completion_length")


class DistillTrainer(Trainer):
    """Trainer whose loss is a divergence between the target (teacher) and the draft on completion tokens.

    `vocab`: FR-Spec subset of target ids (the draft's head is already a `SubsetHead` over it), or None.
    `teacher_model`: the target, needed for teacher=online and for on-policy batches (lmbda > 0).
    The loss is a per-micro-batch token mean; Trainer divides it by the accumulation steps.
    """
    loss_is_scaled_for_ga = False

    def __init__(self, model, args: DistillConfig, train_dataset, teacher_model=None, vocab=None,
                 stop_ids: list[int] | None = None, processing_class=None, callbacks=None):
        check_loss(args.loss, args.beta, args.topk_tail, args.teacher)
        pad = processing_class.pad_token_id if processing_class is not None else 0
        collator = DistillCollator(pad, Truncation(args.max_prompt_length, args.max_completion_length))
        super().__init__(model=model, args=args, train_dataset=train_dataset, data_collator=collator,
                         processing_class=processing_class, callbacks=callbacks)
        self.teacher = teacher_model
        if self.teacher is not None:
            self.teacher.eval().requires_grad_(False)
        self.vocab_size = model.config.vocab_size
        self.vocab = None if vocab is None else vocab.to(args.device)
        self.column_of = column_map(self.vocab, self.vocab_size)
        self.stop_ids = torch.tensor(stop_ids or [], dtype=torch.long, device=args.device)
        self.pad_token_id = pad
        self.policy_rng = random.Random(args.seed)  # the same draws on every process
        self.on_policy_batches = 0
        self.train_tokens = 0

    # ---- teacher signals
    @torch.no_grad()
    def teacher_logits(self, batch: dict, mask: torch.Tensor) -> torch.Tensor:
        """Target logits [N, C] over the draft's classes at the masked completion positions."""
        # Over the subset's rows only: the teacher renormalised over what the draft can propose (losses.py).
        return head_logits(completion_hidden(self.teacher, batch)[mask], head_rows(self.teacher, self.vocab))

    def _columns(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.column_of is None else self.column_of[ids]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        on_policy = args.lmbda > 0 and self.policy_rng.random() < args.lmbda
        if on_policy:
            inputs = self.on_policy_batch(model, inputs)
            self.on_policy_batches += 1
        labels = inputs["labels"]
        mask = labels != -100
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    position_ids=inputs["position_ids"], logits_to_keep=labels.shape[1], use_cache=False)
        draft_logits = out.logits[mask]
        kwargs = dict(temperature=args.loss_temperature, beta=args.beta, tail=args.topk_tail)
        if args.loss == "ce":
            cols = self._columns(labels[mask])
            per_token = distillation_loss("ce", draft_logits, labels=torch.where(cols >= 0, cols, -100))
        elif args.teacher == "online" or on_policy:
            per_token = distillation_loss(args.loss, draft_logits, teacher_logits=self.teacher_logits(inputs, mask),
                                          **kwargs)
        else:
            if "topk_ids" not in inputs:
                raise RuntimeError("teacher=topk but the batch has no topk_ids (the stage fills them in)")
            subset_logmass = inputs["subset_logmass"][mask] if "subset_logmass" in inputs else None
            teacher = sparse_teacher(inputs["topk_ids"][mask], inputs["topk_logprobs"][mask], self.vocab_size,
                                     self.column_of, subset_logmass)
            per_token = distillation_loss(args.loss, draft_logits, teacher=teacher, **kwargs)
        self.train_tokens += int(mask.sum())
        loss = per_token.mean()
        return (loss, out) if return_outputs else loss

    # ---- on-policy (GKD): the draft continues the prompt itself, the target labels its tokens
    @torch.no_grad()
    def on_policy_batch(self, model, inputs: dict) -> dict:
        draft = self.accelerator.unwrap_model(model)
        p_len = int(inputs["prompt_length"])
        prompt_ids, prompt_mask = inputs["input_ids"][:, :p_len], inputs["attention_mask"][:, :p_len]
        was_training = draft.training
        draft.eval()
        tokens, alive = sample_continuations(draft, prompt_ids, prompt_mask, inputs["labels"].shape[1],
                                             self.args.on_policy_temperature, self.vocab, self.stop_ids,
                                             self.pad_token_id)
        draft.train(was_training)
        width = tokens.shape[1]
        input_ids = torch.cat([prompt_ids, tokens[:, :-1]], 1)
        attention = torch.cat([prompt_mask, alive[:, :-1].long()], 1)
        return {"input_ids": input_ids, "attention_mask": attention,
                "position_ids": (attention.cumsum(1) - 1).clamp_min(0),
                "labels": torch.where(alive, tokens, torch.full_like(tokens, -100))[:, :width],
                "prompt_length": inputs["prompt_length"]}


@torch.no_grad()
def sample_continuations(model, prompt_ids, prompt_mask, max_new_tokens: int, temperature: float,
                         vocab=None, stop_ids=None, pad_token_id: int = 0):
    """Batched sampling with a KV cache from left-padded prompts. Returns (tokens [B, n], alive [B, n]):
    alive marks generated tokens up to and including each row's stop token."""
    cache = DynamicCache(config=model.config)
    attention = prompt_mask
    position = (prompt_mask.cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=prompt_ids, attention_mask=attention, position_ids=position, cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    tokens, alive = [], []
    for _ in range(max_new_tokens):
        index = sample(logits_to_probs(logits, temperature))
        token = index if vocab is None else vocab[index]
        alive.append(~done)
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        tokens.append(token)
        if stop_ids is not None and len(stop_ids):
            done = done | torch.isin(token, stop_ids)
        if bool(done.all()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
        position = position[:, -1:] + 1
        logits = model(input_ids=token[:, None], attention_mask=attention, position_ids=position, cache=cache,
                       use_cache=True).logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(alive, 1)


# ---------------------------------------------------------------- callbacks
class AcceptanceCallback(TrainerCallback):
    """Every `eval_steps`, runs `evaluate(model) -> {metric: value}` (the held-out acceptance simulator) on
    the main process and logs the result with the stage's tracker; also forwards the Trainer's own logs."""

    def __init__(self, evaluate, tracker, eval_steps: int, is_main: bool = True, printer=print):
        self.evaluate, self.tracker, self.eval_steps = evaluate, tracker, max(1, int(eval_steps))
        self.is_main, self.printer = is_main, printer
        self.trainer = None  # set by the stage, for the training-token count
        self.history: list[tuple[int, int, dict]] = []  # (step, train tokens, metrics)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.eval_steps == 0 and state.global_step < state.max_steps:
            self._run(state, model, kwargs)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.history or self.history[-1][0] != state.global_step:
            self._run(state, model, kwargs)

    def _run(self, state, model, kwargs):
        if not self.is_main or model is None:
            return
        was_training = model.training
        metrics = self.evaluate(model)
        model.train(was_training)
        trainer_tokens = getattr(self.trainer, "train_tokens", None)
        self.history.append((state.global_step, trainer_tokens, metrics))
        self.tracker.log_metrics(metrics, step=state.global_step)
        overall = metrics.get("heldout/acceptance/overall")
        if overall is not None:
            self.printer(f"step {state.global_step}: held-out acceptance {overall:.3f}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.is_main and logs:
            self.tracker.log_metrics({f"train/{k}": v for k, v in logs.items()}, step=state.global_step)


class TimeBudgetCallback(TrainerCallback):
    """Stops training (with a final checkpoint) once `minutes` of training have passed."""

    def __init__(self, minutes: float | None):
        self.minutes, self.start = minutes, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.minutes:
            return
        stop = torch.tensor(float(time.time() - self.start > 60 * self.minutes), device=args.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast(stop, src=0)  # every process stops at the same step (rank 0's clock)
        if stop.item():
            control.should_training_stop = True
            control.should_save = True
