"""The sampling and acceptance math in pipeline/sampling.py (p = target, q = draft)."""
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pipeline import sampling
from pipeline.decoding.cost import predicted_speedup
from pipeline.sampling import (expected_acceptance, expected_accepted_length,
                           logits_to_probs, residual_distribution, sample, validate_sampling, verify_draft)
from pipeline.errors import PipelineError

torch.set_num_threads(1)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=1.0, top_p=0.0),
                                    dict(temperature=1.0, top_p=1.5), dict(temperature=1.0, top_k=-1)])
def test_validate_sampling_rejects_settings_without_a_distribution(kwargs):
    with pytest.raises(PipelineError) as info:
        validate_sampling(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("settings, kept", [((0.0, 0, 1.0), 1), ((0.7, 5, 0.9), None), ((1.0, 0, 1.0), 11),
                                             ((1.0, 11, 1.0), 11), ((1.0, 1, 1.0), 1), ((2.0, 0, 1e-9), 1)])
def test_validate_sampling_accepts_greedy_and_off_filters(settings, kept):
    """Greedy, off filters and the edges of each range are accepted, and each defines a distribution: the one
    logits_to_probs then gives (with `kept` tokens of non-zero probability, where that is fixed by the filters)."""
    assert validate_sampling(*settings) is None
    assert sampling.Sampling(*settings).greedy == (settings[0] == 0)
    probs = logits_to_probs(torch.randn(11, generator=torch.Generator().manual_seed(3)), *settings)
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))
    if kept is not None:
        assert int((probs > 0).sum()) == kept
    else:
        assert 1 <= int((probs > 0).sum()) <= 5


def test_temperature_zero_is_one_hot_argmax_on_batched_logits():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, 0.0)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3, 5))


def test_probs_are_fp32_for_bf16_logits():
    probs = logits_to_probs(torch.randn(4, 7).bfloat16(), 0.8, top_k=3, top_p=0.9)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_top_p_keeps_the_smallest_nucleus_reaching_top_p_and_at_least_one_token():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert (logits_to_probs(logits, 1.0, top_p=0.79) > 0).sum() == 2
    assert (logits_to_probs(logits, 1.0, top_p=0.81) > 0).sum() == 3
    assert torch.equal(logits_to_probs(logits, 1.0, top_p=1e-6), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_p=0.79), torch.tensor([0.625, 0.375, 0, 0]))


def test_top_k_keeps_k_tokens_and_zero_means_off():
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(1))
    assert torch.equal((logits_to_probs(logits, 1.0, top_k=5) > 0).sum(-1), torch.full((6,), 5))
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k=0), logits.softmax(-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.6, 0, 0.8), (1.3, 8, 0.9)])
def test_filtering_matches_hf_logits_warpers(temperature, top_k, top_p):
    """The decoder must sample from the same distribution the target is served with by HF generate."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2)) * 3
    hf = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1:
        hf = TopPLogitsWarper(top_p)(None, hf)
    torch.testing.assert_close(logits_to_probs(logits, temperature, top_k, top_p), hf.softmax(-1))


def test_sample_follows_probs_and_is_reproducible_with_a_generator():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    draws = sample(probs.expand(20000, 5), torch.Generator().manual_seed(3))
    counts = torch.bincount(draws, minlength=5)
    assert counts[4] == 0
    assert chisquare(counts[:4].numpy(), probs[:4].numpy() * 20000).pvalue > 1e-3
    again = sample(probs.expand(20000, 5), torch.Generator().manual_seed(3))
    assert torch.equal(draws, again)


def test_residual_is_normalised_positive_part_with_fallback_to_p():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p), p)  # rejection impossible: anything is exact
    batched = residual_distribution(torch.stack([p, q]), torch.stack([q, q]))
    torch.testing.assert_close(batched, torch.stack([torch.tensor([1.0, 0, 0]), q]))


def test_expected_acceptance_is_one_minus_total_variation():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(expected_acceptance(p, q), 1 - 0.5 * (p - q).abs().sum())
    assert expected_acceptance(p, p) == pytest.approx(1.0)
    assert expected_acceptance(torch.tensor([1.0, 0]), torch.tensor([0, 1.0])) == 0
    assert expected_acceptance(torch.stack([p, q]), torch.stack([q, q])).shape == (2,)


def test_expected_accepted_length_and_walltime_follow_leviathan_eq1():
    assert expected_accepted_length(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_accepted_length(0.0, 4) == 1.0 and expected_accepted_length(1.0, 4) == 5.0
    alphas = torch.tensor([0.0, 0.8, 1.0])
    torch.testing.assert_close(expected_accepted_length(alphas, 4), torch.tensor([1.0, 3.3616, 5.0]))
    # Leviathan et al. 2023, Thm 3.8: i.i.d. acceptance α and free verification, (1 − α^(γ+1)) / ((1 − α)(γc + 1))
    assert predicted_speedup(expected_accepted_length(0.8, 4) - 1, 4, 0.05, 1.0) == pytest.approx(3.3616 / 1.2)
    assert predicted_speedup(expected_accepted_length(0.8, 4) - 1, 4, 0.0, 1.0) == pytest.approx(3.3616)


def _random_dist(generator, size, sharpness=2.0):
    return (torch.randn(size, generator=generator) * sharpness).softmax(-1)


def _one_token_pvalue(n_samples: int = 4000) -> float:
    """Chi-square p-value of the token one verify step emits (a q-sample, accepted or resampled) against p."""
    g = torch.Generator().manual_seed(4)
    p, q = _random_dist(g, 6), _random_dist(g, 6)
    counts = torch.zeros(6)
    for _ in range(n_samples):
        x = sample(q, g).view(1)
        n, nxt = verify_draft(torch.stack([p, p]), q.view(1, 6), x, g)
        counts[x[0] if n == 1 else nxt] += 1
    return chisquare(counts.numpy(), p.numpy() * n_samples).pvalue


def test_verify_draft_output_token_is_distributed_as_p():
    """The speculative sampling theorem: a q-sample, accepted or resampled from the residual, is a p-sample."""
    assert _one_token_pvalue() > 1e-3


def test_verify_draft_with_residual_replaced_by_p_is_biased(monkeypatch):
    """The same check catches the classic bug of resampling from the target instead of the residual."""
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    assert _one_token_pvalue() < 1e-6


def test_verify_draft_stops_at_first_rejection_and_bonus_when_all_accepted():
    one_hot = torch.eye(5)
    p = one_hot[[1, 2, 3, 4]]  # greedy target wants 1, 2, 3 then bonus 4
    n, nxt = verify_draft(p, one_hot[[1, 2, 0]], torch.tensor([1, 2, 0]))
    assert (n.item(), nxt.item()) == (2, 3)
    n, nxt = verify_draft(p, one_hot[[1, 2, 3]], torch.tensor([1, 2, 3]))
    assert (n.item(), nxt.item()) == (3, 4)
    n, nxt = verify_draft(p, one_hot[[0, 2, 3]], torch.tensor([0, 2, 3]))
    assert (n.item(), nxt.item()) == (0, 1)
