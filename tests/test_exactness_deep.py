"""Deep exactness: the joint law of the 5th and 6th generated tokens against the target's exact one.

The distribution tests of test_speculative.py and test_tree.py look at the first two tokens of a 3-token
generate, so a draft block there never holds more than 2 tokens. Here every case drafts long blocks (γ = 6, the
draft-length policies at their real max, trees of depth 3 whose second pass is not truncated) with a draft
that accepts most of them whole, and compares out.tokens[4], out.tokens[5] with the exact law
P(x5, x6 | prompt), got by enumerating every x1..x5 (VOCAB^5 prefixes, one batched target forward) under the
same per-step filtering (temperature, top-k, top-p) as the decoder's p. x1 comes from the decoder's plain
prefill pass, so x5, x6 sit in the drafting passes where the 4th and 5th tokens would sit without it.

The draft: the target's weights plus small noise, and a head bias that nearly hides one token (BLIND) from it.
It agrees with the target almost everywhere (long blocks accepted whole), and where it does not, the residual
is concentrated on the hidden token, so a wrong residual, sibling update, column mapping or cache shows in the
(x5, x6) law at a sample size the suite can afford. Each wrong variant below is rejected by the same test.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from pipeline import heads
from pipeline import sampling as sampling_module
from pipeline.decoding import (
    DraftLength,
    DraftPlan,
    chain,
    loop,
    speculative_generate,
    tree,
    tree_sampling,
)
from pipeline.sampling import Sampling
from tests.conftest import chi_square_pvalue, decoder_llama, noisy_copy

torch.set_num_threads(1)

VOCAB = 8  # 64 cells of (x5, x6); VOCAB^5 = 32768 prefixes for the exact law
PAIR = 4  # out.tokens[PAIR], out.tokens[PAIR + 1] are compared (x5, x6)
PROMPT = torch.tensor([3, 1])
N = 1200  # samples per case (fixed seed); about 2.5 minutes for the file on one core; every wrong
# variant below is rejected with p < 1e-12 at this size (1e-6 asserted)
BLIND = 5  # the token the draft nearly never proposes
SUBSET = torch.tensor([0, 2, 3, 4, 5, 7])  # draft_vocab: 6 of the 8 ids (1 and 6 only through the residual)
PARENTS = [-1, -1, 0, 0, 1, 2, 4]  # depth 3: two roots' children, uneven subtrees


@pytest.fixture(scope="module")
def target():
    return decoder_llama(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft(target):
    """The target plus weight noise (2% of each tensor's std), with a head bias of −3 on BLIND (its q ≈ p/20)."""
    model = noisy_copy(target, 0.02)
    with torch.no_grad():
        old = model.get_output_embeddings()
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[BLIND] = -3.0
    model.set_output_embeddings(head)
    return model.eval()


@pytest.fixture(scope="module")
def prefix_logits(target):
    """Target logits [VOCAB^5, 6, V] predicting x1..x6 after PROMPT + each prefix x1..x5, and the prefixes."""
    prefixes = torch.cartesian_prod(*[torch.arange(VOCAB)] * (PAIR + 1))
    ids = torch.cat([PROMPT.expand(len(prefixes), -1), prefixes], 1)
    with torch.inference_mode():
        logits = target(ids).logits[:, len(PROMPT) - 1:]
    return logits, prefixes


def exact_pair(prefix_logits, sampling: Sampling) -> np.ndarray:
    """P(x5, x6 | PROMPT) [V, V] with the filters applied at each step, marginalised over x1..x4."""
    logits, prefixes = prefix_logits
    probs = sampling.probs(logits).double()  # [V^5, 6, V]: step s's distribution after prefix[:s]
    path = torch.ones(len(prefixes), dtype=torch.float64)
    for step in range(PAIR + 1):  # P(x1..x5) of each prefix
        path = path * probs[:, step].gather(1, prefixes[:, step:step + 1]).squeeze(1)
    joint = (path.view(-1, 1) * probs[:, PAIR + 1]).view(*[VOCAB] * (PAIR + 2))
    return joint.sum(tuple(range(PAIR))).numpy()


@dataclasses.dataclass(frozen=True)
class Case:
    drafting: object
    max_new_tokens: int  # past the first block's budget, so no policy is clamped at the first drafting pass
    sampling: Sampling = Sampling(1.0)
    kwargs: dict = dataclasses.field(default_factory=dict)
    min_tokens_per_pass: float = 2.0  # asserted: the draft's blocks are long and mostly accepted
    min_whole_first_blocks: float = 0.0  # asserted: share of first drafted blocks accepted whole


CASES = {
    "fixed_6": Case(6, 8, min_tokens_per_pass=3.0, min_whole_first_blocks=0.2),
    "confidence_8": Case(DraftLength("confidence", 8, 0.3), 10, min_tokens_per_pass=1.7),
    "heuristic_4": Case(DraftLength("heuristic", 4), 10, min_tokens_per_pass=2.5, min_whole_first_blocks=0.3),
    "tree_3_2_1": Case((3, 2, 1), 9, min_tokens_per_pass=2.5, min_whole_first_blocks=0.4),
    "tree_parents": Case(PARENTS, 9, Sampling(0.8), min_tokens_per_pass=2.4, min_whole_first_blocks=0.3),
    "greedy_draft": Case(6, 8, kwargs=dict(draft_temperature=0.0), min_tokens_per_pass=1.2),
    "tree_greedy_draft": Case((3, 2, 1), 9, kwargs=dict(draft_temperature=0.0), min_tokens_per_pass=1.6),
    "top_k_top_p": Case(6, 8, Sampling(1.0, top_k=5, top_p=0.8), min_tokens_per_pass=2.5),
    "tree_top_k_top_p": Case((3, 2, 1), 9, Sampling(0.9, top_k=4, top_p=0.9), min_tokens_per_pass=2.3),
    "tau_below_T": Case(6, 8, Sampling(0.8), dict(draft_temperature=0.4), min_tokens_per_pass=2.0),
    "tau_above_T": Case(6, 8, Sampling(0.8), dict(draft_temperature=1.2), min_tokens_per_pass=2.6),
    "draft_vocab_tau": Case(6, 8, Sampling(1.0), dict(draft_vocab=SUBSET, draft_temperature=0.7),
                            min_tokens_per_pass=1.8),
    "tree_draft_vocab_tau": Case(PARENTS, 9, Sampling(1.0), dict(draft_vocab=SUBSET, draft_temperature=1.3),
                                 min_tokens_per_pass=1.9),
}


def deep_sample(target, draft, case: Case, n: int = N, seed: int = 0):
    """Counts [V, V] of (out.tokens[4], out.tokens[5]) over n generates, and the acceptance they saw."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((VOCAB, VOCAB))
    tokens = passes = whole = first = 0
    for _ in range(n):
        out = speculative_generate(target, draft, PROMPT, sampling=case.sampling, plan=DraftPlan(case.drafting, **case.kwargs),
                                   max_new_tokens=case.max_new_tokens, generator=generator)
        assert len(out.tokens) == case.max_new_tokens
        counts[out.tokens[PAIR], out.tokens[PAIR + 1]] += 1
        # Pass 0 is the plain prefill (x1, no drafts): the drafting passes are the rest.
        assert out.stats.drafted[0] == 0 and out.stats.accepted[0] == 0
        tokens, passes = tokens + out.stats.n_generated - 1, passes + out.stats.target_passes - 1
        first += out.stats.accepted[1]
        whole += out.stats.accepted[1] == (getattr(out.stats, "depths", None) or out.stats.drafted)[1]
    return counts, {"tokens_per_pass": tokens / passes, "whole_first_blocks": whole / n,
                    "first_pass_accepted": first / n}


def deep_pvalue(target, draft, prefix_logits, name: str, case: Case, label: str | None = None):
    started = time.perf_counter()
    counts, acceptance = deep_sample(target, draft, case)
    pvalue = chi_square_pvalue(counts, exact_pair(prefix_logits, case.sampling))
    # One line per case inside the test that asserts on it (`pytest -s ... | grep '\[deep\]'` is the summary).
    print(f"\n[deep] {label or name}: N={N} p={pvalue:.3g} tokens/pass={acceptance['tokens_per_pass']:.2f} "
          f"whole first blocks={acceptance['whole_first_blocks']:.2f} "
          f"first-pass accepted={acceptance['first_pass_accepted']:.2f} ({time.perf_counter() - started:.1f} s)")
    return pvalue, acceptance


def test_exact_law_is_a_distribution_and_matches_sampling_the_target(target, prefix_logits):
    """Guards the enumeration: a proper law, and plain sampling from the target follows it."""
    from pipeline.decoding import autoregressive_generate

    probs = exact_pair(prefix_logits, Sampling(1.0))
    assert abs(probs.sum() - 1) < 1e-6 and (probs > 0).all()
    generator, counts = torch.Generator().manual_seed(1), np.zeros((VOCAB, VOCAB))
    for _ in range(600):
        out = autoregressive_generate(target, PROMPT, sampling=Sampling(1.0), max_new_tokens=PAIR + 2,
                                      generator=generator)
        counts[out.tokens[PAIR], out.tokens[PAIR + 1]] += 1
    assert chi_square_pvalue(counts, probs) > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_deep_tokens_follow_the_target_law(target, draft, prefix_logits, name):
    case = CASES[name]
    pvalue, acceptance = deep_pvalue(target, draft, prefix_logits, name, case)
    assert pvalue > 1e-3
    assert acceptance["tokens_per_pass"] >= case.min_tokens_per_pass, acceptance
    assert acceptance["whole_first_blocks"] >= case.min_whole_first_blocks, acceptance


# ---- the same test rejects a deliberately wrong decoder of each family ----

def test_deep_test_rejects_chain_residual(target, draft, prefix_logits, monkeypatch):
    """After a rejection the next token drawn from p instead of norm(max(0, p − q))."""
    monkeypatch.setattr(sampling_module, "residual_distribution", lambda p, q: p.float())
    pvalue, _ = deep_pvalue(target, draft, prefix_logits, "fixed_6", CASES["fixed_6"], "WRONG chain_residual")
    assert pvalue < 1e-6


def test_deep_test_rejects_tree_sibling_update(target, draft, prefix_logits, monkeypatch):
    """Each sibling tried against the unchanged p and q, the fallback drawn from p."""
    monkeypatch.setattr(tree_sampling, "rejection_update", lambda p, q, x: (p, q))
    pvalue, _ = deep_pvalue(target, draft, prefix_logits, "tree_3_2_1", CASES["tree_3_2_1"],
                            "WRONG tree_sibling_update")
    assert pvalue < 1e-6


def _shifted(vocab):
    """An off-by-one column mapping: subset column j taken for id vocab[j − 1] (cyclically)."""
    return None if vocab is None else vocab.roll(1)


def test_deep_test_rejects_subset_column_mapping(target, draft, prefix_logits, monkeypatch):
    """Chain: q scattered to the full vocabulary with the subset's columns shifted by one."""
    verify_block = chain.verify_block

    def shifted_verify_block(pair, *args):
        return verify_block(dataclasses.replace(pair, draft_vocab=_shifted(pair.draft_vocab)), *args)

    monkeypatch.setattr(chain, "verify_block", shifted_verify_block)
    pvalue, _ = deep_pvalue(target, draft, prefix_logits, "draft_vocab_tau", CASES["draft_vocab_tau"],
                            "WRONG chain_subset_column_mapping")
    assert pvalue < 1e-6


def test_deep_test_rejects_tree_subset_column_mapping(target, draft, prefix_logits, monkeypatch):
    """Tree: pipeline.heads.scatter_to_vocab as _verify_tree calls it, with the subset's columns shifted by one."""
    monkeypatch.setattr(tree, "scatter_to_vocab",
                        lambda q, vocab, size: heads.scatter_to_vocab(q, _shifted(vocab), size))
    pvalue, _ = deep_pvalue(target, draft, prefix_logits, "tree_draft_vocab_tau", CASES["tree_draft_vocab_tau"],
                            "WRONG tree_subset_column_mapping")
    assert pvalue < 1e-6


def test_deep_test_rejects_cache_keeping_a_rejected_token(target, draft, prefix_logits, monkeypatch):
    """After a rejection the target cache's rollback keeps one token too many: the first rejected draft stays
    cached where the correction token belongs, and the loop (reading the cache length) takes the correction
    as already seen. The next pass's first distribution is then the target's after the rejected draft (which
    the target computed in the verify pass), and every later token sees the rejected draft in its context."""
    state = {}
    forward = chain.forward

    def forward_after_stale(model, tokens, cache, head, n_logits=1):
        if model is not target:
            return forward(model, tokens, cache, head, n_logits)
        fed = tokens.shape[1]
        if fed >= n_logits:
            logits = forward(model, tokens, cache, head, n_logits)
        else:  # the cache's last entry is the stale draft: its next-token logits come first
            rest = [forward(model, tokens, cache, head, fed)] if fed else []
            logits = torch.cat([state["stale_row"].view(1, -1), *rest])
        state.update(cache=cache, logits=logits)
        return logits

    def crop_keeping_rejected(cache, length):
        cached = cache.get_seq_length()
        if cache is state.get("cache") and cached > length:  # a rejection: keep its draft (slot `length`)
            rows = state["logits"].shape[0]  # the last rows are the distributions after the last cached slots
            state["stale_row"] = state["logits"][length - cached + rows]
            length += 1
        loop.crop(cache, length)

    monkeypatch.setattr(chain, "forward", forward_after_stale)
    monkeypatch.setattr(chain, "crop", crop_keeping_rejected)
    pvalue, _ = deep_pvalue(target, draft, prefix_logits, "fixed_6", CASES["fixed_6"], "WRONG chain_cache")
    assert pvalue < 1e-6
