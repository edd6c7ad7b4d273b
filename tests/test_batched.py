"""Batched decoding: B = 4 rows of different prompt lengths and different acceptance, each row exactly what batch
size 1 gives (greedy) or the target's law (sampled); rows finish independently; plain batched decoding through
the same loop; input errors."""
import numpy as np
import pytest
import torch

from pipeline import sampling as sampling_module
from pipeline.decoding import DraftLength, DraftPlan, autoregressive_generate, autoregressive_generate_batch, speculative_generate_batch
from pipeline.decoding import batch as batch_module
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from tests.conftest import planned, DECODER_VOCAB as VOCAB, N_SAMPLES, chi_square_pvalue, exact_joint

torch.set_num_threads(1)
PROMPTS = [torch.tensor([3]), torch.tensor([5, 2, 9, 1, 1, 4, 6]), torch.tensor([1, 4, 7]),
           torch.tensor([6, 6, 2, 0, 11])]  # 1 to 7 tokens: left padding of 0 to 6


def plain_rows(target, n: int, prompts=PROMPTS, **kwargs) -> list[list[int]]:
    return [autoregressive_generate(target, p, max_new_tokens=n, **kwargs).tokens.tolist() for p in prompts]


def ragged_passes(stats) -> int:
    """Passes in which the rows still decoding accepted different numbers of drafts."""
    passes = max(len(s.accepted) for s in stats)
    return sum(len({s.accepted[i] for s in stats if i < len(s.accepted)}) > 1 for i in range(passes))


@pytest.mark.parametrize("draft_name", ["close", "far", "same"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_batched_speculative_equals_per_row_plain(target, drafts, draft_name, gamma):
    out = speculative_generate_batch(target, drafts[draft_name], PROMPTS, plan=DraftPlan(gamma), max_new_tokens=24)
    assert [t.tolist() for t in out.tokens] == plain_rows(target, 24)
    for s in out.stats:
        assert s.drafted[0] == 0 and s.accepted[0] == 0  # the prefill pass, as at batch size 1
        assert s.n_generated == 24 and all(0 <= a <= d for a, d in zip(s.accepted, s.drafted))
    if draft_name == "close":  # the rows' committed lengths drift apart: the rollback is ragged
        assert ragged_passes(out.stats) >= 3 and sum(s.n_accepted for s in out.stats) > 0


def test_greedy_equality_rejects_a_rollback_shared_by_the_rows(target, close_draft, monkeypatch):
    """Wrong: a slot is kept for every row when any row keeps it (one rollback for the whole batch), so a row
    that rejected a draft still sees it in its context at the next pass. The equality test above catches it."""
    keep_last = batch_module.RaggedCache.keep_last
    monkeypatch.setattr(batch_module.RaggedCache, "keep_last",
                        lambda self, keep: keep_last(self, keep.any(0, keepdim=True).expand_as(keep)))
    out = speculative_generate_batch(target, close_draft, PROMPTS, plan=DraftPlan(4), max_new_tokens=24)
    assert [t.tolist() for t in out.tokens] != plain_rows(target, 24)


def test_batched_plain_is_the_same_loop_without_drafts(target):
    out = autoregressive_generate_batch(target, PROMPTS, max_new_tokens=20)
    assert [t.tolist() for t in out.tokens] == plain_rows(target, 20)
    assert all(s.drafted == [0] * 20 and s.target_passes == 20 for s in out.stats) and out.target_passes == 20


def test_rows_finish_independently_at_eos_and_max_new_tokens(target, close_draft):
    reference = plain_rows(target, 30)
    eos = [reference[1][4], reference[2][9]]
    expected = []
    for row in reference:
        stop = next((i for i, t in enumerate(row) if t in eos), None)
        expected.append(row if stop is None else row[:stop + 1])
    assert len({len(row) for row in expected}) > 1  # the rows do stop at different points
    for out in (speculative_generate_batch(target, close_draft, PROMPTS, plan=DraftPlan(3), max_new_tokens=30,
                                           eos_token_id=eos),
                autoregressive_generate_batch(target, PROMPTS, max_new_tokens=30, eos_token_id=eos)):
        assert [t.tolist() for t in out.tokens] == expected
        assert out.target_passes == max(s.target_passes for s in out.stats)


def test_greedy_batched_with_a_draft_vocab_subset_equals_per_row_plain(target, close_draft):
    subset = torch.tensor([0, 2, 3, 5, 7, 8, 11, 13])
    out = speculative_generate_batch(target, close_draft, PROMPTS, plan=DraftPlan(3, draft_vocab=subset),
                                     max_new_tokens=20)
    assert [t.tolist() for t in out.tokens] == plain_rows(target, 20)
    assert sum(s.n_accepted for s in out.stats) > 0


@pytest.mark.parametrize("n", [1, 2, 5])
def test_max_new_tokens_is_exact_per_row(target, close_draft, n):
    out = speculative_generate_batch(target, close_draft, PROMPTS, plan=DraftPlan(4), max_new_tokens=n)
    assert [t.tolist() for t in out.tokens] == plain_rows(target, n)


def test_a_batch_of_one_equals_batch_size_one_decoding(target, close_draft):
    for prompt in PROMPTS:
        out = speculative_generate_batch(target, close_draft, [prompt], plan=DraftPlan(3), max_new_tokens=16)
        assert out.tokens[0].tolist() == plain_rows(target, 16, [prompt])[0]


# ---- the law of each row: x2, x3 (the first drafted block) against the exact joint of that row's prompt ----

def batched_joint_counts(target, draft, temperature: float, n: int = N_SAMPLES, **kwargs) -> list[np.ndarray]:
    generator = torch.Generator().manual_seed(0)
    counts = [np.zeros((VOCAB, VOCAB)) for _ in PROMPTS]
    for _ in range(n):
        if draft is None:
            out = autoregressive_generate_batch(target, PROMPTS, sampling=Sampling(temperature), max_new_tokens=4,
                                                generator=generator)
        else:
            out = speculative_generate_batch(target, draft, PROMPTS, sampling=Sampling(temperature), plan=DraftPlan(2, **kwargs),
                                             max_new_tokens=4, generator=generator)
        for row, tokens in zip(counts, out.tokens):
            row[tokens[1], tokens[2]] += 1
    return counts


def row_pvalues(target, counts, temperature: float) -> list[float]:
    return [chi_square_pvalue(c, exact_joint(target, temperature, prompt=p)) for c, p in zip(counts, PROMPTS)]


@pytest.mark.parametrize("draft_name,temperature,kwargs", [
    ("far", 1.0, {}), ("close", 0.6, {}), ("far", 0.7, dict(draft_temperature=1.3)),
    ("close", 1.0, dict(draft_vocab=torch.tensor([0, 1, 2, 4, 6, 9, 10, 12, 14]))), (None, 1.0, {})],
    ids=["far_T1.0", "close_T0.6", "draft_temperature", "draft_vocab", "plain"])
def test_every_row_follows_the_target_distribution(target, drafts, draft_name, temperature, kwargs):
    counts = batched_joint_counts(target, drafts.get(draft_name), temperature, **kwargs)
    pvalues = row_pvalues(target, counts, temperature)
    assert min(pvalues) > 1e-3, pvalues


def test_row_law_test_rejects_resampling_from_target_instead_of_residual(target, far_draft, monkeypatch):
    """The same per-row test a correct batch passes at every row rejects the wrong decoder (at some row: under a
    wrong law one row's p-value still varies by orders of magnitude with the seed)."""
    monkeypatch.setattr(sampling_module, "residual_distribution", lambda p, q: p)
    pvalues = row_pvalues(target, batched_joint_counts(target, far_draft, 1.0), 1.0)
    assert min(pvalues) < 1e-6, pvalues


# ---- input errors ----

@pytest.mark.parametrize("kwargs,message", [
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[torch.tensor([1]), torch.tensor([], dtype=torch.long)]), "empty"),
    (dict(drafting=0), "gamma"),
    (dict(drafting=(2, 2)), "fixed γ"),
    (dict(drafting=DraftLength("heuristic", 2)), "fixed γ"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_batch_input_is_one_clear_error(target, close_draft, kwargs, message):
    kwargs = {"prompts": PROMPTS, **kwargs}
    with pytest.raises(PipelineError, match=message) as info:
        speculative_generate_batch(target, close_draft, kwargs.pop("prompts"), **planned(kwargs))
    assert "\n" not in str(info.value)


# ---- the batch sweep's verdicts (eval.batch_sizes, eval/sweeps.py) ----

def test_the_batch_sweep_compares_break_even_batches_on_its_grid():
    from eval.sweeps import summarize_batches as summarize, within_one_step

    grid = [1, 2, 4, 8]
    assert within_one_step(grid, 4, 8) and within_one_step(grid, None, 8) and within_one_step(grid, 4, 4)
    assert not within_one_step(grid, 2, 8) and not within_one_step(grid, 2, None)
    # B = 1 loses, B = 2 pays, from B = 4 on it loses: break-even 4 (tokens, seconds per batch; three batches)
    rates = {1: 0.7, 2: 1.2, 4: 0.9, 8: 0.6}
    measured = {b: {"plain": [(100, 1.0), (100, 1.1), (100, 0.9)],
                    "speculative": [(100, 1 / r), (100, 1.1 / r), (100, 0.9 / r)],
                    "acceptance": 0.3, "identical": True} for b, r in rates.items()}
    summary = summarize(measured)
    assert summary["break_even"] == 4 and summary["by_batch"][2]["speedup"] == pytest.approx(1.2)
