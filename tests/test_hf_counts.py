"""HF assisted generation's own drafted and accepted tokens per target pass, counted from forward hooks
(pipeline/engines/hf.py PassCounter), so its acceptance sits beside our decoder's at equal policy."""
from __future__ import annotations

import torch

from pipeline.engines.hf import assistant_configs, hf_generate
from pipeline.sampling import Sampling
from tests.conftest import decoder_llama


def test_a_draft_equal_to_the_target_has_every_draft_accepted():
    target, draft = decoder_llama(0), decoder_llama(0)  # the same weights, another module: hooks see the target only
    config = assistant_configs(draft, 4)["fixed"]
    tokens, stats = hf_generate(target, torch.tensor([[1, 2, 3]]), 17, Sampling(), [15], draft, config)
    assert len(tokens) == 17 == stats.n_generated
    assert stats.accepted == stats.drafted[:len(stats.accepted)] and sum(stats.accepted) > 0
    assert sum(a + 1 for a in stats.accepted) >= stats.n_generated  # the last pass may be cut by max_new_tokens
    assert stats.acceptance_rate == 1.0


def test_counts_add_up_for_a_draft_that_disagrees():
    target, draft = decoder_llama(0), decoder_llama(5)
    config = assistant_configs(draft, 3)["fixed"]
    tokens, stats = hf_generate(target, torch.tensor([[1, 2, 3]]), 20, Sampling(), [15], draft, config)
    assert len(tokens) == stats.n_generated
    assert all(0 <= a <= d <= 3 for a, d in zip(stats.accepted, stats.drafted))
    assert sum(stats.accepted) + stats.target_passes == len(tokens)  # every pass yields accepted + 1 tokens
    assert 0.0 <= stats.acceptance_rate < 1.0
    plain, none = hf_generate(target, torch.tensor([[1, 2, 3]]), 20, Sampling(), [15])
    assert none is None and plain == tokens  # greedy: assisted generation is lossless
