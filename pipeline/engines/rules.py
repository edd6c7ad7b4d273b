"""How each serving engine drafts and verifies at the version its export is written for, and what its config can
say. fields.json names those versions and the configuration keys each accepts, read from the engine's own source
(tests/engine_fields.py); the notes below cite the files the rules were read from.

Two rules cover them. "greedy": the draft proposes its argmax and a drafted token x is kept with the target's
probability p_T(x) ("strict": llama.cpp and TensorRT-LLM keep it when the target's own draw equals it; vLLM and
SGLang by rejection sampling against a one-hot q, the same chance), so it is planned with α = p_T(argmax q).
"tau": the draft samples at the serving temperature T (no engine here sets a draft temperature τ apart from T) and
the target verifies by rejection sampling (Leviathan et al. 2023), α = Σ min(p_T, q_T), q_T filtered by the
serving top-k/top-p where the engine filters the draft too. This project's decoder runs "tau" at a calibrated τ.
"""
from __future__ import annotations

import json
from pathlib import Path

FIELDS = json.loads((Path(__file__).with_name("fields.json")).read_text())
VERSIONS = {name: entry["version"] for name, entry in FIELDS.items()}

# engine: {rule: the settings that select it, in the engine's own config}. Read from:
# hf: transformers generation/candidate_generator.py (the assistant runs the target's generation config and logits
#   processors) and utils.py (_speculative_sampling when sampling; argmax match at greedy);
# llamacpp: common/speculative.cpp draft-simple (argmax of a top-10 sampler, stops before p < p_min) and
#   common/sampling.cpp common_sampler_sample_and_accept_n (the target samples, the draft's token kept while equal);
#   later llama.cpp adds --spec-draft-sampling greedy|probabilistic (PR #27694), not in this tree: no source of
#   it could be read here, so nothing is written for it;
# vllm: config/speculative.py draft_sample_method (greedy default; probabilistic samples softmax(logits / T), no
#   top-k/top-p: v1/worker/gpu/spec_decode/speculator.py) and rejection_sample_method ("standard": rejection sampling);
# sglang: speculative/eagle_utils.py (tree_speculative_sampling_target_only: kept with p_T(x) at both thresholds 1);
#   arg_groups/speculative_hook.py refuses rejection sampling for STANDALONE;
# trtllm: llmapi/llm_args.py use_rejection_sampling (default false: argmax draft, exact match; true: the draft samples
#   with the request's T, top-k, top-p and the target verifies by rejection sampling, one-model paths, DRAFT_TARGET
#   among them: PR #15775).
RULES = {
    "hf": {"tau": {}},
    "llamacpp": {"greedy": {}},
    "vllm": {"greedy": {"draft_sample_method": "greedy", "rejection_sample_method": "standard"},
             "tau": {"draft_sample_method": "probabilistic", "rejection_sample_method": "standard"}},
    "sglang": {"greedy": {"--speculative-accept-threshold-single": "1", "--speculative-accept-threshold-acc": "1"}},
    "trtllm": {"greedy": {"use_rejection_sampling": False}, "tau": {"use_rejection_sampling": True}},
}
UNFILTERED_DRAFT = {"vllm"}  # "tau" drafts from softmax(logits / T) without the serving top-k/top-p

# What each engine's config can say, for the model card: (T and top-k/top-p, τ apart from T, "off" per domain,
# the draft length per batch size).
EXPRESSES = {
    "hf": ("yes, per request; the draft samples with them", "no: τ = T", "no: call generate without "
           "assistant_model", "no: assisted generation decodes one sequence"),
    "llamacpp": ("yes, per request; the draft ignores them (top-10 argmax)", "no: greedy drafts only at this "
                 "version", "no: a second server without -md", "no: one --spec-draft-n-max for every slot"),
    "vllm": ("yes, per request; the draft takes T only", "no: τ = T", "no: a second, plain engine",
             "yes: num_speculative_tokens_per_batch_size (0 = off)"),
    "sglang": ("yes, per request; the draft ignores them", "no: greedy drafts only for STANDALONE",
               "no: a second, plain server", "no"),
    "trtllm": ("yes, per request; the draft samples with them under use_rejection_sampling", "no: τ = T",
               "no: a second, plain LLM", "yes: draft_len_schedule (0 above its largest batch size)"),
}


def candidate_rules(engine: str, greedy_serving: bool) -> dict[str, dict]:
    """The rules the export can select for `engine` ({rule: settings}): at greedy serving only "greedy" (every
    rule drafts and keeps the argmax there)."""
    rules = RULES[engine]
    return {"greedy": rules.get("greedy", {})} if greedy_serving else rules


def rule_record(engine: str, rule: str, temperature: float) -> dict:
    """speculative.json's account of a rule an engine was calibrated for: how it drafts and verifies, and whether
    the export selects it (`settings`) or the engine runs it by default."""
    settings = candidate_rules(engine, temperature == 0)[rule]
    return {"draft_sampling": rule, "draft_temperature": 0.0 if rule == "greedy" else float(temperature),
            "draft_top_k_top_p": rule != "greedy" and engine not in UNFILTERED_DRAFT,
            "verification": "strict" if rule == "greedy" else "probabilistic", "settings": settings,
            "set_by": "the export" if settings else "the engine's default (its only rule)"}


def unknown_keys(engine: str, config: dict | list) -> list[str]:
    """The keys (flags, for a server's argument list) of an exported config that the engine's version in
    fields.json does not accept, and values outside a Literal-typed key's admitted strings."""
    entry = FIELDS[engine]
    keys = [a for a in config if str(a).startswith("-")] if isinstance(config, list) else list(config)
    bad = [k for k in keys if k not in entry["fields"]]
    values = dict(zip(config, config[1:])) if isinstance(config, list) else config
    return bad + [f"{k}={values[k]}" for k, admitted in entry["values"].items() if k in values and values[k] not in admitted]
