"""The pass costs of batched decoding at several batch sizes B: what decides where speculation stops paying.

At B = 1 a small target is memory-bound, so a verify of γ + 1 tokens costs about one step; as B grows the target
becomes compute-bound and the verify of B·(γ + 1) tokens costs more and more steps, while a draft step stays cheap.
The profile times, at each B, the target's forward of 1 and of k tokens per row and the draft's 1-token step after
a cached context, through the batched decoder's own forward (pipeline/decoding/batch.py `RaggedCache`: its 4-D
mask and per-row positions, the head on the new positions only, the draft through its FR-Spec rows), so that
`batch_cost` gives the cost summary the one cost model prices (pipeline/decoding/cost.py `pass_speedup`).

Schema (VERSION 1): `version`; `machine` (pipeline/cost_profile.py `machine`); `context` (cached tokens per row);
`repeats`; `target` {B: {k: ms}} (median ms of a forward of k new tokens per row); `draft` {B: ms}. Keys are strings
(JSON).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.cost_profile import machine
from pipeline.decoding.loop import crop
from pipeline.errors import PipelineError

VERSION = 1
CONTEXT = 96  # cached tokens per row before the timed forward: a chat prompt and some answer


@torch.inference_mode()
def forward_times(model, batch: int, tokens_fed, clock, repeats: int = 9, vocab=None, context: int = CONTEXT) -> dict:
    """{k: median ms of one forward of k new tokens per row after `context` cached ones} at this batch size. The
    context is read once and each timed forward cropped away again; every round times each k once, in rotating
    order, so load that comes and goes during the profile moves every k alike rather than a few of them."""
    from pipeline.decoding.batch import RaggedCache

    fed = sorted(set(int(k) for k in tokens_fed))
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, context + max(fed)), device=device)
    fed_mask = torch.ones_like(ids, dtype=torch.bool)
    rows, times = RaggedCache(model, batch, device, vocab), {k: [] for k in fed}
    rows.forward(ids[:, :context], fed_mask[:, :context], 1)
    for round_ in range(repeats + 1):  # round 0 is a warm-up: the kernels of a new shape are chosen there
        for k in fed[round_ % len(fed):] + fed[:round_ % len(fed)]:
            start = clock()
            rows.forward(ids[:, context:context + k], fed_mask[:, context:context + k], k)
            seconds = clock() - start
            crop(rows.cache, context)
            rows.valid = rows.valid[:, :context]
            if round_:
                times[k].append(seconds)
    return {k: 1000 * float(np.median(t)) for k, t in times.items()}


def forward_ms(model, batch: int, tokens: int, clock, repeats: int = 9, vocab=None, context: int = CONTEXT) -> float:
    """Median ms of one forward of `tokens` new tokens per row (forward_times of one k)."""
    return forward_times(model, batch, [tokens], clock, repeats, vocab, context)[int(tokens)]


def measure_batch_profile(target, draft, batch_sizes, tokens_fed, clock, vocab=None, repeats: int = 9,
                          context: int = CONTEXT) -> dict:
    """The profile (module docstring) of these models on their device; tokens_fed: the k timed (1 is added)."""
    fed = sorted({1, *(int(k) for k in tokens_fed)})
    profile = {"version": VERSION, "machine": machine(next(target.parameters()).device, target.dtype),
               "context": context, "repeats": repeats, "target": {}, "draft": {}}
    for size in sorted(int(b) for b in batch_sizes):
        times = forward_times(target, size, fed, clock, repeats, None, context)
        profile["target"][str(size)] = {str(k): round(ms, 4) for k, ms in times.items()}
        profile["draft"][str(size)] = round(forward_ms(draft, size, 1, clock, repeats, vocab, context), 4)
    return profile


def batch_sizes_of(profile: dict) -> list[int]:
    return sorted(int(b) for b in profile["target"])


def batch_cost(profile: dict, batch: int) -> dict:
    """The cost summary {c, verify_ratio {N: r}} at a measured batch size, for pass_speedup: c = draft step /
    target step and r(N) = the target's forward of N + 1 tokens / its step, both at that B."""
    rows = profile["target"].get(str(batch))
    if rows is None or str(batch) not in profile["draft"]:
        raise PipelineError(f"the batch cost profile has no batch size {batch} (it has {batch_sizes_of(profile)}): "
                            "measure one with those batch sizes")
    step = float(rows["1"])
    return {"c": float(profile["draft"][str(batch)]) / step, "target_step_ms": step,
            "verify_ratio": {int(k) - 1: float(ms) / step for k, ms in rows.items() if int(k) > 1}}


def validate(profile, where: str) -> None:
    """One line naming the fix when `profile` is not a batch cost profile of this version."""
    if not isinstance(profile, dict) or profile.get("version") != VERSION:
        raise PipelineError(f"{where} is not a batch cost profile of version {VERSION}: measure it again")
    for size in batch_sizes_of(profile):
        if "1" not in profile["target"][str(size)] or str(size) not in profile["draft"]:
            raise PipelineError(f"{where}: batch size {size} lacks the target's 1-token step or the draft's step: "
                                "measure it again")


def break_even(speedup_by_batch: dict) -> int | None:
    """The smallest batch size from which speculation loses (speedup < 1) at every larger one: where it stops
    paying as B grows (a loss at B = 1 alone, where a CPU's 1-row step can be unusually cheap, is not one);
    None when it still pays at the largest."""
    found = None
    for size in sorted(speedup_by_batch, reverse=True):
        if speedup_by_batch[size] >= 1.0:
            break
        found = size
    return found
