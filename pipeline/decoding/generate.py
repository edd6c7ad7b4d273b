"""The decoder's public entry points: speculative decoding with a chain or a token tree, and plain decoding
through the same loop, forward helper and cache type (the baseline every speedup is measured against); each
as a stream of committed chunks (`*_stream`) and as one output (`*_generate`, the stream collected)."""
from __future__ import annotations

import torch

from pipeline.decoding.chain import chain_step
from pipeline.decoding.draft_length import Policy
from pipeline.decoding.guard import guarded
from pipeline.decoding.loop import DecodeStats, GenerationOutput, Run, check_request, plain_step
from pipeline.decoding.stream import TokenStream
from pipeline.decoding.plan import DraftPlan
from pipeline.decoding.tree import Tree, TreePlan, TreeStats, check_tree, tree_step
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling

GREEDY = Sampling(0.0)


@torch.inference_mode()  # the set-up (heads, caches); the stream's own loop enters it per step
def speculative_stream(target, draft, input_ids, *, plan: DraftPlan = DraftPlan(), sampling: Sampling = GREEDY,
                       max_new_tokens: int = 128, eos_token_id=None,
                       generator: torch.Generator | None = None) -> TokenStream:
    """speculative_generate as a stream (pipeline/decoding/stream.py): the token ids each target pass commits,
    the first one from a plain prefill pass. Same keywords, same tokens for the same seed; bad input raises
    here, before any decoding."""
    check_request(sampling, max_new_tokens)
    check_plan(plan)
    if not plan.speculates:
        return autoregressive_stream(target, input_ids, sampling=sampling, max_new_tokens=max_new_tokens,
                                     eos_token_id=eos_token_id, generator=generator)
    drafting, guard = plan.shape, plan.guard
    stats = TreeStats() if isinstance(drafting, Tree) else DecodeStats()
    run = Run.start(target, draft, input_ids, sampling, plan.draft_temperature, plan.draft_vocab, generator, stats)
    if isinstance(drafting, Tree):
        check_tree(drafting, run.pair)
        plans: dict[int, TreePlan] = {}  # one per depth the max_new_tokens cut asks for

        policy = guarded(Policy(drafting.depth), guard, run.stats, drafting.depths)

        def step(seq, room):
            depth = min(policy.budget(), room) if room else 0
            if depth == 0:  # the prefill pass, no room left, or the guard's plain pass: exactly a plain pass
                run.stats.depths.append(0)
                seq, new_tokens = chain_step(run.pair, seq, run.caches, 0, Policy(0), run.stats, run.profile)
            else:
                if depth not in plans:
                    plans[depth] = TreePlan(drafting.truncated(depth), seq.device)
                seq, new_tokens = tree_step(run.pair, seq, run.caches, plans[depth], run.stats, run.profile)
            policy.update(depth, run.stats.accepted[-1])
            return seq, new_tokens
    else:
        policy = guarded(drafting.make(), guard, run.stats)

        def step(seq, room):
            budget = min(policy.budget(), room) if room else 0
            return chain_step(run.pair, seq, run.caches, budget, policy, run.stats, run.profile)

    return TokenStream(run.chunks(step, max_new_tokens, eos_token_id), stats)


def speculative_generate(target, draft, input_ids, *, plan: DraftPlan = DraftPlan(), sampling: Sampling = GREEDY,
                         max_new_tokens: int = 128, eos_token_id=None,
                         generator: torch.Generator | None = None) -> GenerationOutput:
    """Samples from exactly the target's distribution `sampling`, drafting per target pass as `plan` says (a chain
    whose length a DraftLength policy decides, or a token tree; its τ, vocabulary subset and guard); PLAIN decodes
    plainly. The first target pass is a plain prefill. `generator`, if given, lives on the models' device; the guard's
    decisions land in `stats.guard`. speculative_stream, collected."""
    return speculative_stream(target, draft, input_ids, plan=plan, sampling=sampling, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, generator=generator).collect()


def check_plan(plan) -> None:
    if not isinstance(plan, DraftPlan):
        raise PipelineError(f"plan must be a pipeline.decoding.DraftPlan, got {type(plan).__name__}: pass e.g. "
                            "plan=DraftPlan(4) or plan=spec.plan(domain, sampling)")


@torch.inference_mode()
def autoregressive_stream(target, input_ids, *, sampling: Sampling = GREEDY, max_new_tokens: int = 128,
                          eos_token_id=None, generator: torch.Generator | None = None) -> TokenStream:
    """Plain decoding as a stream: one token per target pass."""
    check_request(sampling, max_new_tokens)
    run = Run.start(target, None, input_ids, sampling, None, None, generator, DecodeStats())
    return TokenStream(run.chunks(plain_step(run), max_new_tokens, eos_token_id), run.stats)


def autoregressive_generate(target, input_ids, *, sampling: Sampling = GREEDY, max_new_tokens: int = 128,
                            eos_token_id=None, generator: torch.Generator | None = None) -> GenerationOutput:
    """Plain decoding through the same loop, forward helper and cache type as speculative_generate."""
    return autoregressive_stream(target, input_ids, sampling=sampling, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos_token_id, generator=generator).collect()
