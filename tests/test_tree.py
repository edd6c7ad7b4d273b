"""Token-tree speculation: multi-draft exactness (math and decoder), greedy equality, tree attention, cache
state after a partially accepted tree, stopping, stats, input errors."""
import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from pipeline.decoding import MAX_TREE_NODES, DraftPlan, TreeStats, autoregressive_generate, parse_tree, speculative_generate
from pipeline.decoding import tree_sampling
from pipeline.decoding.loop import Pair, Profile, forward
from pipeline.decoding.tree import TreePlan, tree_mask, tree_step
from pipeline.errors import PipelineError
from pipeline.heads import head_rows
from pipeline.sampling import Sampling, residual_distribution
from tests.conftest import (planned, DECODER_VOCAB as VOCAB, N_SAMPLES, chi_square_pvalue, exact_joint, random_prompts,
                            small_config, speculative_joint_counts)

torch.set_num_threads(1)
PARENTS = [-1, -1, 0, 0, 1, 2, 4, -1]  # not breadth-first (node 7 is at depth 1): parse_tree reorders it


# ---- the multi-draft rule on its own: many nodes at once, exact distributions ----

def random_distribution(generator, zeros: int = 0) -> torch.Tensor:
    logits = torch.randn(8, generator=generator) * 1.5
    logits[torch.randperm(8, generator=generator)[:zeros]] = float("-inf")
    return logits.softmax(-1)


def sibling_outcomes(p, q, k, generator, draft_greedy=False, rows=40000) -> np.ndarray:
    """Counts of the token yielded at `rows` independent nodes with target p, draft q and k children."""
    if draft_greedy:
        tokens, valid = q.topk(k).indices.expand(rows, k), torch.ones(rows, k, dtype=torch.bool)
    else:
        tokens, valid = tree_sampling.draw_without_replacement(q.expand(rows, -1), k, generator)
    rank, fallback = tree_sampling.verify_siblings(p.expand(rows, -1), q.expand(rows, -1), tokens, valid,
                                                   generator, draft_greedy=draft_greedy)
    picked = tokens.gather(1, rank.clamp_min(0).view(-1, 1)).view(-1)
    return torch.where(rank >= 0, picked, fallback).bincount(minlength=p.shape[0]).numpy()


@pytest.mark.parametrize("k,q_zeros,draft_greedy", [(1, 0, False), (2, 0, False), (3, 2, False), (5, 4, False),
                                                    (8, 0, False), (3, 0, True)],
                         ids=["k1", "k2", "k3_small_support", "k5_exhausted", "k8_all", "greedy_draft"])
def test_recursive_rejection_yields_exactly_p(k, q_zeros, draft_greedy):
    generator = torch.Generator().manual_seed(k)
    p, q = random_distribution(generator, zeros=1), random_distribution(generator, zeros=q_zeros)
    counts = sibling_outcomes(p, q, k, generator, draft_greedy)
    assert chi_square_pvalue(counts, p.double().numpy()) > 1e-3


@pytest.mark.parametrize("wrong_update", [
    lambda p, q, x: (p, q),  # siblings accepted independently against the same p and q
    lambda p, q, x: (residual_distribution(p, q), q),  # the residual updated, but q kept: draws as if i.i.d.
], ids=["no_update", "q_kept"])
def test_wrong_sibling_rules_are_rejected(monkeypatch, wrong_update):
    monkeypatch.setattr(tree_sampling, "rejection_update", wrong_update)
    generator = torch.Generator().manual_seed(0)
    p, q = random_distribution(generator), random_distribution(generator)
    assert chi_square_pvalue(sibling_outcomes(p, q, 3, generator), p.double().numpy()) < 1e-6


def test_draws_are_without_replacement_in_order():
    """Ordered pairs from Gumbel-top-k have probability q(a)·q(b)/(1 − q(a)) (Kool et al. 2019)."""
    generator = torch.Generator().manual_seed(1)
    q = random_distribution(generator, zeros=3)
    index, valid = tree_sampling.draw_without_replacement(q.expand(40000, -1), 2, generator)
    assert valid.all() and (index[:, 0] != index[:, 1]).all()
    counts = np.zeros((8, 8))
    np.add.at(counts, (index[:, 0].numpy(), index[:, 1].numpy()), 1)
    qd = q.double().numpy()
    exact = qd[:, None] * qd[None, :] / (1 - qd[:, None])
    np.fill_diagonal(exact, 0.0)
    assert chi_square_pvalue(counts, exact) > 1e-3
    index, valid = tree_sampling.draw_without_replacement(q.view(1, -1), 7, generator)
    assert valid.sum() == 5 and not valid[0, 5:].any()  # the support has 5 tokens


# ---- the decoder: two-token joint distribution against the target's exact one ----

SUBSET = torch.tensor([0, 1, 2, 4, 6, 9, 10, 12, 14])
CASES = {
    "2x2_T1.0": ((2, 2), "far", dict(temperature=1.0)),
    "2x2_T0.6": ((2, 2), "close", dict(temperature=0.6)),
    "3x1_T1.0": ((3, 1), "far", dict(temperature=1.0)),
    "3x1_T0.6": ((3, 1), "close", dict(temperature=0.6)),
    "4_T1.0": ((4,), "far", dict(temperature=1.0)),
    "4_T0.6": ((4,), "far", dict(temperature=0.6)),
    "3x1_top_k": ((3, 1), "far", dict(temperature=0.8, top_k=5)),
    "4_top_k_below_width": ((4,), "far", dict(temperature=1.0, top_k=2, draft_temperature=1.3)),
    "2x2_top_p": ((2, 2), "far", dict(temperature=1.0, top_p=0.7)),
    "2x2_draft_temperature": ((2, 2), "far", dict(temperature=0.7, draft_temperature=1.3)),
    "3x1_greedy_draft": ((3, 1), "far", dict(temperature=1.0, draft_temperature=0.0)),
    "2x2_draft_vocab": ((2, 2), "close", dict(temperature=1.0, draft_vocab=SUBSET)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_samples_follow_target_distribution(target, drafts, case):
    tree, draft_name, kwargs = CASES[case]
    probs = exact_joint(target, kwargs["temperature"], kwargs.get("top_k", 0), kwargs.get("top_p", 1.0))
    counts = speculative_joint_counts(target, drafts[draft_name], N_SAMPLES, drafting=tree, **kwargs)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_distribution_test_rejects_siblings_accepted_independently(target, far_draft, monkeypatch):
    """Each sibling tried against the unchanged p and q, the last fallback drawn from p: not the target's law."""
    monkeypatch.setattr(tree_sampling, "rejection_update", lambda p, q, x: (p, q))
    counts = speculative_joint_counts(target, far_draft, N_SAMPLES, drafting=(3, 1), temperature=1.0)
    assert chi_square_pvalue(counts, exact_joint(target, 1.0)) < 1e-6


# ---- greedy: identical to autoregressive decoding ----

@pytest.mark.parametrize("tree", [(2, 2), (3, 2, 1, 1), (1, 1, 1), (4,), PARENTS], ids=str)
@pytest.mark.parametrize("draft_name", ["close", "far"])
def test_greedy_tree_equals_autoregressive(target, drafts, tree, draft_name):
    accepted = 0
    for prompt in random_prompts(6, seed=3):
        expected = autoregressive_generate(target, prompt, max_new_tokens=20).tokens
        out = speculative_generate(target, drafts[draft_name], prompt, plan=DraftPlan(tree), max_new_tokens=20)
        assert out.tokens.tolist() == expected.tolist()
        accepted += out.stats.n_accepted
    assert accepted > 0


def test_greedy_tree_with_a_vocab_subset_or_a_sampling_draft_equals_autoregressive(target, close_draft, far_draft):
    subset = torch.tensor([0, 2, 3, 5, 7, 8, 11, 13])
    generator = torch.Generator().manual_seed(7)
    for prompt in random_prompts(4, seed=11):
        expected = autoregressive_generate(target, prompt, max_new_tokens=16).tokens.tolist()
        out = speculative_generate(target, close_draft, prompt, plan=DraftPlan((3, 2), draft_vocab=subset),
                                   max_new_tokens=16)
        assert out.tokens.tolist() == expected
        out = speculative_generate(target, far_draft, prompt, plan=DraftPlan(PARENTS, draft_temperature=1.0),
                                   generator=generator, max_new_tokens=16)
        assert out.tokens.tolist() == expected


def test_a_one_child_tree_is_the_chain(target, close_draft):
    for prompt in random_prompts(4, seed=5):
        chain = speculative_generate(target, close_draft, prompt, plan=DraftPlan(3), max_new_tokens=24)
        tree = speculative_generate(target, close_draft, prompt, plan=DraftPlan((1, 1, 1)), max_new_tokens=24)
        assert tree.tokens.tolist() == chain.tokens.tolist()
        assert tree.stats.accepted == chain.stats.accepted and tree.stats.drafted == chain.stats.drafted


def test_greedy_tree_on_qwen2_equals_autoregressive():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(small_config(Qwen2Config, use_sliding_window=False, initializer_range=0.2)).eval()
    prompt = torch.tensor([1, 2, 3])
    expected = autoregressive_generate(model, prompt, max_new_tokens=12).tokens.tolist()
    assert speculative_generate(model, model, prompt, plan=DraftPlan((2, 2)), max_new_tokens=12).tokens.tolist() == expected


# ---- tree attention and cache state ----

def test_tree_forward_equals_plain_forwards_of_each_path(target):
    """Every node's logits under the 4-D tree mask and per-node positions, with a cached prefix, equal a
    plain forward of prompt + the node's root-to-node path."""
    tree, prompt = parse_tree(PARENTS), torch.tensor([4, 1, 7])
    plan = TreePlan(tree, torch.device("cpu"))
    tokens = torch.randint(0, VOCAB, (plan.n,), generator=torch.Generator().manual_seed(0))
    cache, head = DynamicCache(config=target.config), head_rows(target)
    with torch.inference_mode():
        forward(target, prompt[:2].view(1, -1), cache, head)  # the cache holds a prefix; one token is pending
        mask = tree_mask(2, 1, plan.ancestors, target.dtype)
        positions = torch.cat([torch.tensor([2]), 2 + plan.depths])
        logits = forward(target, torch.cat([prompt[2:], tokens]).view(1, -1), cache, head, plan.n + 1, mask,
                         positions.view(1, -1))
        for node in range(-1, plan.n):
            path = [i for i in range(plan.n) if node >= 0 and plan.ancestors[node, i]]
            fresh = target(torch.cat([prompt, tokens[path]]).view(1, -1)).logits[0, -1]
            torch.testing.assert_close(logits[node + 1], fresh.float(), rtol=1e-4, atol=1e-5)


def one_tree_step(target, draft, prompt, tree, temperature, generator):
    seq = prompt.view(1, -1)
    caches = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    p = Sampling(temperature)
    pair = Pair(target, draft, head_rows(target), head_rows(draft), p, p, generator=generator)
    stats = TreeStats()
    with torch.inference_mode():
        seq, new = tree_step(pair, seq, caches, TreePlan(parse_tree(tree), torch.device("cpu")), stats, Profile("cpu"))
    return seq, caches, new, stats.accepted[0]


def assert_cache_equals_a_fresh_forward(model, seq, cache):
    fresh = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.model(input_ids=seq[:, :cache.get_seq_length()], cache=fresh, use_cache=True)
    assert len(fresh.layers) == len(cache.layers)
    for ours, theirs in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_keep_exactly_the_accepted_path(target, close_draft, temperature):
    tree, generator, partial = (3, 2, 1), torch.Generator().manual_seed(3), 0
    for prompt in random_prompts(8, seed=21):
        seq, (target_cache, draft_cache), new, n = one_tree_step(target, close_draft, prompt, tree, temperature,
                                                                 generator)
        assert seq.shape[1] == len(prompt) + n + 1 and seq[0, len(prompt):].tolist() == new
        partial += 0 < n < 3
        # Target: everything but the newest token; draft: the path without a final leaf (depth 3 here).
        assert target_cache.get_seq_length() == seq.shape[1] - 1
        assert draft_cache.get_seq_length() == len(prompt) + min(n, 2)
        assert_cache_equals_a_fresh_forward(target, seq, target_cache)
        assert_cache_equals_a_fresh_forward(close_draft, seq, draft_cache)
    assert partial, "no partially accepted tree: the test did not exercise the gather"


# ---- stopping and stats ----

@pytest.mark.parametrize("max_new_tokens", [1, 3, 8])
def test_max_new_tokens_is_exact_and_the_tree_is_truncated(target, max_new_tokens):
    prompt = torch.tensor([5, 6, 7])
    out = speculative_generate(target, target, prompt, plan=DraftPlan((2, 2, 1)), max_new_tokens=max_new_tokens)
    assert out.tokens.tolist() == autoregressive_generate(target, prompt, max_new_tokens=max_new_tokens).tokens.tolist()
    remaining, depths = max_new_tokens - 1, [0]  # the first pass is the plain prefill: depth 0, one token
    while remaining > 0:  # the identical draft accepts a full path every pass
        depths.append(min(3, remaining - 1))
        remaining -= depths[-1] + 1
    assert out.stats.depths == depths and out.stats.accepted == depths
    assert out.stats.drafted == [[0, 2, 6, 10][d] for d in depths]


def test_eos_inside_an_accepted_path_ends_generation_there(target, close_draft):
    prompt = torch.tensor([2, 8])
    reference = autoregressive_generate(target, prompt, max_new_tokens=30).tokens.tolist()
    eos = [reference[9], reference[5]]
    stop = min(reference.index(e) for e in eos)
    out = speculative_generate(target, close_draft, prompt, plan=DraftPlan((2, 2, 1)), eos_token_id=eos,
                               max_new_tokens=30)
    assert out.tokens.tolist() == reference[:stop + 1]
    sampled = speculative_generate(target, close_draft, prompt, sampling=Sampling(temperature=1.0),
                                   plan=DraftPlan((2, 2)), eos_token_id=eos, generator=torch.Generator().manual_seed(0),
                                   max_new_tokens=200).tokens.tolist()
    assert sampled[-1] in eos and not set(sampled[:-1]) & set(eos)


def test_stats_are_consistent(target, close_draft):
    generator = torch.Generator().manual_seed(1)
    for prompt in random_prompts(4, seed=31):
        out = speculative_generate(target, close_draft, prompt, sampling=Sampling(temperature=1.0),
                                   plan=DraftPlan((3, 2, 1)), generator=generator, max_new_tokens=40)
        s = out.stats
        assert isinstance(s, TreeStats) and s.n_generated == len(out.tokens) == sum(a + 1 for a in s.accepted)
        assert all(0 <= a <= d for a, d in zip(s.accepted, s.depths)) and s.drafted[:2] == [0, 3 + 6 + 6]
        # One draft forward per depth of a non-empty tree, one target forward per pass; the first of each is prefill.
        assert s.target_passes == len(s.accepted) == len(s.target_times) + 1
        assert len(s.draft_times) == sum(d for d in s.depths) - 1
        assert s.prefill_time > 0 and s.sampling_time > 0 and s.cache_time > 0
        assert s.total_time >= s.prefill_time + sum(s.draft_times) + sum(s.target_times)
        assert len(s.per_depth_acceptance) == 3 and all(0 <= r <= 1 for r in s.per_depth_acceptance)


# ---- input validation ----

@pytest.mark.parametrize("kwargs,message", [
    (dict(drafting=(3, 0)), "branching factors must be integers >= 1"),
    (dict(drafting=()), "branching factors must be integers >= 1"),
    (dict(drafting=(8, 8)), f"more than the cap of {MAX_TREE_NODES}"),
    (dict(drafting=[-1] * (MAX_TREE_NODES + 1)), f"more than the cap of {MAX_TREE_NODES}"),
    (dict(drafting=[-1, 2, 0]), "is not a tree: parents\\[1\\] = 2"),
    (dict(drafting=[-1, 0, 1, 3]), "is not a tree: parents\\[3\\] = 3"),
    (dict(drafting=[-1, -2]), "is not a tree: parents\\[1\\] = -2"),
    (dict(drafting=[]), "parent list is empty"),
    (dict(drafting="3,2"), "a tuple of branching factors or a parent list"),
    (dict(drafting=(5,), draft_vocab=torch.tensor([1, 2, 3, 4])), "use a narrower tree"),
])
def test_bad_tree_input_is_one_clear_error(target, close_draft, kwargs, message):
    with pytest.raises(PipelineError, match=message) as info:
        speculative_generate(target, close_draft, torch.tensor([1, 2]), max_new_tokens=4, **planned(kwargs))
    assert "\n" not in str(info.value)


def test_attention_without_4d_masks_is_refused(target, close_draft):
    draft = copy.deepcopy(close_draft)
    draft.config._attn_implementation = "flash_attention_2"
    with pytest.raises(PipelineError, match="attn_implementation='sdpa'") as info:
        speculative_generate(target, draft, torch.tensor([1, 2]), plan=DraftPlan((2,)), max_new_tokens=4)
    assert "\n" not in str(info.value)
