"""The pass costs of batched decoding at several batch sizes B, timed through the batched decoder itself: what
decides where speculation stops paying (docs/architecture.md, "Where batched speculation stops paying", says how
the host work is measured). `batch_cost` turns it into the cost summary the one cost model prices.

Schema (VERSION 1): `version`; `machine`; `context`; `repeats`; `target` {B: {k: ms}}; `draft` {B: ms}; `host` {B:
{plain: steps, chain: {γ: steps}}} and `host_settings` {sampling, new_tokens [SHORT, LONG], rounds}; a profile
without `host` prices it at 0. Keys are strings (JSON).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.measure.cost_profile import machine
from pipeline.decoding.batch import RaggedCache, autoregressive_generate_batch, speculative_generate_batch
from pipeline.decoding.cost import verify_cost
from pipeline.decoding.generate import GREEDY
from pipeline.decoding.loop import crop
from pipeline.decoding.plan import DraftPlan
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling

VERSION = 1
CONTEXT = 96  # cached tokens per row before the timed forward: a chat prompt and some answer
CHAINS = (1, 4)  # γ whose host work is timed, as pipeline/measure/pass_overhead.py: the cost model interpolates between
SHORT, LONG = 8, 40  # new tokens of the two timed calls: SHORT is past pass 2 (the draft's first read of the prompt)
HOST_ROUNDS = 3  # timed rounds of host calls after one warm-up, as pipeline/measure/pass_overhead.py


@torch.inference_mode()
def forward_times(model, batch: int, tokens_fed, clock, repeats: int = 9, vocab=None, context: int = CONTEXT) -> dict:
    """{k: median ms of one forward of k new tokens per row after `context` cached ones} at this batch size. Every
    round times each k once, in rotating order, so load that comes and goes moves every k alike."""
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


@dataclass(frozen=True)
class BatchPlan:
    """How a batch profile is timed: at each of `batch_sizes`, the target forwards of each count in `tokens_fed` (1
    and the host chains' γ + 1 are added) after `context` cached tokens, `repeats` rounds; the host work at `sampling`
    (the serving distribution) over `host_rounds` rounds."""
    batch_sizes: tuple[int, ...]
    tokens_fed: tuple[int, ...]
    repeats: int = 9
    context: int = CONTEXT
    sampling: Sampling = GREEDY
    host_rounds: int = HOST_ROUNDS


def measure_batch_profile(target, draft, plan: BatchPlan, clock, vocab=None) -> dict:
    """The profile (module docstring) of these models on their device, timed as `plan` says."""
    fed = sorted({1, *(int(k) for k in plan.tokens_fed), *(g + 1 for g in CHAINS)})
    profile = {"version": VERSION, "machine": machine(next(target.parameters()).device, target.dtype),
               "context": plan.context, "repeats": plan.repeats, "target": {}, "draft": {}, "host": {},
               "host_settings": {"sampling": plan.sampling.to_dict(), "new_tokens": [SHORT, LONG],
                                 "rounds": plan.host_rounds}}
    for size in sorted(int(b) for b in plan.batch_sizes):
        times = forward_times(target, size, fed, clock, plan.repeats, None, plan.context)
        profile["target"][str(size)] = {str(k): round(ms, 4) for k, ms in times.items()}
        profile["draft"][str(size)] = round(forward_times(draft, size, [1], clock, plan.repeats, vocab,
                                                          plan.context)[1], 4)
        seconds = host_times(target, draft, size, clock, vocab, plan)
        profile["host"][str(size)] = host_block(seconds, batch_cost(profile, size))
    return profile


def host_times(target, draft, batch: int, clock, vocab, plan: BatchPlan) -> dict:
    """{shape: [(seconds, per-pass drafted list) of the SHORT and the LONG call] per timed round}, shape None =
    plain decoding, else a chain's γ. Every round decodes every shape at both lengths from one seed, so the SHORT
    call is the LONG one's beginning and load that comes and goes moves every shape alike."""
    sampling, context, rounds = plan.sampling, plan.context, plan.host_rounds
    device = next(target.parameters()).device
    g = torch.Generator().manual_seed(0)
    n_vocab = min(target.config.vocab_size, draft.config.vocab_size)
    prompts = list(torch.randint(0, n_vocab, (batch, context), generator=g).to(device))
    shapes, out = [None, *CHAINS], {}
    for round_ in range(rounds + 1):  # round 0 is a warm-up
        for shape in shapes:
            calls = []
            for new_tokens in (SHORT, LONG):
                generator = torch.Generator(device=device).manual_seed(round_)
                start = clock()
                result = (autoregressive_generate_batch(target, prompts, sampling=sampling, max_new_tokens=new_tokens,
                                                        generator=generator) if shape is None else
                          speculative_generate_batch(target, draft, prompts, sampling=sampling,
                                                     plan=DraftPlan(shape, draft_vocab=vocab), max_new_tokens=new_tokens,
                                                     generator=generator))
                seconds = clock() - start
                calls.append((seconds, max((s.drafted for s in result.stats), key=len)))  # the longest row: every pass
            if round_:
                out.setdefault(shape, []).append(calls)
    return out


def forwards_ms(drafted: list[int], cost: dict) -> float:
    """What the passes' forwards cost at this B by the profile: γ draft steps and a target forward of γ + 1 tokens
    per pass (plain: the 1-token step). Rows that finished early are priced as if still there: both calls end with
    such a tail, so their difference mostly cancels it."""
    step = cost["target_step_ms"]
    return sum(d * cost["c"] * step + verify_cost(cost["verify_ratio"], d) * step for d in drafted)


def host_block(times: dict, cost: dict) -> dict:
    """{plain, chain {γ}}: the median over rounds of the host steps per pass (module docstring) of each shape."""
    def steps(calls) -> float:
        (short_s, short_d), (long_s, long_d) = calls
        extra = 1e3 * (long_s - short_s) - (forwards_ms(long_d, cost) - forwards_ms(short_d, cost))
        return max(extra / max(len(long_d) - len(short_d), 1), 0.0) / cost["target_step_ms"]

    per_shape = {shape: round(float(np.median([steps(calls) for calls in rounds])), 4)
                 for shape, rounds in times.items()}
    return {"plain": per_shape[None], "chain": {str(g): per_shape[g] for g in CHAINS}}


def batch_sizes_of(profile: dict) -> list[int]:
    return sorted(int(b) for b in profile["target"])


def batch_cost(profile: dict, batch: int) -> dict:
    """The cost summary {c, target_step_ms, verify_ratio {N: r}, host} at a measured batch size, for pass_speedup:
    c = draft step / target step, r(N) = the target's forward of N + 1 tokens / its step and the loop's host work
    per pass in steps, all at that B (no `host` key where the profile has none: priced at 0)."""
    rows = profile["target"].get(str(batch))
    if rows is None or str(batch) not in profile["draft"]:
        raise PipelineError(f"the batch cost profile has no batch size {batch} (it has {batch_sizes_of(profile)}): "
                            "measure one with those batch sizes")
    step = float(rows["1"])
    cost = {"c": float(profile["draft"][str(batch)]) / step, "target_step_ms": step,
            "verify_ratio": {int(k) - 1: float(ms) / step for k, ms in rows.items() if int(k) > 1}}
    host = (profile.get("host") or {}).get(str(batch))
    return cost if host is None else {**cost, "host": host}


def forwards_only(cost: dict) -> dict:
    """A cost summary without its host work: what the forwards-only model (before host work was timed) priced."""
    return {k: v for k, v in cost.items() if k != "host"}


def validate(profile, where: str) -> None:
    """One line naming the fix when `profile` is not a batch cost profile of this version."""
    if not isinstance(profile, dict) or profile.get("version") != VERSION:
        raise PipelineError(f"{where} is not a batch cost profile of version {VERSION}: measure it again")
    for size in batch_sizes_of(profile):
        if "1" not in profile["target"][str(size)] or str(size) not in profile["draft"]:
            raise PipelineError(f"{where}: batch size {size} lacks the target's 1-token step or the draft's step: "
                                "measure it again")
        host = profile["host"].get(str(size), {}) if "host" in profile else {"plain": 0.0, "chain": {}}
        if "plain" not in host or "chain" not in host:  # a profile from before host work was timed has no `host`
            raise PipelineError(f"{where}: batch size {size} lacks its host block (plain, chain): measure it again")


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
