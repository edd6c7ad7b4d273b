"""One chain step of speculative decoding (Leviathan et al. 2023; Chen et al. 2023): draft up to γ tokens,
verify them in one target pass, roll both caches back to the committed prefix.

After a step the target cache lacks only the newest token; the draft cache lacks 1 token, or 2 after a fully
accepted block (the draft never fed its own last proposal), fed together in its next forward.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from pipeline.decoding.draft_length import Policy
from pipeline.decoding.loop import DecodeStats, Pair, Profile, crop, forward
from pipeline.heads import scatter_to_vocab
from pipeline.sampling import sample, verify_draft


def draft_block(pair: Pair, seq, draft_cache, budget: int, policy: Policy, profile: Profile):
    """Up to `budget` draft tokens [γ] (the policy may stop earlier) and, when sampling, the distributions
    q [γ, V_draft] they were drawn from."""
    drafts, qs = [], []
    tokens = seq[:, draft_cache.get_seq_length():]  # committed tokens the draft has not seen yet
    for _ in range(budget):
        with profile.part("draft"):
            logits = forward(pair.draft, tokens, draft_cache, pair.draft_head)
        with profile.part("sampling"):
            if pair.greedy:
                index = logits.argmax(-1)
            else:
                qs.append(pair.q.probs(logits))  # exactly the distribution the token is sampled from
                index = sample(qs[-1], pair.generator)
            tokens = (index if pair.draft_vocab is None else pair.draft_vocab[index]).view(1, 1)
            drafts.append(tokens[0])
            # The draft's probability of its token: under q when sampling; greedy drafting has a one-hot q, so
            # there the temperature-1 probability of its argmax (as HF assisted generation).
            stop = policy.needs_confidence and not policy.keep_going(
                logits.softmax(-1).amax() if pair.greedy else qs[-1][0, index[0]])
        if stop:
            break
    return (torch.cat(drafts) if drafts else seq.new_empty(0)), qs


def verify_block(pair: Pair, logits: torch.Tensor, drafts: torch.Tensor, qs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(n accepted, next token) from the target's logits [γ+1, V] at the draft positions and the bonus one."""
    gamma = drafts.shape[0]
    if pair.greedy:
        best = logits.argmax(-1)  # [γ+1]
        n_accepted = (best[:-1] == drafts).long().cumprod(0).sum()
        return n_accepted, best.index_select(0, n_accepted.view(1))[0]
    p = pair.p.probs(logits)  # [γ+1, V]
    # q is 0 outside a draft vocabulary subset: the residual covers those tokens exactly
    q = scatter_to_vocab(torch.cat(qs), pair.draft_vocab, p.shape[-1]) if gamma else p.new_empty(0, p.shape[-1])
    return verify_draft(p, q, drafts, pair.generator)


def chain_step(pair: Pair, seq: torch.Tensor, caches: tuple[DynamicCache, DynamicCache], budget: int,
               policy: Policy, stats: DecodeStats, profile: Profile) -> tuple[torch.Tensor, list[int]]:
    """seq [1, C] holds every committed token (prompt included). Returns the extended seq and the new ids."""
    target_cache, draft_cache = caches
    committed = seq.shape[1]
    drafts, qs = draft_block(pair, seq, draft_cache, budget, policy, profile)
    gamma = drafts.shape[0]
    with profile.part("target"):
        # Committed tokens the target has not seen (the newest one; the whole prompt at first) + the drafts.
        tokens = torch.cat([seq[:, target_cache.get_seq_length():], drafts.view(1, -1)], 1)
        logits = forward(pair.target, tokens, target_cache, pair.target_head, gamma + 1)
    with profile.part("sampling"):
        n_accepted, next_token = verify_block(pair, logits, drafts, qs)
        # The one host sync of the step: we need n to crop the caches and the ids to check EOS.
        result = torch.cat([n_accepted.view(1), drafts, next_token.view(1)]).tolist()
    with profile.part("cache"):
        n = result[0]
        new_tokens = result[1:1 + n] + result[1 + gamma:2 + gamma]
        seq = torch.cat([seq, drafts[:n].view(1, -1), next_token.view(1, 1)], 1)
        crop(target_cache, committed + n)  # drop rejected drafts; keep all committed tokens but the newest
        crop(draft_cache, min(draft_cache.get_seq_length(), committed + n))  # drop rejected drafts
    stats.accepted.append(n)
    stats.drafted.append(gamma)
    stats.target_passes += 1
    policy.update(gamma, n)
    return seq, new_tokens
