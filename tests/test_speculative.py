"""The speculative decoder: exactness (greedy and sampled), cache rollback, stopping, stats, input errors."""
import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pipeline import sampling
from pipeline.decoding import DecodeStats, DraftLength, DraftPlan, autoregressive_generate, speculative_generate, uses_sliding_window
from pipeline.decoding.chain import chain_step
from pipeline.decoding.draft_length import HeuristicPolicy, Policy
from pipeline.decoding.loop import Pair, Profile, forward
from pipeline.errors import PipelineError
from pipeline.heads import head_rows
from pipeline.sampling import Sampling, expected_acceptance, logits_to_probs
from tests.conftest import (planned, DECODER_VOCAB as VOCAB, N_SAMPLES, chi_square_pvalue, decoder_llama, exact_joint,
                            random_prompts, small_config, speculative_joint_counts)

torch.set_num_threads(1)


@pytest.mark.parametrize("draft_name", ["close", "far"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_autoregressive(target, drafts, draft_name, gamma):
    accepted = 0
    for prompt in random_prompts(8, seed=gamma):
        expected = autoregressive_generate(target, prompt, max_new_tokens=20).tokens
        out = speculative_generate(target, drafts[draft_name], prompt, plan=DraftPlan(gamma), max_new_tokens=20)
        assert out.tokens.tolist() == expected.tolist()
        accepted += out.stats.n_accepted
    assert accepted > 0 or draft_name == "far"


def test_drafts_agree_often_and_rarely(target, close_draft, far_draft):
    """Guards the fixtures: the tests below need one draft that mostly agrees and one that mostly does not."""
    tokens = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        p = logits_to_probs(target(tokens).logits, 1.0)
        close, far = (logits_to_probs(d(tokens).logits, 1.0) for d in (close_draft, far_draft))
    assert expected_acceptance(p, close).mean() > 0.7 and expected_acceptance(p, far).mean() < 0.5
    assert (p.argmax(-1) == close.argmax(-1)).float().mean() > 0.5 > 0.2 > (p.argmax(-1) == far.argmax(-1)).float().mean()


def test_greedy_with_draft_vocab_subset_equals_autoregressive(target, close_draft):
    subset = torch.tensor([0, 2, 3, 5, 7, 8, 11, 13])
    for prompt in random_prompts(4, seed=11):
        expected = autoregressive_generate(target, prompt, max_new_tokens=16).tokens
        out = speculative_generate(target, close_draft, prompt, plan=DraftPlan(3, draft_vocab=subset), max_new_tokens=16)
        assert out.tokens.tolist() == expected.tolist()


def test_greedy_target_with_a_sampling_draft_equals_autoregressive(target, far_draft):
    """temperature 0 with draft_temperature > 0 takes the general accept/residual path with a one-hot p."""
    generator = torch.Generator().manual_seed(7)
    for prompt in random_prompts(4, seed=12):
        expected = autoregressive_generate(target, prompt, max_new_tokens=16).tokens
        out = speculative_generate(target, far_draft, prompt, plan=DraftPlan(3, draft_temperature=1.0),
                                   generator=generator, max_new_tokens=16)
        assert out.tokens.tolist() == expected.tolist()


# ---- draft-length policies: the same exactness whatever decides how many tokens are drafted ----
POLICIES = {"confidence": DraftLength("confidence", 16, 0.5), "confidence_low": DraftLength("confidence", 16, 0.05),
            "heuristic": DraftLength("heuristic", 2)}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("draft_name", ["close", "far"])
def test_greedy_speculative_equals_autoregressive_with_every_policy(target, drafts, draft_name, policy):
    lengths = set()
    for prompt in random_prompts(6, seed=21):
        expected = autoregressive_generate(target, prompt, max_new_tokens=24).tokens
        out = speculative_generate(target, drafts[draft_name], prompt, plan=DraftPlan(POLICIES[policy]),
                                   max_new_tokens=24)
        assert out.tokens.tolist() == expected.tolist()
        lengths.update(out.stats.drafted[1:-1])  # the first pass is the plain prefill, the last is clamped
    assert len(lengths) > 1, f"{policy} drafted a constant length {lengths}: the policy never acted"


def test_confidence_policy_stops_at_the_first_unsure_token(target, close_draft):
    """Greedy: the draft keeps proposing while its probability of its own argmax is ≥ the threshold; the
    first token below it is still proposed, then the block ends."""
    prompt = random_prompts(1, seed=3)[0]
    out = speculative_generate(target, close_draft, prompt, plan=DraftPlan(DraftLength("confidence", 16, 0.6)),
                               max_new_tokens=30)
    seq = torch.cat([prompt, out.tokens])
    assert out.stats.drafted[0] == 0  # the plain prefill pass: its one token precedes the first block
    position = len(prompt) + 1
    with torch.inference_mode():
        for drafted, accepted in zip(out.stats.drafted[1:-1], out.stats.accepted[1:-1]):
            confidences = []
            context = seq[:position]
            for _ in range(drafted):
                probs = close_draft(context.view(1, -1)).logits[0, -1].softmax(-1)
                confidences.append(float(probs.max()))
                context = torch.cat([context, probs.argmax().view(1)])
            assert all(c >= 0.6 for c in confidences[:-1]), confidences
            assert drafted == 16 or confidences[-1] < 0.6, confidences
            position += accepted + 1


def test_heuristic_policy_follows_hf_schedule():
    policy = HeuristicPolicy(5)
    policy.update(5, 5)
    assert policy.budget() == 7  # every draft accepted: +2
    policy.update(7, 3)
    assert policy.budget() == 6  # a rejection: −1
    for _ in range(10):
        policy.update(policy.budget(), 0)
    assert policy.budget() == 1  # never below one


@pytest.mark.parametrize("values,message", [
    (dict(policy="longest"), "unknown draft-length policy"),
    (dict(policy="confidence", max=16, threshold=1.5), "must be in \\(0, 1\\)"),
    (dict(policy="confidence", max=16, threshold=None), "must be in \\(0, 1\\)"),
    (dict(policy="fixed", max=0), "must be an integer >= 1"),
    (dict(policy="fixed", max=4, extra=1), "unknown keys"),
])
def test_bad_draft_length_is_one_clear_error(values, message):
    with pytest.raises(PipelineError, match=message):
        DraftLength.from_dict(values)


# ---- distribution: chi-square of speculative samples against the target's exact joint of 2 tokens ----
# (exact_joint, speculative_joint_counts, chi_square_pvalue and N_SAMPLES are in conftest, shared with test_tree)

@pytest.mark.parametrize("draft_name,kwargs", [
    ("far", dict(temperature=1.0)),
    ("close", dict(temperature=0.6)),
    ("far", dict(temperature=0.8, top_k=5)),
    ("far", dict(temperature=1.0, top_p=0.7)),
    ("far", dict(temperature=0.7, draft_temperature=1.3)),
    ("close", dict(temperature=1.0, draft_vocab=torch.tensor([0, 1, 2, 4, 6, 9, 10, 12, 14]))),
], ids=["T1.0", "T0.6", "top_k", "top_p", "draft_temperature", "draft_vocab"])
def test_speculative_samples_follow_target_distribution(target, drafts, draft_name, kwargs):
    probs = exact_joint(target, kwargs["temperature"], kwargs.get("top_k", 0), kwargs.get("top_p", 1.0))
    counts = speculative_joint_counts(target, drafts[draft_name], N_SAMPLES, **kwargs)
    assert chi_square_pvalue(counts, probs) > 1e-3


@pytest.mark.parametrize("policy", [DraftLength("confidence", 16, 0.3), DraftLength("heuristic", 1)],
                         ids=["confidence", "heuristic"])
def test_speculative_samples_follow_target_distribution_with_every_policy(target, drafts, policy):
    """A stop that depends on the drafted token's own probability, and a length that depends on past
    acceptance: both still give exactly the target's distribution."""
    probs = exact_joint(target, 0.8)
    counts = speculative_joint_counts(target, drafts["close"], N_SAMPLES, temperature=0.8, drafting=policy)
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_distribution_test_rejects_resampling_from_target_instead_of_residual(target, far_draft, monkeypatch):
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p)
    counts = speculative_joint_counts(target, far_draft, N_SAMPLES, temperature=1.0)
    assert chi_square_pvalue(counts, exact_joint(target, 1.0)) < 1e-6


# ---- cache rollback ----

def run_one_step(target, draft, prompt, gamma, temperature, generator):
    seq = prompt.view(1, -1)
    caches = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    p = Sampling(temperature)
    pair = Pair(target, draft, head_rows(target), head_rows(draft), p, p, generator=generator)
    stats = DecodeStats()
    with torch.inference_mode():
        seq, new = chain_step(pair, seq, caches, gamma, Policy(gamma), stats, Profile("cpu"))
    return seq, caches, (pair.target_head, pair.draft_head), new, stats.accepted[0]


def assert_cache_continues_like_a_fresh_forward(model, seq, cache, head):
    pending = seq[:, cache.get_seq_length():]
    with torch.inference_mode():
        cached = forward(model, pending, cache, head)[0]
        fresh = model(seq).logits[0, -1]
    torch.testing.assert_close(cached, fresh.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("draft_name,temperature,expect_all", [
    ("far", 0.0, False), ("close", 0.0, None), ("same", 0.0, True), ("far", 1.0, None), ("close", 1.0, None)])
def test_caches_hold_exactly_the_accepted_prefix(target, drafts, draft_name, temperature, expect_all):
    gamma = 4
    generator = torch.Generator().manual_seed(3)
    for prompt in random_prompts(6, seed=21):
        seq, (target_cache, draft_cache), heads, new, n = run_one_step(target, drafts[draft_name], prompt, gamma,
                                                                       temperature, generator)
        assert seq.shape[1] == len(prompt) + n + 1 and seq[0, len(prompt):].tolist() == new
        if expect_all is not None:
            assert (n == gamma) == expect_all
        # Target: everything but the newest token; draft: all accepted tokens it has fed, at most γ-1 drafts.
        assert target_cache.get_seq_length() == seq.shape[1] - 1
        assert draft_cache.get_seq_length() == len(prompt) + min(n, gamma - 1)
        assert_cache_continues_like_a_fresh_forward(target, seq, target_cache, heads[0])
        assert_cache_continues_like_a_fresh_forward(drafts[draft_name], seq, draft_cache, heads[1])


# ---- stopping exactly where autoregressive decoding stops ----

def greedy_reference(target, prompt, n):
    return autoregressive_generate(target, prompt, max_new_tokens=n).tokens.tolist()


def test_eos_inside_an_accepted_block_ends_generation_there(target):
    prompt = torch.tensor([4, 1, 7])
    reference = greedy_reference(target, prompt, 30)
    eos = reference[2]
    stop = reference.index(eos)  # first occurrence, inside the first block (tokens 1..6, after the prefill's)
    assert stop >= 1
    out = speculative_generate(target, target, prompt, plan=DraftPlan(5), eos_token_id=eos, max_new_tokens=30)
    assert out.tokens.tolist() == reference[:stop + 1]
    assert out.stats.accepted[1] >= stop  # the EOS was an accepted draft token, not the bonus token
    ar = autoregressive_generate(target, prompt, eos_token_id=eos, max_new_tokens=30)
    assert ar.tokens.tolist() == reference[:stop + 1]


def test_eos_as_a_list_stops_at_the_first_of_any(target, close_draft):
    prompt = torch.tensor([2, 8])
    reference = greedy_reference(target, prompt, 30)
    eos = [reference[9], reference[5]]
    stop = min(reference.index(e) for e in eos)
    out = speculative_generate(target, close_draft, prompt, plan=DraftPlan(3), eos_token_id=eos, max_new_tokens=30)
    assert out.tokens.tolist() == reference[:stop + 1]
    sampled = speculative_generate(target, close_draft, prompt, sampling=Sampling(temperature=1.0), plan=DraftPlan(3),
                                   eos_token_id=eos, generator=torch.Generator().manual_seed(0), max_new_tokens=200).tokens.tolist()
    assert sampled[-1] in eos and not set(sampled[:-1]) & set(eos)


@pytest.mark.parametrize("max_new_tokens,gamma", [(8, 5), (3, 10), (1, 4), (7, 3)])
def test_max_new_tokens_is_exact_and_gamma_is_clamped(target, max_new_tokens, gamma):
    prompt = torch.tensor([5, 6, 7])
    out = speculative_generate(target, target, prompt, plan=DraftPlan(gamma), max_new_tokens=max_new_tokens)
    assert out.tokens.tolist() == greedy_reference(target, prompt, max_new_tokens)
    assert len(out.tokens) == max_new_tokens
    # The first pass is the plain prefill (no drafts, one token); then the identical draft accepts everything,
    # so each step drafts exactly what still fits before the bonus.
    remaining, expected_drafted = max_new_tokens - 1, [0]
    while remaining > 0:
        expected_drafted.append(min(gamma, remaining - 1))
        remaining -= expected_drafted[-1] + 1
    assert out.stats.drafted == expected_drafted


# ---- stats ----

@pytest.mark.parametrize("eos_token_id", [None, 3])
def test_stats_are_consistent(target, close_draft, eos_token_id):
    generator = torch.Generator().manual_seed(1)
    for prompt in random_prompts(5, seed=31):
        out = speculative_generate(target, close_draft, prompt, sampling=Sampling(temperature=1.0), plan=DraftPlan(4),
                                   eos_token_id=eos_token_id, generator=generator, max_new_tokens=40)
        s = out.stats
        assert all(0 <= a <= d for a, d in zip(s.accepted, s.drafted)) and s.n_accepted <= s.n_drafted
        # Each model's first forward (the one reading the prompt) is timed as prefill, not as a step.
        assert s.target_passes == len(s.accepted) == len(s.drafted) == len(s.target_times) + 1
        assert len(s.draft_times) == s.n_drafted - 1
        truncated = sum(a + 1 for a in s.accepted) - len(out.tokens)
        assert truncated == 0 or (eos_token_id is not None and out.tokens[-1] == eos_token_id
                                  and truncated <= s.accepted[-1])
        assert s.n_generated == len(out.tokens)
        assert s.mean_accepted_length == pytest.approx(len(out.tokens) / s.target_passes)
        assert s.total_time >= s.prefill_time + sum(s.draft_times) + sum(s.target_times)


def test_stats_carry_per_forward_times_on_cpu(target, close_draft):
    """Stopwatch marks resolve after the call into one time per forward (first ones as prefill), in seconds."""
    out = speculative_generate(target, close_draft, torch.tensor([1, 2, 3]), plan=DraftPlan(3), max_new_tokens=16)
    s = out.stats
    assert len(s.target_times) == s.target_passes - 1 and len(s.draft_times) == s.n_drafted - 1
    # structure, not speed: every part is a positive duration and the parts fit inside the total
    assert all(t > 0 for t in s.draft_times + s.target_times) and s.prefill_time > 0
    assert s.sampling_time > 0 and s.cache_time > 0
    parts = s.prefill_time + sum(s.draft_times) + sum(s.target_times) + s.sampling_time + s.cache_time
    assert parts <= s.total_time
    ar = autoregressive_generate(target, torch.tensor([1, 2, 3]), max_new_tokens=8).stats
    assert len(ar.target_times) == 7 and all(t > 0 for t in ar.target_times) and ar.prefill_time > 0


def test_autoregressive_stats_count_one_token_per_pass(target):
    out = autoregressive_generate(target, torch.tensor([[1, 2, 3]]), sampling=Sampling(temperature=0.8), generator=torch.Generator().manual_seed(0), max_new_tokens=12)
    assert len(out.tokens) == out.stats.target_passes == len(out.stats.target_times) + 1 == 12
    assert out.stats.mean_accepted_length == 1.0


# ---- input validation ----

def other_vocab_draft():
    return decoder_llama(2, vocab=VOCAB + 4)


@pytest.mark.parametrize("case,kwargs", [
    ("gamma", dict(drafting=0)),
    ("drafting", dict(drafting="four")),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("sampling", dict(sampling=0.7)),
    ("temperature", dict(sampling=dict(temperature=-1.0))),
    ("top_p_zero", dict(sampling=dict(top_p=0.0))),
    ("top_p_above_one", dict(sampling=dict(top_p=1.2))),
    ("top_k", dict(sampling=dict(top_k=-2))),
    ("draft_temperature", dict(draft_temperature=-0.5)),
    ("draft_vocab_range", dict(draft_vocab=torch.tensor([0, VOCAB]))),
    ("batch", dict(input_ids=torch.zeros(2, 3, dtype=torch.long))),
    ("empty_prompt", dict(input_ids=torch.zeros(0, dtype=torch.long))),
])
def test_bad_input_raises_one_line_pipeline_error(target, close_draft, case, kwargs):
    kwargs = {"input_ids": torch.tensor([1, 2]), **kwargs}
    with pytest.raises(PipelineError) as info:
        if isinstance(kwargs.get("sampling"), dict):  # the Sampling type itself refuses a bad distribution
            kwargs["sampling"] = Sampling(**kwargs["sampling"])
        speculative_generate(target, close_draft, **planned(kwargs))
    assert "\n" not in str(info.value)


def test_draft_with_another_vocabulary_is_refused(target):
    with pytest.raises(PipelineError, match="vocabulary"):
        speculative_generate(target, other_vocab_draft(), torch.tensor([1, 2]))


def test_draft_on_another_device_is_refused(target, close_draft):
    draft = copy.deepcopy(close_draft).to("meta")  # a device other than the target's, without needing a GPU
    with pytest.raises(PipelineError, match="device"):
        speculative_generate(target, draft, torch.tensor([1, 2]))


def test_sliding_window_models_are_refused(target):
    """A sliding-window KV cache forgets tokens, so it cannot be cropped back after a rejected draft."""
    torch.manual_seed(0)
    mistral = MistralForCausalLM(small_config(MistralConfig, sliding_window=8)).eval()
    for pair in ((target, mistral), (mistral, target)):
        with pytest.raises(PipelineError, match="sliding-window") as info:
            speculative_generate(*pair, torch.tensor([1, 2]), max_new_tokens=4)
        assert "\n" not in str(info.value)
    qwen_windowed = small_config(Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert uses_sliding_window(qwen_windowed)


def test_full_attention_configs_with_a_sliding_window_field_are_accepted():
    # Qwen2 checkpoints ship `sliding_window` with `use_sliding_window: false`: they attend fully.
    qwen = small_config(Qwen2Config, use_sliding_window=False, initializer_range=0.2)
    qwen.sliding_window = 4096
    assert not uses_sliding_window(qwen)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen).eval()
    prompt = torch.tensor([1, 2, 3])
    expected = autoregressive_generate(model, prompt, max_new_tokens=8).tokens
    assert speculative_generate(model, model, prompt, plan=DraftPlan(3), max_new_tokens=8).tokens.tolist() == expected.tolist()
    assert not uses_sliding_window(small_config(LlamaConfig))
    assert uses_sliding_window(small_config(MistralConfig, sliding_window=8))
    assert not uses_sliding_window(small_config(MistralConfig, sliding_window=None))


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=0), dict(sampling=None), dict(temperature=-1.0),
                                    dict(top_p=2.0)])
def test_autoregressive_bad_input_raises_pipeline_error(target, kwargs):
    with pytest.raises(PipelineError):
        if "max_new_tokens" in kwargs or "sampling" in kwargs:
            autoregressive_generate(target, torch.tensor([1, 2]), **kwargs)
        else:
            autoregressive_generate(target, torch.tensor([1, 2]), sampling=Sampling(**kwargs))


# ---- real model ----

CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers."]


@pytest.mark.smoke
def test_greedy_speculative_equals_autoregressive_on_real_model(real_target):
    from pipeline.modelio.models import derive_draft

    torch.set_num_threads(1)
    model, tokenizer = real_target
    draft = derive_draft(model, [0, 1])
    for prompt in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        expected = autoregressive_generate(model, ids, eos_token_id=tokenizer.eos_token_id, max_new_tokens=24)
        out = speculative_generate(model, draft, ids, plan=DraftPlan(4), eos_token_id=tokenizer.eos_token_id,
                                   max_new_tokens=24)
        assert out.tokens.tolist() == expected.tokens.tolist()
