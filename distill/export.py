"""Export a draft: HF weights + tokenizer, `speculative.json` and a README model card, written atomically.

speculative.json (read by eval/stage.py; per-domain entries are {domain: value, "default": value}):
    target                 model_identity of the target (path, architecture, sizes, source_sha256)
    serving_temperature    the target temperature (top_k, top_p in `sampling`) the calibration is for
    draft_temperature      calibrated τ per domain + default (0 at serving T = 0: greedy drafting)
    gamma                  best γ per domain + default, from measured per-position acceptance and c
    vocab_subset           FR-Spec target ids for the draft head, or null (weights stay full-vocabulary)
    acceptance             held-out expected acceptance per domain: before / after / after_calibrated
    mean_accepted_length   held-out predicted tokens per target pass at γ (before / after)
    cost                   c, draft and target forward ms, device
    draft, training        how the draft was built and trained (loss, teacher, steps, tokens, minutes)
"""
from __future__ import annotations

import copy
from pathlib import Path

from pipeline.atomic import atomic_dir, write_json

from distill.draft import restore_full_head


def save_draft(draft, tokenizer, out_dir: str | Path, speculative: dict | None, card: str | None,
               generation_config=None) -> Path:
    """save_pretrained + tokenizer (+ speculative.json, README.md) into `out_dir`, replacing it atomically."""
    out_dir = Path(out_dir)
    model = draft
    if generation_config is not None:
        model.generation_config = copy.deepcopy(generation_config)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if speculative is not None:
            write_json(tmp / "speculative.json", speculative)
        if card is not None:
            (tmp / "README.md").write_text(card)
    return out_dir


def full_vocab(draft, original_head):
    """The draft with its full output head back in place (undoes use_subset_head)."""
    restore_full_head(draft, original_head)
    return draft


def _fmt(x, digits=3):
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _kv(d: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (d or {}).items())


def model_card(spec: dict, title: str) -> str:
    """A short README: what the draft is, for which target, and its held-out numbers per domain."""
    acc = spec.get("acceptance", {})
    mal = spec.get("mean_accepted_length", {})
    g = mal.get("gamma", 4)
    domains = [d for d in acc.get("after", {}) if d not in ("default", "overall")]
    lines = [f"# {title}", "",
             f"Draft model for speculative decoding with **{spec['target'].get('name') or spec['target'].get('path')}** "
             f"(target sha256 `{str(spec['target'].get('source_sha256'))[:12]}`), distilled on the target's own "
             "generations by this project's distill stage. Loads with `AutoModelForCausalLM.from_pretrained` and "
             "works as `assistant_model` in HF `generate`; `speculative.json` holds the calibration below.", "",
             f"- draft: {_kv(spec.get('draft'))}",
             f"- training: {_kv(spec.get('training'))}",
             "- exported weights: " + ("the distilled draft" if spec.get("selected", "distilled") == "distilled" else
                                       "the initial draft: training lowered held-out acceptance to "
                                       f"{_fmt(acc.get('after_training', {}).get('overall'))}"),
             f"- serving sampling calibrated for: {_kv(spec.get('sampling'))}",
             f"- cost ratio c (draft/target forward on {spec.get('cost', {}).get('device')}): "
             f"{_fmt(spec.get('cost', {}).get('c'))} ({_fmt(spec.get('cost', {}).get('draft_forward_ms'), 2)} ms / "
             f"{_fmt(spec.get('cost', {}).get('target_forward_ms'), 2)} ms)",
             f"- FR-Spec vocabulary subset: "
             f"{len(spec['vocab_subset']) if spec.get('vocab_subset') else 'off (full vocabulary)'}", "",
             f"Held-out expected acceptance Σ min(p, q) (teacher-forced on held-out collected rows) and predicted "
             f"mean accepted length at γ={g}, before and after distillation:", "",
             "| domain | acceptance before | after | after (calibrated τ) | mean acc. length before | after "
             "| draft τ | best γ | predicted speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for d in domains + ["overall"]:
        lines.append(f"| {d} | {_fmt(acc.get('before', {}).get(d))} | {_fmt(acc.get('after', {}).get(d))} | "
                     f"{_fmt(acc.get('after_calibrated', {}).get(d))} | {_fmt(mal.get('before', {}).get(d), 2)} | "
                     f"{_fmt(mal.get('after', {}).get(d), 2)} | "
                     f"{_fmt(spec['draft_temperature'].get(d, spec['draft_temperature'].get('default')), 2)} | "
                     f"{spec['gamma'].get(d, spec['gamma'].get('default'))} | "
                     f"{_fmt(spec.get('predicted_speedup', {}).get(d), 2)} |")
    verify = spec.get("cost", {}).get("verify_ratio")
    lines += ["", "Predicted speedup = (1 + Σ_k≤γ P_k) / (γc + r_γ) from the measured per-position acceptance P_k, "
              "c, and r_γ = the target's (γ+1)-token verify forward over its 1-token forward"
              + (f" (measured: {_kv(verify)})" if verify else " (1: free verification)") + "."]
    lines += ["", "Use: `python -m pipeline stage=eval eval.draft=<this directory>`; with HF: "
              "`target.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained(<dir>))`; "
              "with vLLM: `speculative_config={\"model\": <dir>, \"num_speculative_tokens\": γ}`.", ""]
    return "\n".join(lines)
