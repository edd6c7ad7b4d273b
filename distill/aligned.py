"""The aligned batch layout shared by training, teacher labelling and the acceptance simulator.

A batch holds collected rows laid out so that every row's completion starts at the same position:
    [pad … pad | prompt | completion[:-1] | pad … pad]
(prompts left-padded, completions right-padded, explicit position ids), so the hidden states of the last Lc
positions predict the Lc completion tokens of every row and no model computes its head over prompts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """How much of a collected row a model sees: the prompt's last tokens, the completion's first."""
    max_prompt_length: int
    max_completion_length: int

    def __call__(self, row: dict) -> tuple[list[int], list[int]]:
        return (list(row["prompt_ids"])[-self.max_prompt_length:],
                list(row["completion_ids"])[:self.max_completion_length])


def layout(prompts: list[list[int]], completions: list[list[int]], pad: int) -> dict:
    """The aligned batch (module docstring); rows need ≥1 prompt and ≥1 completion token. Returns input_ids /
    attention_mask / position_ids [B, P+Lc-1], labels [B, Lc] (−100 = padding) and prompt_length P."""
    p_len = max(len(p) for p in prompts)
    c_len = max(len(c) for c in completions)
    width = p_len + c_len - 1
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    labels = torch.full((len(prompts), c_len), -100, dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        seq = prompt + completion[:-1]
        start = p_len - len(prompt)
        input_ids[i, start:start + len(seq)] = torch.as_tensor(seq)
        attention[i, start:start + len(seq)] = 1
        labels[i, :len(completion)] = torch.as_tensor(completion)
    position_ids = (attention.cumsum(1) - 1).clamp_min(0)
    return {"input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids,
            "labels": labels, "prompt_length": torch.tensor(p_len)}


def batches(rows: list[dict], batch_size: int, pad: int, device, truncation: Truncation | None = None):
    """(batch on `device`, completion mask [B, Lc]) over `rows` in order (truncated when asked)."""
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts, completions = zip(*(truncation(r) if truncation else (list(r["prompt_ids"]), list(r["completion_ids"]))
                                     for r in chunk))
        batch = {k: v.to(device) for k, v in layout(list(prompts), list(completions), pad).items()}
        yield batch, batch["labels"] != -100


def completion_hidden(model, batch: dict) -> torch.Tensor:
    """Final hidden states [B, Lc, H] at the positions that predict the completion tokens."""
    lc = batch["labels"].shape[1]
    out = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"], use_cache=False)
    return out.last_hidden_state[:, -lc:]
