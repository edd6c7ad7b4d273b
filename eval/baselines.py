"""Peer baselines: HF `generate` and HF assisted generation with the same draft (pipeline/engines/hf.py), and
`eval.engine=hf`. `hf_assisted`: HF's defaults; `hf_assisted_fixed`: num_assistant_tokens=γ, schedule "constant",
threshold 0 (no early stop, no re-fit); `hf_assisted_calibrated`: the HF equivalent of our policy on the domain.
"""
from __future__ import annotations

import torch

from pipeline.decoding import DecodeStats
from pipeline.engines.hf import assistant_configs, hf_generate


def hf_engine_methods(evaluation) -> dict:
    """eval.engine=hf: every method inside HF `generate` (speedups are HF assisted over HF plain): each draft runs its
    domain's HF calibration (speculative.json `engines.hf`) where it has one, else its decoder calibration's chain
    policy; HF plain where the domain is "off" (HF's generation_config cannot say "off"). A sweep's `gamma` fixes
    num_assistant_tokens."""
    sampling, stop, target = evaluation.sampling, evaluation.stop, evaluation.target

    def autoregressive(ids, domain, n, seed):
        torch.manual_seed(seed)  # HF samples from the global RNG
        tokens, _ = hf_generate(target, ids, n, sampling, stop)
        return tokens, DecodeStats(target_passes=len(tokens), n_generated=len(tokens))  # one token per forward

    def assisted(name: str):
        draft = evaluation.drafts[name]
        plans, configs = evaluation.plans[name], {}
        hf_table = (((draft.spec.engines or {}).get("hf") or {}).get("generation_config")
                    if draft.spec is not None and evaluation.settings.drafting != "uncalibrated" else None)
        for domain, plan in plans.items():
            if hf_table:
                chosen = hf_table.get(domain, hf_table.get("default"))
                configs[domain] = None if chosen is None else assistant_configs(draft.model, 1, chosen)["calibrated"]
            else:
                configs[domain] = (assistant_configs(draft.model, plan.gamma, plan.as_chain().hf_generation_config())
                                   ["calibrated"] if plan.speculates else None)

        def generate(ids, domain, n, seed, gamma=None):
            config = assistant_configs(draft.model, gamma)["fixed"] if gamma else configs[domain]
            if config is None:
                return autoregressive(ids, domain, n, seed)
            torch.manual_seed(seed)
            return hf_generate(target, ids, n, sampling, stop, draft.model, config)
        return generate

    return {"autoregressive": autoregressive, **{name: assisted(name) for name in evaluation.drafts}}
