"""Distillation losses against hand-computed values, the cached top-k teacher against the online one (also
through a vocabulary subset), and the draft's construction: the FR-Spec vocabulary subset, its head, a narrower
derived draft. Tiny tensors and tiny random models; CPU; fixed seeds."""
from __future__ import annotations

import math

import pytest
import torch

from distill.losses import distillation_loss, sparse_teacher
from pipeline.errors import PipelineError
from tests.conftest import WORD_VOCAB as VOCAB, logits, tiny_llama


# ---------------------------------------------------------------- losses
# p = target, q = draft over three tokens; each expected value is worked out by hand in its comment.
P, Q = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]
HAND = {
    # ½(|.5−.2| + |.3−.5| + |.2−.3|) = ½(.3 + .2 + .1)
    ("tvd", None): 0.3,
    # .5 ln(.5/.2) + .3 ln(.3/.5) + .2 ln(.2/.3) = .45815 − .15325 − .08109
    ("fkl", None): 0.2238047,
    # .2 ln(.2/.5) + .5 ln(.5/.3) + .3 ln(.3/.2) = −.18326 + .25541 + .12164
    ("rkl", None): 0.1937942,
    # m = βp + (1−β)q; β KL(p‖m) + (1−β) KL(q‖m). β=.5: m = (.35, .4, .25)
    ("jsd", 0.1): 0.0196612,
    ("jsd", 0.5): 0.0508746,
    ("jsd", 0.9): 0.0175626,
}


@pytest.mark.parametrize("name,beta", list(HAND), ids=[f"{n}{'' if b is None else b}" for n, b in HAND])
def test_loss_matches_hand_computed_value(name, beta):
    loss = distillation_loss(name, logits(Q), teacher_logits=logits(P), beta=beta or 0.5)
    assert loss.shape == (1,)
    assert loss.item() == pytest.approx(HAND[(name, beta)], abs=1e-5)


def test_cross_entropy_is_negative_log_prob_of_the_target_token():
    loss = distillation_loss("ce", logits(Q), labels=torch.tensor([1]))
    assert loss.item() == pytest.approx(-math.log(0.5), abs=1e-6)  # q(token 1) = .5
    assert distillation_loss("ce", logits(Q), labels=torch.tensor([-100])).item() == 0.0  # ignored position


def test_top1_teaches_the_target_argmax_from_either_teacher():
    # target argmax = token 0; q(0) = .2, so −ln .2; the cached teacher lists the target's tokens (1, 0) in any order
    expected = -math.log(0.2)
    assert distillation_loss("top1", logits(Q), teacher_logits=logits(P)).item() == pytest.approx(expected, abs=1e-6)
    cached = sparse_teacher(torch.tensor([[1, 0]]), torch.tensor([P[1], P[0]]).log()[None], vocab_size=3)
    assert distillation_loss("top1", logits(Q), teacher=cached).item() == pytest.approx(expected, abs=1e-6)
    # wrong variant: the draft's own argmax (token 1) is not what greedy verification accepts
    assert distillation_loss("ce", logits(Q), labels=torch.tensor([1])).item() != pytest.approx(expected, abs=1e-3)
    # the target's argmax outside a subset draft's classes: nothing to learn at that position
    outside = sparse_teacher(torch.tensor([[1, 0]]), torch.tensor([P[1], P[0]]).log()[None], 3,
                             column_of=torch.tensor([-1, 0, 1]), subset_logmass=torch.tensor([math.log(0.5)]))
    assert distillation_loss("top1", logits(Q)[:, :2], teacher=outside).item() == 0.0


def test_loss_temperature_softens_both_distributions():
    # T=2: p ∝ √p = (.7071, .5477, .4472)/1.7020 = (.41545, .32180, .26275); q likewise = (.26275, .41545, .32180)
    # TVD = ½(.15270 + .09365 + .05905)
    loss = distillation_loss("tvd", logits(Q), teacher_logits=logits(P), temperature=2.0)
    assert loss.item() == pytest.approx(0.1526948, abs=1e-5)


def test_topk_bucket_is_exact_on_the_listed_tokens_plus_other():
    # p = (.5, .3, .15, .05), top-2 listed, "other" = .2; q uniform: (.25, .25) + other .5
    # TVD = ½(.25 + .05 + .3) = .3; FKL = .5 ln 2 + .3 ln 1.2 + .2 ln .4
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    teacher = sparse_teacher(torch.tensor([[0, 1]]), p[:, :2].log(), vocab_size=4)
    q = torch.zeros(1, 4)
    assert distillation_loss("tvd", q, teacher=teacher).item() == pytest.approx(0.3, abs=1e-6)
    fkl = 0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
    assert distillation_loss("fkl", q, teacher=teacher).item() == pytest.approx(fkl, abs=1e-6)
    # renormalize: p = (.625, .375) on the listed tokens, 0 elsewhere; TVD = ½(.375 + .125 + .5)
    assert distillation_loss("tvd", q, teacher=teacher, tail="renormalize").item() == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_cached_topk_teacher_is_close_to_online_teacher(name):
    """At loss temperature 1 with the top-32 holding ~97% of the mass. (Reverse KL is the most tail-sensitive:
    a draft's mass on tokens the target finds unlikely is weighted by log q/p. At T != 1 the cached tail is an
    even-spread estimate; distill/losses.py says so.)"""
    torch.manual_seed(0)
    vocab, k = 512, 32
    teacher_logits = torch.randn(64, vocab) * 4  # peaked, like an LM
    draft_logits = teacher_logits * 0.9 + torch.randn(64, vocab) * 0.5
    logp = teacher_logits.log_softmax(-1)
    top = logp.topk(k)
    assert top.values.exp().sum(-1).mean() > 0.95
    online = distillation_loss(name, draft_logits, teacher_logits=teacher_logits).mean()
    # float16 log-probs, as the collect stage stores them
    cached = distillation_loss(name, draft_logits, teacher=sparse_teacher(top.indices, top.values.half().float(), vocab)).mean()
    assert cached.item() == pytest.approx(online.item(), rel=0.08)


def test_losses_have_finite_gradients_with_a_vocab_subset():
    from pipeline.heads import column_map

    torch.manual_seed(0)
    subset = torch.arange(0, 64, 2)
    column_of = column_map(subset, 64)
    teacher_logits = torch.randn(8, 64) * 3
    top = teacher_logits.log_softmax(-1).topk(8)
    mass = teacher_logits.log_softmax(-1)[:, subset].logsumexp(-1)
    for name in ("fkl", "rkl", "jsd", "tvd"):
        draft = torch.randn(8, len(subset), requires_grad=True)
        loss = distillation_loss(name, draft, teacher=sparse_teacher(top.indices, top.values, 64, column_of, mass)).sum()
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(draft.grad).all(), name


def test_reverse_kl_stays_finite_when_the_cached_top_k_mass_rounds_to_one():
    # top-1 log-prob −1e-9 (fp16 stores it as −0.0) plus 31 small listed tokens: the listed mass sums past 1, so the
    # "other" class has no teacher mass left. The draft puts ≈ 0.006 there. FKL/TVD/JSD charge ≈ that much; reverse KL
    # must too (a floor, not log 0: with log p = −1e4 it was ≈ 60).
    k, vocab = 32, 4096
    logprobs = torch.cat([torch.tensor([[-1e-9]]), torch.full((1, k - 1), -12.0)], 1).half().float()
    assert logprobs.exp().sum() >= 1.0
    teacher = sparse_teacher(torch.arange(k)[None], logprobs, vocab)
    draft_logits = torch.full((1, vocab), -30.0)
    draft_logits[0, 0] = 0.0
    draft_logits[0, k:] = math.log(0.006 / (vocab - k))  # q(other) ≈ 0.006, q(top-1) ≈ 0.994
    losses = {name: distillation_loss(name, draft_logits, teacher=teacher).item() for name in ("fkl", "tvd", "jsd", "rkl")}
    assert losses["tvd"] == pytest.approx(0.006, abs=1e-3)
    assert 0 < losses["rkl"] < 0.1, losses


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_cached_and_online_teachers_agree_for_a_vocab_subset_draft(name):
    """A frequency-ranked subset holds most of the target's tail. With the draft's conditional distribution on the
    unlisted subset tokens equal to the target's (so bucketing the tail loses nothing), the cached top-k teacher
    with the subset's mass must give the online (subset-renormalised) teacher's loss. An even-spread tail over
    all V − k tokens gives the subset's "other" class ≈ K/V of the tail and fails this."""
    from pipeline.heads import column_map

    torch.manual_seed(0)
    vocab, k, rows = 512, 16, 32
    teacher_logits = torch.randn(rows, vocab) * 2
    subset = torch.cat([teacher_logits.mean(0).topk(96).indices, torch.tensor([0])]).unique()  # the frequent tokens
    logp = teacher_logits.log_softmax(-1)
    top = logp.topk(k)
    draft_logits = teacher_logits.clone()
    draft_logits.scatter_add_(-1, top.indices, torch.randn(rows, k))  # differs only on the listed tokens
    online = distillation_loss(name, draft_logits[:, subset], teacher_logits=teacher_logits[:, subset])
    teacher = sparse_teacher(top.indices, top.values, vocab, column_map(subset, vocab), logp[:, subset].logsumexp(-1))
    cached = distillation_loss(name, draft_logits[:, subset], teacher=teacher)
    assert torch.allclose(cached, online, atol=1e-4), (cached - online).abs().max()


def test_unknown_loss_or_bad_beta_is_refused():
    from distill.losses import check_loss

    with pytest.raises(PipelineError, match="unknown distillation loss"):
        check_loss("kl", 0.5, "bucket", "online")
    with pytest.raises(PipelineError, match="outside"):
        check_loss("jsd", 1.0, "bucket", "online")
    with pytest.raises(PipelineError, match="infinite"):
        check_loss("rkl", 0.5, "renormalize", "topk")


# ---------------------------------------------------------------- draft construction
def test_vocab_subset_keeps_stop_tokens_and_the_most_frequent_tokens():
    from distill.draft import vocab_subset

    completions = [[10, 10, 10, 11, 11, 12], [10, 13, 11]]
    subset = vocab_subset(completions, 4, vocab_size=50, always=[1])
    assert subset.tolist() == [1, 10, 11, 12]  # the stop token 1 even though it never occurs
    with_prompts = vocab_subset([[10, 10, 11]], 4, vocab_size=50, always=[1], prompts=[[30, 30, 31, 10]])
    assert with_prompts.tolist() == [1, 10, 11, 30]  # then the prompts' most frequent tokens
    filled = vocab_subset([[40]], 3, vocab_size=50, always=[1])
    assert filled.tolist() == [0, 1, 40]  # too few distinct tokens: the lowest (most common BPE) ids fill in


def test_subset_head_is_full_vocab_on_save(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.heads import restore_full_head, use_subset_head

    model = tiny_llama(vocab_size=VOCAB, layers=1, tie=True)
    head = use_subset_head(model, torch.arange(10))
    assert model(torch.tensor([[3, 4]])).logits.shape[-1] == 10
    model.save_pretrained(tmp_path)
    restore_full_head(model, head)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded(torch.tensor([[3, 4]])).logits.shape[-1] == VOCAB
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_narrower_derived_draft_runs():
    from pipeline.modelio.draft_init import narrow_hidden
    from pipeline.modelio.models import derive_draft

    target = tiny_llama(vocab_size=VOCAB, hidden_size=64, layers=2, tie=True)
    draft = narrow_hidden(derive_draft(target, [0]), 32)
    assert draft.config.hidden_size == 32 and draft.lm_head.weight.shape == (VOCAB, 32)
    assert torch.isfinite(draft(torch.tensor([[3, 4, 5]])).logits).all()
