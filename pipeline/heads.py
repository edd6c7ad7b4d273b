"""Output heads restricted to a vocabulary subset (FR-Spec, Zhao et al. 2025).

A draft with a subset head predicts only the K target ids in `vocab` (a sorted 1-D LongTensor); its exported
weights keep the full vocabulary, so the id list travels in speculative.json and every user of the head
(training, the acceptance simulator, the cost timing, the decoder) slices the same rows through this module.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


def head_rows(model, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the model's output head, restricted to the rows in `vocab` (None: all rows)."""
    head = model.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    if isinstance(head, SubsetHead):  # already sliced: its parameters are the full head's
        vocab = head.vocab if vocab is None else vocab
    if vocab is None:
        return weight, bias
    vocab = vocab.to(weight.device)
    return weight[vocab], None if bias is None else bias[vocab]


def head_logits(hidden: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """fp32 logits of `hidden` [..., H] under head `rows` from `head_rows`."""
    return F.linear(hidden, *rows).float()


def column_map(vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """target id -> column in the subset head (−1 outside); None for a full-vocabulary head."""
    if vocab is None:
        return None
    col = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab.device)
    col[vocab] = torch.arange(len(vocab), device=vocab.device)
    return col


def scatter_to_vocab(q: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Probabilities over the subset's columns [..., K] -> over the full vocabulary [..., V] (0 outside)."""
    if vocab is None:
        return q
    return q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(-1, vocab.to(q.device), q)


class SubsetHead(nn.Module):
    """An output head restricted to the rows in `vocab`, sharing the full head's weight Parameter: the draft computes
    exactly the decoder's logits in training, and checkpoints stay ordinary full-vocabulary models."""

    def __init__(self, head: nn.Linear, vocab: torch.Tensor):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.register_buffer("vocab", vocab.to(head.weight.device), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.vocab]
        return F.linear(hidden, self.weight[self.vocab], bias)


def use_subset_head(model, vocab: torch.Tensor | None):
    """Restrict the model's head to `vocab` in place (None: no-op). Returns the original head."""
    head = model.get_output_embeddings()
    if vocab is not None and not isinstance(head, SubsetHead):
        model.set_output_embeddings(SubsetHead(head, vocab))
    return head


def restore_full_head(model, head: nn.Module) -> None:
    if isinstance(model.get_output_embeddings(), SubsetHead):
        model.set_output_embeddings(head)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def bake_subset(model, vocab: torch.Tensor | None, fill: torch.Tensor | None = None):
    """The model with the FR-Spec subset written into its weights, for engines that run the full head (HF
    assisted generation, vLLM, llama.cpp): an untied output head whose rows in `vocab` are the trained ones
    and whose other rows are `fill` [H] (default zero), so an out-of-subset token scores fill·h instead of the
    target's own row, which the draft was never trained to keep below the subset's. The input embeddings
    keep every row (prompts use the whole vocabulary). Returns the model (changed in place); None: unchanged.
    """
    if vocab is None:
        return model
    head = model.get_output_embeddings()
    weight = head.weight.detach().clone()
    outside = torch.ones(weight.shape[0], dtype=torch.bool, device=weight.device)
    outside[vocab.to(weight.device)] = False
    weight[outside] = 0 if fill is None else fill.to(weight)
    model.config.tie_word_embeddings = False
    model.config.get_text_config().tie_word_embeddings = False
    head.weight = nn.Parameter(weight, requires_grad=head.weight.requires_grad)
    return model


@contextmanager
def head_inputs(model, out: list, last_only: bool = False):
    """Appends to `out`, per forward of `model`, its output head's input [B, L, H] (`last_only`: at the last position,
    [B, H]: generate keeps one position per step, so step t's entry is the state that produced generated token t);
    yields `out`."""
    def keep(_module, args):
        out.append(args[0][:, -1] if last_only else args[0])

    handle = model.get_output_embeddings().register_forward_pre_hook(keep)
    try:
        yield out
    finally:
        handle.remove()
