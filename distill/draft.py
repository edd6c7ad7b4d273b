"""The FR-Spec vocabulary subset (Zhao et al. 2025) and the parameters a draft trains (its construction:
pipeline/modelio/draft_init.py). The subset is the K target tokens most frequent in the collected completions, stop tokens
included. The exported weights keep the full vocabulary with the subset baked in (pipeline/heads.py); the id list
travels in speculative.json.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from pipeline.errors import PipelineError


def freeze_shared(draft) -> int:
    """Freeze the input embeddings and the output head (shared with the target for a derived draft);
    returns the number of parameters left to train."""
    for module in (draft.get_input_embeddings(), draft.get_output_embeddings()):
        for p in module.parameters():
            p.requires_grad_(False)
    return sum(p.numel() for p in draft.parameters() if p.requires_grad)


def vocab_subset(completions: Iterable[list[int]], k: int, vocab_size: int, always: Iterable[int] = (),
                 prompts: Iterable[list[int]] = ()) -> torch.Tensor:
    """FR-Spec: `always` (stop tokens), then the ids most frequent in the target's `completions`, then those
    most frequent in the `prompts` (same-domain text the target has not written), then the lowest unused ids
    (BPE vocabularies assign ids in merge order, so low ids are the tokenizer corpus's most common pieces);
    the first k, sorted.
    """
    if not 0 < k <= vocab_size:
        raise PipelineError(f"model.draft.vocab_subset={k} is outside [1, {vocab_size}]: use 0 (off) or a "
                            "value such as 4096")
    chosen = dict.fromkeys(int(i) for i in always)
    for source in (completions, prompts):
        for token, _ in Counter(int(t) for ids in source for t in ids).most_common():
            if len(chosen) >= k:
                break
            chosen.setdefault(token)
    token = 0
    while len(chosen) < k:
        chosen.setdefault(token)
        token += 1
    return torch.tensor(sorted(list(chosen)[:max(k, len(set(always)))]), dtype=torch.long)
