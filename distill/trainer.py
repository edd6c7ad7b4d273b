"""Distillation on TRL's GKD trainer: `DistillConfig` (GKDConfig + our knobs) and `DistillTrainer` (GKDTrainer).

TRL serves the on-policy share λ (GKDTrainer.training_step / generate_on_policy_outputs), sequence-level KD
(seq_kd), dense JSD(β) (generalized_jsd_loss, through distill/losses.py), the sampling temperature and, through
Trainer and accelerate, checkpointing, accumulation, mixed precision and `accelerate launch`. Ours, where TRL cannot:
- compute_loss: the target runs only when the loss needs it (teacher=online, and batches TRL generated, whose cached
  labels no longer apply), so teacher=topk with λ=0 never runs it per step; it takes the cached top-k teacher
  (distill/losses.py SparseTeacher, with the subset mass `subset_logmass`);
- the FR-Spec subset head (pipeline/heads.py SubsetHead): for TRL's generation the draft gets its full head back with
  every token outside the subset suppressed (`generation_config.suppress_tokens`), so it samples its subset's ids;
- the aligned batch layout for off-policy batches (distill/aligned.py), beside TRL's causal layout for generated ones;
- the held-out acceptance callback and the time budget.
The λ draw is TRL's `random.random()`, seeded by Trainer on every process and checkpointed with it, so every process
makes the same draws, across a resume too.
"""
from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch import nn


from distill.aligned import Truncation, layout
from distill.losses import check_loss, distillation_loss, sparse_teacher
from distill.settings import ObjectiveSettings
from pipeline.heads import SubsetHead, column_map, head_inputs, head_logits, head_rows

with warnings.catch_warnings():  # the experimental-API warning: the TRL version is pinned in pyproject.toml
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDConfig, GKDTrainer

ALIGNED_ONLY = ("position_ids", "prompt_length", "topk_ids", "topk_logprobs", "subset_logmass", "target_hidden",
                "hidden_mask")
CAUSAL = "causal"  # inputs["layout"] of a batch TRL generated


# ---------------------------------------------------------------- batching
@dataclass
class DistillCollator:
    """Rows {prompt_ids, completion_ids[, topk_ids, topk_logprobs[, subset_logmass]]} -> aligned tensors.

    Returns the layout of distill/aligned.py, the left-padded prompts TRL generates from (`prompts`,
    `prompt_attention_mask` [B, P]: the first P columns of the layout) and, when every row has them,
    topk_ids [B, Lc, k], topk_logprobs [B, Lc, k] and subset_logmass [B, Lc].
    """
    pad_token_id: int
    truncation: Truncation

    def __call__(self, rows: list[dict]) -> dict:
        prompts, completions = zip(*(self.truncation(r) for r in rows))
        batch = layout(list(prompts), list(completions), self.pad_token_id)
        p_len = int(batch["prompt_length"])
        batch["prompts"] = batch["input_ids"][:, :p_len].clone()
        batch["prompt_attention_mask"] = batch["attention_mask"][:, :p_len].clone()
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
        if all(r.get("final_hidden") is not None for r in rows):
            batch["target_hidden"], batch["hidden_mask"] = target_hidden(rows, prompts, completions)
        return batch


def target_hidden(rows: list[dict], prompts: list, completions: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' stored final hidden states [B, Lc, H] at the completion positions, and where they hold [B, Lc]:
    not on padding, nor on a row whose prompt the truncation cut (collect's states saw the whole prompt)."""
    lc = max(map(len, completions))
    width = len(rows[0]["final_hidden"][0])
    states, mask = torch.zeros(len(rows), lc, width), torch.zeros(len(rows), lc, dtype=torch.bool)
    for i, r in enumerate(rows):
        if len(prompts[i]) < len(r["prompt_ids"]):
            continue
        n = len(completions[i])
        states[i, :n] = torch.as_tensor(np.asarray(r["final_hidden"][:n], dtype=np.float32))
        mask[i, :n] = True
    return states, mask


# ---------------------------------------------------------------- config
def _knob(help_text: str):
    # No default value here: distill/settings.py (`ObjectiveSettings`) is the one place that sets it.
    return field(default=None, metadata={"help": help_text})


@dataclass
class DistillConfig(GKDConfig):
    """GKDConfig plus our knobs, named as in distill/settings.py `ObjectiveSettings`. lmbda, beta, temperature and
    seq_kd and max_new_tokens are GKDConfig's own (their TRL defaults replaced by `_knob`: conf sets them)."""
    loss: str = _knob("fkl | rkl | jsd | tvd | lk_alpha | lk_lambda | ce | top1 (distill/losses.py)")
    beta: float = _knob("GKDConfig.beta: JSD interpolation β (GKD eq. 1)")
    loss_temperature: float = _knob("softmax temperature inside the loss")
    teacher: str = _knob("online (target forward) | topk (cached labels)")
    topk: int = _knob("k of the cached labels when the stage computes them")
    topk_tail: str = _knob("bucket | renormalize (see distill/losses.py)")
    lmbda: float = _knob("GKDConfig.lmbda: share of batches the draft continues itself (on-policy)")
    temperature: float = _knob("GKDConfig.temperature: sampling temperature of on-policy and seq-KD generation")
    seq_kd: bool = _knob("GKDConfig.seq_kd: off-policy batches are continuations the target generates")
    hidden_weight: float = _knob("weight of the final hidden state's recovery loss against the target's")
    freeze_shared: bool = _knob("freeze the embeddings and the head")
    max_prompt_length: int = _knob("prompt tokens kept (the last ones)")
    max_completion_length: int = _knob("completion tokens trained on")
    max_new_tokens: int = _knob("GKDConfig.max_new_tokens: on-policy / seq-KD length; None = max_completion_length")
    # TrainingArguments' defaults where TRL's differ (distill.trainer sets bf16; a few-layer draft has no
    # activation memory worth recomputing).
    bf16: bool = field(default=False, metadata={"help": "bf16 autocast"})
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "alias of activation_checkpointing"})

    def __post_init__(self):
        # max_new_tokens None is a setting (as long as the completions)
        unset = [name for name in OBJECTIVE if name != "max_new_tokens" and getattr(self, name) is None]
        if unset:
            raise ValueError(f"DistillConfig needs {unset}: build it from distill.objective (distill/settings.py)")
        # nothing generated beyond the completion tokens the loss trains on
        self.max_new_tokens = min(int(self.max_new_tokens or self.max_completion_length), int(self.max_completion_length))
        super().__post_init__()


OBJECTIVE = tuple(f.name for f in fields(ObjectiveSettings))  # conf's `objective:` keys, DistillConfig's knobs


# ---------------------------------------------------------------- loss positions of either layout
@dataclass
class Positions:
    """Where a batch's loss positions are: the forward's inputs, how many final positions' logits to keep, and the
    labels [B, n] those positions predict (−100 = none). `trim`: the last kept position predicts past the end."""
    forward: dict
    keep: int
    trim: bool
    labels: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        return self.labels != -100

    def at(self, states: torch.Tensor) -> torch.Tensor:
        """States [B, L, ...] (L ≥ keep) at the loss positions: [B, n, ...]."""
        states = states[:, -self.keep:]
        return states[:, :-1] if self.trim else states


def positions(inputs: dict) -> Positions:
    """Our aligned layout (distill/aligned.py), or TRL's causal one after generation: tokens [prompt | completion],
    labels −100 on the first P = prompts width columns, position t predicting token t + 1."""
    if inputs.get("layout") != CAUSAL:
        forward = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids")}
        return Positions(forward, inputs["labels"].shape[1], False, inputs["labels"])
    attention = inputs["attention_mask"]
    p_len = inputs["prompts"].shape[1]
    forward = {"input_ids": inputs["input_ids"], "attention_mask": attention,
               "position_ids": (attention.cumsum(1) - 1).clamp_min(0)}  # prompts are left-padded
    return Positions(forward, inputs["input_ids"].shape[1] - p_len + 1, True, inputs["labels"][:, p_len:])


@contextmanager
def full_head(model):
    """The model's full-vocabulary head (sharing the SubsetHead's parameters) for the duration; yields whether it
    swapped one in."""
    head = model.get_output_embeddings()
    if not isinstance(head, SubsetHead):
        yield False
        return
    full = nn.Linear(head.weight.shape[1], head.weight.shape[0], bias=head.bias is not None, device="meta")
    full.weight = head.weight
    if head.bias is not None:
        full.bias = head.bias
    model.set_output_embeddings(full)
    try:
        yield True
    finally:
        model.set_output_embeddings(head)


def restore_forward(module, forward) -> None:
    """Undo an instance-level `forward` patch (TRL's fused LM head, accelerate's autocast of the teacher)."""
    if forward is None:
        vars(module).pop("forward", None)
    else:
        module.forward = forward


# ---------------------------------------------------------------- trainer
class DistillTrainer(GKDTrainer):
    """GKDTrainer whose loss is one of distill/losses.py between the target (teacher) and the draft.

    `teacher_model`: the target (always; it runs only when the loss needs it). `vocab`: FR-Spec subset of target
    ids (the draft's head is already a `SubsetHead` over it), or None. `stop_ids`: generation stops after these.
    The loss is a per-micro-batch token mean; Trainer divides it by the accumulation steps.
    """
    loss_is_scaled_for_ga = False

    def __init__(self, model, args: DistillConfig, train_dataset, teacher_model, vocab=None,
                 stop_ids: list[int] | None = None, processing_class=None, callbacks=None):
        check_loss(args.loss, args.beta, args.topk_tail, args.teacher)
        collator = DistillCollator(processing_class.pad_token_id,
                                   Truncation(args.max_prompt_length, args.max_completion_length))
        patched = [(m, vars(m).get("forward")) for m in (model, teacher_model)]
        super().__init__(model=model, teacher_model=teacher_model, args=args, data_collator=collator,
                         train_dataset=train_dataset, processing_class=processing_class, callbacks=callbacks)
        for module, forward in patched:  # our compute_loss uses neither patch; the stage gets its models back as given
            restore_forward(module, forward)
        self.teacher_model.eval().requires_grad_(False)
        self.vocab_size = model.config.vocab_size
        self.vocab = None if vocab is None else vocab.to(args.device)
        self.column_of = column_map(self.vocab, self.vocab_size)
        self.outside_vocab = None if vocab is None else (self.column_of < 0).nonzero().flatten().tolist()
        if stop_ids:
            self.generation_config.eos_token_id = list(stop_ids)
        self.on_policy_batches = 0
        self.train_tokens = 0

    def create_model_card(self, *args, **kwargs):
        """None in checkpoints: the export writes the draft's model card (distill/export.py)."""

    # ---- generation (TRL's training_step calls this for on-policy and seq-KD batches)
    def generate_on_policy_outputs(self, model, inputs, generation_config):
        """TRL's generate_on_policy_outputs, with a subset draft's full head back and the tokens outside its subset
        suppressed; marks `inputs` as TRL's causal layout (training_step then swaps in the generated tensors)."""
        config = generation_config
        if model is not self.teacher_model:
            self.on_policy_batches += 1
        with full_head(model) as swapped:
            if swapped:
                config = copy.deepcopy(generation_config)
                config.suppress_tokens = self.outside_vocab
            result = super().generate_on_policy_outputs(model, inputs, config)
        for key in ALIGNED_ONLY:
            inputs.pop(key, None)
        inputs["layout"] = CAUSAL
        return result

    # ---- the loss
    @torch.no_grad()
    def teacher_logits(self, where: Positions) -> torch.Tensor:
        """Target logits [N, C] over the draft's classes at the loss positions."""
        # Over the subset's rows only: the teacher renormalised over what the draft can propose (losses.py).
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        hidden = where.at(teacher.model(**where.forward, use_cache=False).last_hidden_state)[where.mask]
        return head_logits(hidden, head_rows(teacher, self.vocab))

    def teacher_signal(self, inputs: dict, where: Positions) -> dict:
        """distillation_loss's teacher keyword: labels (ce), online target logits, or the cached top-k teacher."""
        args, mask = self.args, where.mask
        if args.loss == "ce":
            cols = where.labels[mask] if self.column_of is None else self.column_of[where.labels[mask]]
            return {"labels": torch.where(cols >= 0, cols, -100)}
        if args.teacher == "online" or inputs.get("layout") == CAUSAL:
            return {"teacher_logits": self.teacher_logits(where)}
        if "topk_ids" not in inputs:
            raise RuntimeError("teacher=topk but the batch has no topk_ids (the stage fills them in)")
        subset_logmass = inputs["subset_logmass"][mask] if "subset_logmass" in inputs else None
        return {"teacher": sparse_teacher(inputs["topk_ids"][mask], inputs["topk_logprobs"][mask], self.vocab_size,
                                          self.column_of, subset_logmass)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        where, args = positions(inputs), self.args
        teacher = self.teacher_signal(inputs, where)
        recover = float(args.hidden_weight) > 0 and "target_hidden" in inputs
        with head_inputs(self.accelerator.unwrap_model(model), []) if recover else nullcontext() as states:
            out = model(**where.forward, logits_to_keep=where.keep, use_cache=False)
        per_token = distillation_loss(args.loss, where.at(out.logits)[where.mask], temperature=args.loss_temperature,
                                      beta=args.beta, tail=args.topk_tail, **teacher)
        self.train_tokens += int(where.mask.sum())
        loss = per_token.mean() if per_token.numel() else out.logits.sum() * 0.0
        if recover:
            loss = loss + args.hidden_weight * recovery_loss(where.at(states[0]), inputs, where.mask)
        return (loss, out) if return_outputs else loss


def recovery_loss(draft_hidden: torch.Tensor, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
    """Mean relative squared error ‖h_q − h_p‖² / ‖h_p‖² of the draft's final hidden states [B, n, H] against the
    target's (`target_hidden`) over the loss positions where those are known; 0 (with a gradient) where none is."""
    known = mask & inputs["hidden_mask"]
    target = inputs["target_hidden"][known].float()
    if not len(target):
        return draft_hidden.sum() * 0.0
    error = (draft_hidden[known].float() - target).pow(2).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-6)
    return error.mean()
