"""Adaptive draft temperature (pipeline/decoding/adaptive_tau.py): exact with it on (chains, trees, a vocabulary
subset, a nucleus), a variant that verifies against a stale q rejected, τ moving toward the temperature that matches
the target, the sibling score unbiased, greedy decoding untouched, bad settings as one line."""
import pytest
import torch

from pipeline.decoding import DraftLength, DraftPlan, autoregressive_generate, chain, speculative_generate
from pipeline.decoding.adaptive_tau import SCALE, AdaptiveTau, subset_columns
from pipeline.decoding.guard import Guard, GuardSettings, GuardStats
from pipeline.decoding.loop import Pair
from pipeline.decoding.tree_sampling import sibling_acceptance, verify_siblings
from pipeline.errors import PipelineError
from pipeline.heads import scatter_to_vocab
from pipeline.sampling import Sampling, expected_acceptance
from tests.conftest import (JOINT_PROMPT, N_SAMPLES, chi_square_pvalue, exact_joint, random_prompts,
                            speculative_joint_counts)

torch.set_num_threads(1)

COST = {"c": 0.05, "verify_ratio": {1: 1.05, 2: 1.1, 4: 1.2}}  # cheap drafts: the guard keeps drafting
WIDE = dict(tau_step=2.0, tau_steps=3)  # candidates τ × 1/8 … 8: moves large enough for a stale q to show
OWN_TAU = 0.15  # the target as its own draft, planned far below T = 1: adaptive τ moves up to 0.6 or 1.2 at once
STALE_SAMPLES = 3000  # the stale q changes only the passes after a move: 1200 samples give p ≈ 1e-5, this ≈ 1e-12


def adaptive_guard(**settings) -> Guard:
    return Guard(COST, (0.5, 0.25), GuardSettings(**{"measure_every": 0, "adaptive_tau": True, **settings}))


def wide_guard(drafting) -> Guard:
    """Adaptive τ on a wide grid, never drafting more than a chain's γ: a one-draft pass ends at its first
    draft, so the pass after it (whose τ may have moved) draws the chi-square test's last counted token."""
    return adaptive_guard(**WIDE, longest=drafting if isinstance(drafting, int) else 8)


# ---- exactness ----

CASES = {  # (draft, planned τ, sampling, drafting, extra keywords of speculative_generate)
    "chain": ("far", 1.0, Sampling(1.0), 1, {}),
    "chain_own_draft": ("same", OWN_TAU, Sampling(1.0), 1, {}),
    "chain_subset": ("far", 1.0, Sampling(1.0), 2, {"draft_vocab": torch.arange(0, 16, 2)}),
    "chain_top_p": ("far", 1.0, Sampling(1.0, top_p=0.9), 1, {}),
    "tree": ("far", 1.0, Sampling(1.0), (3,), {}),
}


def moves(target, draft, tau, sampling, drafting, extra, n=40) -> int:
    """τ moves over n decodes of the chi-square test's shape: the moves after its first drafted pass change how
    its last counted token is drafted."""
    generator = torch.Generator().manual_seed(7)
    stats = [speculative_generate(target, draft, JOINT_PROMPT, sampling=sampling, max_new_tokens=4, generator=generator,
                                  plan=DraftPlan(drafting, draft_temperature=tau, guard=wide_guard(drafting),
                                                 **extra)).stats.guard for _ in range(n)]
    return sum(s.tau_up + s.tau_down for s in stats)


@pytest.mark.parametrize("case", list(CASES))
def test_samples_with_adaptive_tau_follow_the_target_distribution(target, drafts, case):
    name, tau, sampling, drafting, extra = CASES[case]
    assert moves(target, drafts[name], tau, sampling, drafting, extra) > 10  # τ moved inside the counted tokens
    counts = speculative_joint_counts(target, drafts[name], N_SAMPLES, temperature=sampling.temperature,
                                      top_p=sampling.top_p, drafting=drafting, draft_temperature=tau,
                                      guard=wide_guard(drafting), **extra)
    assert chi_square_pvalue(counts, exact_joint(target, sampling.temperature, top_p=sampling.top_p)) > 1e-3


def test_the_distribution_test_rejects_verifying_against_the_q_of_the_planned_tau(target, monkeypatch):
    """The wrong variant of case chain_own_draft: drafts drawn at the moved τ (≈ 1), verified against the q of
    the planned τ (0.15), which underweights the target's likeliest token."""
    draft_block, planned = chain.draft_block, Sampling(OWN_TAU)

    def stale_q(pair, *args):
        drafts, qs, first = draft_block(pair, *args)
        return drafts, [planned.probs(first.view(1, -1))] if qs else qs, first  # γ = 1: `first` is every logit

    monkeypatch.setattr(chain, "draft_block", stale_q)
    counts = speculative_joint_counts(target, target, STALE_SAMPLES, temperature=1.0, drafting=1,
                                      draft_temperature=OWN_TAU, guard=wide_guard(1))
    assert chi_square_pvalue(counts, exact_joint(target, 1.0)) < 1e-6


@pytest.mark.parametrize("drafting", [4, DraftLength("confidence", 8, 0.5), (2, 2, 1)],
                         ids=["fixed", "confidence", "tree"])
def test_greedy_speculative_with_adaptive_tau_equals_autoregressive(target, close_draft, drafting):
    for prompt in random_prompts(4, seed=3):
        expected = autoregressive_generate(target, prompt, max_new_tokens=20).tokens.tolist()
        out = speculative_generate(target, close_draft, prompt, plan=DraftPlan(drafting, guard=adaptive_guard()),
                                   max_new_tokens=20)
        assert out.tokens.tolist() == expected
        assert out.stats.guard.tau_passes == 0 and out.stats.guard.draft_temperature is None  # nothing to adapt


# ---- decisions ----

def scored_pair(draft_temperature: float) -> Pair:
    """A pair whose models are never called: `scores` reads only the logits it is given."""
    return Pair(None, None, None, None, Sampling(1.0), Sampling(draft_temperature))


def test_tau_moves_to_the_temperature_at_which_the_draft_matches_the_target():
    logits = torch.randn(16, generator=torch.Generator().manual_seed(0)) * 3
    for best, step in ((0.5, 2.0), (2.0, 2.0), (1.0, 2.0)):  # the target is the draft's logits at τ = best
        pair, stats = scored_pair(1.0), GuardStats()
        tau = AdaptiveTau(pair, step, 2, window=16.0, stats=stats)
        for _ in range(3):
            tau.update(tau.scores(tau.pair, logits / best, logits).tolist())
        assert tau.temperature == pytest.approx(best) and tau.pair.q.temperature == pytest.approx(best)
        assert (stats.tau_down, stats.tau_up) == ((best < 1) + 0, (best > 1) + 0)
        assert stats.draft_temperature == pytest.approx(best) and stats.tau_passes == 3


def test_the_chain_score_is_the_first_drafts_acceptance():
    logits, target = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    tau = AdaptiveTau(scored_pair(0.8), 1.25, 1, window=16.0, stats=GuardStats())
    scores = tau.scores(tau.pair, target, logits).double() / SCALE
    expected = [expected_acceptance(Sampling(1.0).probs(target), Sampling(t).probs(logits)) for t in (0.64, 0.8, 1.0)]
    assert scores.tolist() == pytest.approx([float(e) for e in expected], abs=1e-5)


def test_decoding_with_the_target_as_its_draft_brings_a_wrong_tau_back_toward_the_target_temperature(target):
    """The draft is the target: at τ = T (1.0) its first draft is always accepted, so from a planned τ of 2.44
    adaptive τ moves down."""
    stats = [speculative_generate(target, target, prompt, sampling=Sampling(1.0),
                                  plan=DraftPlan(2, draft_temperature=2.44, guard=adaptive_guard(tau_step=1.25, tau_steps=4)),
                                  max_new_tokens=30, generator=torch.Generator().manual_seed(2)).stats.guard
             for prompt in random_prompts(4, seed=4)]
    assert all(s.tau_down > 0 and s.draft_temperature < 1.3 for s in stats)
    assert all(s.tau_sum / s.tau_passes < 2.0 for s in stats)


def test_the_sibling_score_is_an_unbiased_estimate_of_a_nodes_acceptance():
    """Averaged over its draws, sibling_acceptance matches how often verify_siblings accepts a child of the same
    p and q; at width 1 it is Σ min(p, q)."""
    generator = torch.Generator().manual_seed(3)
    p, q = torch.randn(2, 12, generator=generator).mul(2).softmax(-1)
    n = 4000
    for width in (1, 3):
        score = torch.stack([sibling_acceptance(p, q.view(1, -1), width, generator) for _ in range(n)]).mean()
        draws = torch.stack([(q / torch.empty(12).exponential_(1, generator=generator)).topk(width).indices
                             for _ in range(n)])
        rank, _ = verify_siblings(p.expand(n, -1), q.expand(n, -1), draws, torch.ones_like(draws, dtype=torch.bool),
                                  generator)
        assert float(score) == pytest.approx(float((rank >= 0).double().mean()), abs=0.03)
    assert float(score) > float(expected_acceptance(p, q)) + 0.05  # three siblings accept more often than one


def test_the_sibling_score_on_a_vocabulary_subset_matches_the_full_vocabulary():
    """q on a subset's columns, p there plus its mass outside (subset_columns): the same acceptance as q scattered
    to the full vocabulary, whose residuals put the outside mass back."""
    generator = torch.Generator().manual_seed(4)
    p = torch.randn(12, generator=generator).mul(2).softmax(-1)
    vocab = torch.tensor([0, 2, 3, 5, 8, 11])
    q = torch.randn(6, generator=generator).mul(2).softmax(-1).view(1, -1)
    full, inside = scatter_to_vocab(q, vocab, 12), torch.cat([q, q.new_zeros(1, 1)], -1)
    for width in (1, 3):
        scores = [torch.stack([sibling_acceptance(pp, qq, width, generator) for _ in range(4000)]).mean()
                  for pp, qq in ((p, full), (subset_columns(p, vocab), inside))]
        assert float(scores[0]) == pytest.approx(float(scores[1]), abs=0.02)


# ---- settings ----

@pytest.mark.parametrize("values,message", [(dict(adaptive_tau="yes"), "guard.adaptive_tau"),
                                            (dict(tau_step=1.0), "guard.tau_step"),
                                            (dict(tau_steps=0), "guard.tau_steps")])
def test_bad_adaptive_tau_settings_are_one_line(values, message):
    with pytest.raises(PipelineError, match=message) as error:
        GuardSettings(**values)
    assert "\n" not in str(error.value)


def test_the_decisions_sum_over_requests_with_their_mean_temperature():
    a = GuardStats(passes=3, tau_up=1, tau_passes=2, tau_sum=1.5, draft_temperature=0.9, cost_factor=1.1)
    b = GuardStats(passes=2, tau_down=2, tau_passes=2, tau_sum=1.3, draft_temperature=0.6, cost_factor=1.2)
    total = a.add(b).to_dict()
    assert total["passes"] == 5 and (total["tau_up"], total["tau_down"], total["tau_passes"]) == (1, 2, 4)
    assert total["mean_draft_temperature"] == pytest.approx(0.7)
    assert total["draft_temperature"] == 0.6 and total["cost_factor"] == 1.2  # the latest values
    assert "mean_draft_temperature" not in GuardStats().to_dict()
