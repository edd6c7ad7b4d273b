"""Streaming: the chunks each target pass commits, for chains, trees and plain decoding; the same tokens as the
generate functions (which collect the stream), the target's exact law, and a first token from a plain prefill."""
import numpy as np
import pytest
import torch

from pipeline.decoding import (DraftLength, DraftPlan, autoregressive_generate, autoregressive_stream, chain,
                               speculative_generate, speculative_stream)
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from tests.conftest import (DECODER_VOCAB as VOCAB, JOINT_PROMPT, N_SAMPLES, chi_square_pvalue, exact_joint,
                            random_prompts)

torch.set_num_threads(1)
DRAFTINGS = {"chain": 3, "heuristic": DraftLength("heuristic", 2), "confidence": DraftLength("confidence", 8, 0.4),
             "tree": (2, 2), "parents": [-1, -1, 0, 1, 2]}


def flat(chunks) -> list[int]:
    return [t for chunk in chunks for t in chunk]


def stream_of(target, draft, prompt, drafting, **kwargs):
    if drafting is None:
        return autoregressive_stream(target, prompt, **kwargs)
    return speculative_stream(target, draft, prompt, plan=DraftPlan(drafting), **kwargs)


@pytest.mark.parametrize("name", [*DRAFTINGS, "plain"])
def test_stream_concatenated_equals_generate_for_the_same_seed(target, close_draft, name):
    drafting = DRAFTINGS.get(name)
    kwargs = dict(sampling=Sampling(1.0), max_new_tokens=30, eos_token_id=3)
    for k, prompt in enumerate(random_prompts(4, seed=41)):
        stream = stream_of(target, close_draft, prompt, drafting, generator=torch.Generator().manual_seed(k), **kwargs)
        chunks = list(stream)
        if drafting is None:
            out = autoregressive_generate(target, prompt, generator=torch.Generator().manual_seed(k), **kwargs)
        else:
            out = speculative_generate(target, close_draft, prompt, plan=DraftPlan(drafting),
                                       generator=torch.Generator().manual_seed(k), **kwargs)
        assert flat(chunks) == out.tokens.tolist()
        s = stream.stats
        assert [len(c) for c in chunks] == s.chunk_tokens and len(s.chunk_times) == len(chunks) == s.target_passes
        assert s.n_generated == len(flat(chunks)) and all(a <= b for a, b in zip(s.chunk_times, s.chunk_times[1:]))
        if drafting is not None:  # each chunk is one pass's accepted + 1 tokens (the last cut at an EOS)
            assert [len(c) for c in chunks[:-1]] == [a + 1 for a in s.accepted[:-1]]
            assert 1 <= len(chunks[-1]) <= s.accepted[-1] + 1
        else:
            assert all(len(c) == 1 for c in chunks)


@pytest.mark.parametrize("name", list(DRAFTINGS))
@pytest.mark.parametrize("draft_name", ["close", "far"])
def test_greedy_speculative_stream_equals_greedy_plain(target, drafts, name, draft_name):
    for prompt in random_prompts(5, seed=43):
        plain = flat(autoregressive_stream(target, prompt, max_new_tokens=24))
        assert flat(speculative_stream(target, drafts[draft_name], prompt, plan=DraftPlan(DRAFTINGS[name]),
                                       max_new_tokens=24)) == plain


class ForwardCounter:
    """Counts the base-model forwards of a model (what `loop.forward` calls, for chains and trees)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


@pytest.mark.parametrize("name", list(DRAFTINGS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_first_chunk_is_one_token_from_a_target_pass_without_drafts(target, close_draft, name, temperature):
    """The first token comes from the prefill pass alone: one target forward, no draft forward (the draft
    reads the prompt in the second pass); it is plain decoding's first token for the same seed."""
    prompt = torch.tensor([4, 1, 7, 2])
    sampling = Sampling(temperature)
    plain = autoregressive_generate(target, prompt, sampling=sampling, max_new_tokens=1,
                                    generator=torch.Generator().manual_seed(5)).tokens.tolist()
    counters = ForwardCounter(target), ForwardCounter(close_draft)
    try:
        stream = speculative_stream(target, close_draft, prompt, sampling=sampling, plan=DraftPlan(DRAFTINGS[name]),
                                    max_new_tokens=20, generator=torch.Generator().manual_seed(5))
        chunks = iter(stream)
        first = next(chunks)
        assert (counters[0].calls, counters[1].calls) == (1, 0)
        assert first == plain
        second = next(chunks)
        assert counters[0].calls == 2 and counters[1].calls >= 1 and len(second) >= 1  # speculation starts
        rest = list(chunks)
    finally:
        for counter in counters:
            counter.handle.remove()
    s = stream.stats
    assert s.drafted[0] == 0 and s.accepted[0] == 0 and s.chunk_tokens[0] == 1 and s.n_drafted > 0
    assert len(first + second + flat(rest)) == 20


def test_ttft_and_inter_token_latency_come_from_the_chunk_times(target, close_draft):
    """Structure, not speed: TTFT is the first commit; the mean inter-token latency
    spreads the later commits over the later tokens; per-token gaps split each chunk's gap over its tokens."""
    stream = speculative_stream(target, close_draft, torch.tensor([1, 2, 3]), plan=DraftPlan(3), max_new_tokens=25)
    list(stream)
    s = stream.stats
    assert 0 < s.ttft == s.chunk_times[0] < s.chunk_times[1] and s.chunk_times[-1] <= s.total_time
    assert s.mean_itl == pytest.approx((s.chunk_times[-1] - s.chunk_times[0]) / (25 - 1))
    gaps = s.token_gaps()
    assert len(gaps) == 25 - s.chunk_tokens[0] and sum(gaps) == pytest.approx(s.chunk_times[-1] - s.chunk_times[0])
    plain = autoregressive_stream(target, torch.tensor([1, 2, 3]), max_new_tokens=6)
    list(plain)
    assert len(plain.stats.chunk_times) == 6 and plain.stats.token_gaps() == pytest.approx(
        np.diff(plain.stats.chunk_times).tolist())


def test_closing_a_stream_early_stops_decoding_with_stats_of_what_was_committed(target, close_draft):
    stream = speculative_stream(target, close_draft, torch.tensor([1, 2, 3]), plan=DraftPlan(3), max_new_tokens=40)
    chunks = iter(stream)
    committed = next(chunks) + next(chunks)
    stream.close()
    s = stream.stats
    assert s.n_generated == len(committed) and s.target_passes == 2 and s.total_time > 0 and len(s.chunk_times) == 2


def test_bad_input_raises_when_the_stream_is_made(target, close_draft):
    with pytest.raises(PipelineError):
        speculative_stream(target, close_draft, torch.tensor([1, 2]), max_new_tokens=0)
    with pytest.raises(PipelineError):
        autoregressive_stream(target, torch.zeros(2, 3, dtype=torch.long))


# ---- the law of the tokens a stream yields: x2, x3 (the first drafted block) against the exact joint ----

def stream_joint_counts(target, draft, drafting, temperature: float, n: int = N_SAMPLES) -> np.ndarray:
    generator, counts = torch.Generator().manual_seed(0), np.zeros((VOCAB, VOCAB))
    for _ in range(n):
        x = flat(speculative_stream(target, draft, JOINT_PROMPT, sampling=Sampling(temperature),
                                    plan=DraftPlan(drafting), max_new_tokens=4, generator=generator))
        counts[x[1], x[2]] += 1
    return counts


@pytest.mark.parametrize("drafting,temperature", [(2, 1.0), ((2, 2), 0.8)], ids=["chain", "tree"])
def test_streamed_tokens_follow_the_target_distribution(target, far_draft, drafting, temperature):
    counts = stream_joint_counts(target, far_draft, drafting, temperature)
    assert chi_square_pvalue(counts, exact_joint(target, temperature)) > 1e-3


def test_stream_law_test_rejects_a_stream_that_commits_drafts_unverified(target, far_draft, monkeypatch):
    """Wrong: every drafted token is committed as proposed (then the target's bonus token), i.e. a stream that
    sends the drafts before the verify pass has judged them."""
    def accept_everything(pair, logits, drafts, qs):
        n = torch.tensor(drafts.shape[0])
        return n, pair.p.probs(logits[-1:]).multinomial(1, generator=pair.generator)[0, 0]

    monkeypatch.setattr(chain, "verify_block", accept_everything)
    counts = stream_joint_counts(target, far_draft, 2, 1.0)
    assert chi_square_pvalue(counts, exact_joint(target, 1.0)) < 1e-6


# ---- eval: TTFT and inter-token latency from the commit times ----

def latency_record(method: str, prompt: int, ttft: float, sizes: list[int], gap: float) -> dict:
    """A timed request whose chunks of `sizes` tokens were committed `gap` seconds apart after `ttft`."""
    from pipeline.decoding import DecodeStats

    times = [ttft + gap * i for i in range(len(sizes))]
    stats = DecodeStats(accepted=[k - 1 for k in sizes], drafted=[0] + [3] * (len(sizes) - 1), chunk_times=times,
                        chunk_tokens=sizes, n_generated=sum(sizes), target_passes=len(sizes))
    return {"method": method, "domain": "chat", "prompt_id": f"p{prompt}", "turn": 0, "tokens": [0] * sum(sizes),
            "time_s": times[-1], "stats": stats}


def test_eval_reports_ttft_and_itl_and_their_ratios_to_plain_decoding():
    """Plain: 1 token every 10 ms; speculative: the same first token, then 4 tokens every 20 ms (5 ms per token):
    TTFT ratio 1, ITL speedup 2, per-token gaps 5 ms; the report renders the row."""
    from eval import metrics as M
    from eval.tables import latency_rows

    records = []
    for prompt in range(6):
        ttft = 0.05 * (1 + prompt)
        records.append(latency_record("autoregressive", prompt, ttft, [1] * 13, 0.010))
        records.append(latency_record("speculative", prompt, ttft, [1, 4, 4, 4], 0.020))
    summary = M.summarize(records, greedy=False)
    ar, spec = summary["autoregressive"], summary["speculative"]
    assert ar["ttft_p50_s"] == pytest.approx(spec["ttft_p50_s"]) == pytest.approx(0.175)
    assert ar["itl_mean_s"] == pytest.approx(0.010) and spec["itl_mean_s"] == pytest.approx(0.005)
    assert spec["itl_p50_s"] == pytest.approx(0.005) and spec["itl_p95_s"] == pytest.approx(0.005)
    assert spec["ttft_ratio"] == pytest.approx(1.0) and spec["ttft_ratio_ci95"] == pytest.approx([1.0, 1.0])
    assert spec["itl_speedup"] == pytest.approx(2.0)
    metrics = {"domains": {"chat": summary}, "overall": summary, "methods": ["autoregressive", "speculative"]}
    header, rows = latency_rows(metrics)
    assert [row[:2] for row in rows] == [["chat", "autoregressive"], ["chat", "speculative"],
                                         ["overall", "autoregressive"], ["overall", "speculative"]]
    assert rows[1][header.index("ITL mean (ms)")] == "5.0" and rows[1][header.index("ITL speedup")].startswith("2.00×")
