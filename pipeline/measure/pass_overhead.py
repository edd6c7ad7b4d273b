"""What a decoding pass costs beyond its forwards: the decoder's own host work per pass, timed through the decoder
itself (cost_profile.json's `host`, docs/architecture.md "Cost profile"), which a forwards-only model leaves out.

Plain decoding, chains of two lengths and token trees of two sizes decode the same random prompt, interleaved over
rounds; per pass the host seconds are the call's time less its forwards (`DecodeStats`), in the plain run's median
1-token target steps. pipeline/decoding/cost.py `host_cost` interpolates between the points measured here.
"""
from __future__ import annotations

import statistics

import torch

from pipeline.decoding.generate import autoregressive_generate, speculative_generate
from pipeline.decoding.plan import DraftPlan
from pipeline.decoding.tree import nodes
from pipeline.sampling import Sampling

NEW_TOKENS = 32  # per timed decode: enough passes per call that the call's fixed costs spread thin
WARMUP_TOKENS = 8  # per warm-up decode: every code path once (a slow machine spent a quarter minute warming up)
CHAINS = (1, 4)  # drafted tokens per chain pass measured (the cost model interpolates between them)
TREES = ((3,), (3, 1))  # 3 and 6 verified nodes


def _host_steps(stats) -> tuple[float, float]:
    """(host seconds per pass, median 1-token target forward seconds) of one decode's stats."""
    forwards = sum(stats.draft_times) + sum(stats.target_times) + stats.prefill_time
    host = max(stats.total_time - forwards, 0.0) / max(stats.target_passes, 1)
    return host, (statistics.median(stats.target_times) if stats.target_times else float("nan"))


@torch.inference_mode()
def measure_host_overhead(target, draft, vocab: torch.Tensor | None, sampling: Sampling, plan) -> dict:
    """profile["host"] (module docstring) for `target`/`draft` decoding `sampling` after a random prompt of the
    shortest context length of `plan` (pipeline/measure/cost_profile.py's CostPlan, which imports this module), `plan.repeats`
    rounds after `plan.warmup`, the draft's head restricted to `vocab` as served."""
    context, repeats, warmup, seed = min(int(n) for n in plan.contexts), int(plan.repeats), int(plan.warmup), int(plan.seed)
    device = next(target.parameters()).device
    g = torch.Generator().manual_seed(seed)
    n_vocab = min(target.config.vocab_size, draft.config.vocab_size)
    prompt = torch.randint(0, n_vocab, (1, context), generator=g).to(device)
    shapes = [None, *CHAINS, *TREES]
    host: dict = {shape: [] for shape in shapes}
    steps: list[float] = []
    for r in range(warmup + repeats):
        tokens = NEW_TOKENS if r >= warmup else WARMUP_TOKENS
        for shape in shapes:
            generator = torch.Generator(device=device).manual_seed(seed + r)
            if shape is None:
                out = autoregressive_generate(target, prompt, sampling=sampling, max_new_tokens=tokens,
                                              generator=generator)
            else:
                out = speculative_generate(target, draft, prompt, sampling=sampling,
                                           plan=DraftPlan(shape, draft_vocab=vocab), max_new_tokens=tokens,
                                           generator=generator)
            if r >= warmup:
                seconds, step = _host_steps(out.stats)
                host[shape].append(seconds)
                if shape is None:
                    steps.append(step)
    step = statistics.median(steps)
    per_step = {shape: round(statistics.median(seconds) / step, 4) for shape, seconds in host.items()}
    return {"sampling": sampling.to_dict(), "context": context, "new_tokens": NEW_TOKENS, "repeats": repeats,
            "step_ms": round(1e3 * step, 3), "plain": per_step[None],
            "chain": {str(g): per_step[g] for g in CHAINS},
            "tree": {str(nodes(t)): per_step[t] for t in TREES}}
