"""Fidelity: greedy speculative output vs greedy autoregressive output, token for token. Identical in exact
arithmetic (Leviathan et al. 2023); in bf16 the (γ+1)-token verify and the 1-token step round differently, so every
mismatch is reported with the target's top-2 logit gap where the outputs first differ: a few ulps is a near-tie, a
large gap a decoder bug.
"""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch

from eval import metrics as M
from eval.settings import EvalSettings
from pipeline.decoding import DraftLength, DraftPlan, autoregressive_generate, speculative_generate

# A gap up to this many units in the last place of the top logit counts as a near-tie: the two forward
# shapes accumulate a 30-layer residual stream in different orders, so a few ulps of drift are expected.
NEAR_TIE_ULPS = 4


def first_prompts(contexts: list[dict], n: int) -> list[dict]:
    """The encoded requests of the first n prompts of each domain (all their turns)."""
    keep: dict[str, list[str]] = {}
    for c in contexts:
        ids = keep.setdefault(c["domain"], [])
        if c["prompt_id"] not in ids and len(ids) < n:
            ids.append(c["prompt_id"])
    return [c for c in contexts if c["prompt_id"] in keep[c["domain"]]]


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at |x| (for x in [2^e, 2^(e+1)) it is eps · 2^e)."""
    return torch.finfo(dtype).eps * 2.0 ** (math.frexp(abs(x))[1] - 1) if x else torch.finfo(dtype).tiny


@torch.inference_mode()
def divergence(target, ids: torch.Tensor, ar: list[int], spec: list[int]) -> dict:
    """Where two token lists first differ and the target's top-2 logit gap there (one fresh forward)."""
    i = next((k for k, (a, b) in enumerate(zip(ar, spec)) if a != b), min(len(ar), len(spec)))
    prefix = torch.cat([ids, torch.tensor([ar[:i]], dtype=ids.dtype, device=ids.device)], 1)
    logits = target(prefix).logits[0, -1]
    top = logits.float().topk(2).values
    gap, spacing = float(top[0] - top[1]), ulp(float(top[0]), logits.dtype)
    return {"position": i, "top2_gap": round(gap, 5), "ulp": spacing, "dtype": str(logits.dtype).removeprefix("torch."),
            "near_tie": gap <= NEAR_TIE_ULPS * spacing}


def fidelity_check(contexts, target, draft, plans, stop, s: EvalSettings) -> dict:
    """Greedy speculative vs greedy autoregressive on the first prompts of each domain (sampled runs cannot be
    compared token for token; their exactness in distribution is the decoder tests' job)."""
    ar, spec, mismatches = [], [], []
    for c in first_prompts(contexts, s.fidelity_prompts_per_domain):
        key = {k: c[k] for k in ("domain", "prompt_id", "turn")}
        a = autoregressive_generate(target, c["ids"], max_new_tokens=s.max_new_tokens, eos_token_id=stop)
        b = speculative_generate(target, draft.model, c["ids"], max_new_tokens=s.max_new_tokens,
                                 plan=DraftPlan(plans[c["domain"]].drafting or DraftLength(), draft_vocab=draft.vocab),
                                 eos_token_id=stop)
        ar.append(key | {"tokens": a.tokens.tolist()})
        spec.append(key | {"tokens": b.tokens.tolist()})
        if ar[-1]["tokens"] != spec[-1]["tokens"]:
            mismatches.append(key | divergence(target, c["ids"], ar[-1]["tokens"], spec[-1]["tokens"]))
    domains = dict.fromkeys(r["domain"] for r in spec)
    return {"n_prompts": s.fidelity_prompts_per_domain, "temperature": 0.0, "share": M.greedy_match(spec, ar),
            "by_domain": {d: M.greedy_match([r for r in spec if r["domain"] == d], ar) for d in domains},
            "mismatches": mismatches, "near_tie_ulps": NEAR_TIE_ULPS}


def diagnose(records: list[dict], contexts: list[dict], target, methods=("speculative", "speculative_init")) -> list:
    """After a greedy benchmark: every speculative output that differs from the autoregressive one, located."""
    ar = {(r["prompt_id"], r["turn"]): r["tokens"] for r in records if r["method"] == "autoregressive"}
    ids = {(c["prompt_id"], c["turn"]): c["ids"] for c in contexts}
    return [{"method": r["method"], "domain": r["domain"], "prompt_id": r["prompt_id"], "turn": r["turn"]}
            | divergence(target, ids[key], ar[key], r["tokens"])
            for r in records if r["method"] in methods
            for key in [(r["prompt_id"], r["turn"])] if key in ar and r["tokens"] != ar[key]]


def fp32_recheck(contexts, target, draft, plans, stop, s: EvalSettings, mismatches: list[dict]) -> dict:
    """The mismatched requests again, greedy, with float32 copies of both models: equality is expected there, so
    a mismatch that persists in fp32 is a bug and one that disappears was rounding."""
    again = {m["prompt_id"] for m in mismatches}
    fp32 = copy.copy(draft)
    fp32.model = copy.deepcopy(draft.model).float()
    result = fidelity_check([c for c in contexts if c["prompt_id"] in again], copy.deepcopy(target).float(), fp32,
                            plans, stop, replace(s, fidelity_prompts_per_domain=len(again)))
    return {"n_prompts": len(again), "share": result["share"], "mismatches": result["mismatches"]}
