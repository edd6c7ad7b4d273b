"""Export a draft: HF weights + tokenizer, `speculative.json` (pipeline/decoding/spec.py) and a README model card, written
atomically. An FR-Spec subset draft is exported with the subset baked into its full head (pipeline.heads.bake_subset):
engines run the full head, whose never-trained rows would otherwise outscore the trained ones.
"""
from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from distill.batch_sizes import format_batching
from pipeline.atomic import atomic_dir, write_json
from pipeline.engines.rules import EXPRESSES
from pipeline.heads import bake_subset
from pipeline.decoding.spec import DEFAULT, SpeculativeSpec


@dataclass(frozen=True)
class ExportParts:
    """What an export directory holds beside the weights, tokenizer and generation config: speculative.json, the
    model card (README.md), `extra` JSON files such as the cost profile, `files` copied in by name such as
    draft.gguf, and `head_fill`, a subset draft's head rows outside its subset."""
    spec: SpeculativeSpec | None = None
    card: str | None = None
    extra: dict[str, dict] | None = None
    head_fill: torch.Tensor | None = None
    files: dict[str, Path] | None = None


def save_draft(draft, tokenizer, out_dir: str | Path, generation_config=None, parts: ExportParts = ExportParts()) -> Path:
    """save_pretrained + tokenizer (+ `parts`) into `out_dir`, replacing it atomically."""
    spec, card, extra, head_fill, files = parts.spec, parts.card, parts.extra, parts.head_fill, parts.files
    out_dir = Path(out_dir)
    if spec is not None and spec.vocab_subset:
        draft = exported_weights(draft, spec.vocab_subset, head_fill)
    if generation_config is not None:
        draft.generation_config = copy.deepcopy(generation_config)
    with atomic_dir(out_dir) as tmp:
        draft.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if spec is not None:
            spec.write(tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)
        for name, content in (extra or {}).items():
            if content is not None:
                write_json(tmp / name, content)
        for name, source in (files or {}).items():
            shutil.copyfile(source, tmp / name)
    return out_dir


def exported_weights(draft, vocab_subset: list[int] | None, head_fill: torch.Tensor | None = None):
    """The model exactly as it is written to disk: a copy (callers move it to the serving dtype; the draft they
    pass stays as it is) with the FR-Spec subset baked into its full head (rows outside it `head_fill`,
    distill.simulator.out_of_subset_fill; None: zero)."""
    if not vocab_subset:
        return copy.deepcopy(draft)
    return bake_subset(copy.deepcopy(draft), torch.tensor(vocab_subset, dtype=torch.long), head_fill)


def _describe(spec: SpeculativeSpec, domain: str) -> str:
    """The domain's drafting: off (plain decoding), a token tree (greedy serving) or the chain's draft-length
    policy."""
    recipe = spec.recipe(domain)
    if not recipe.speculate:
        return "off (plain decoding)"
    if recipe.tree:
        return "tree (" + ", ".join(map(str, recipe.tree)) + ")"
    return "–" if recipe.chain is None else recipe.chain.describe()


def _off_line(spec: SpeculativeSpec, domains: list[str]) -> str:
    off = [d for d in domains if not spec.recipe(d).speculate]
    if not off:
        return "every domain (each predicted faster than plain decoding by the calibration margin)"
    return (f"off for {', '.join(off)}: no drafting was predicted faster than plain decoding by the margin on this "
            "device, so serve those with the target alone. HF's generation_config holds one setting for every domain "
            "(the default's) and cannot switch assisted generation off per domain: call generate without "
            "assistant_model there; this project's decoder does it itself (its Recipe's drafting → None)")


def _subset_line(spec: SpeculativeSpec) -> str:
    if not spec.vocab_subset:
        return "off (full vocabulary)"
    full = spec.acceptance.get("full_head", {}).get("overall")
    return (f"{len(spec.vocab_subset)} tokens, written into the exported head (rows outside it score far below the "
            "subset's best), so engines "
            f"that run the full head (HF, vLLM, llama.cpp) draft what this project's decoder drafts; held-out "
            f"acceptance with the full head {_fmt(full)} vs {_fmt(spec.acceptance.get('after_calibrated', {}).get('overall'))} "
            "through the subset")


def _fmt(x, digits=3):
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _kv(d: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (d or {}).items())


def _shipped_line(spec: SpeculativeSpec) -> str:
    """Which weights the checkpoint holds and keep_best's reason (distill/simulator.py keep_best)."""
    if not spec.training.get("steps"):  # the probe found no step size worth taking, or draft_init
        return "the initial draft: it was not trained"
    verdict = spec.training.get("keep_best") or {}
    ci = verdict.get("ci95")
    judged = (f"; on the calibration part the trained weights {verdict['difference']:+.3f}"
              + (" [{:+.3f}, {:+.3f}]".format(*ci) if ci else "") + f" over the initial ones ({verdict['rule']} rule)"
              if verdict else "")
    if spec.selected == "distilled":
        return "the distilled draft" + judged
    return ("the initial draft (keep_best): training did not raise held-out acceptance" + judged
            + f"; the trained weights' reporting part: {_fmt(spec.acceptance.get('after_training', {}).get('overall'))}")


def _recipe_lines(recipe: dict | None, steps: int) -> list[str]:
    """The step size training ran at and why (distill/training.py probe_learning_rate), and what the stop rule did;
    none for a draft without a training run of its own (steps 0 and a rate chosen: draft_init)."""
    if not recipe or (steps == 0 and recipe.get("learning_rate")):
        return []
    rate, probe = recipe["learning_rate"], recipe.get("probe")
    if not probe:
        why = "distill.trainer.learning_rate, not probed (distill.trainer.lr_probe=null)"
    else:
        tried = ", ".join(f"{name} {_fmt(acceptance)}" for name, acceptance in probe.items())
        why = (f"the largest rate whose held-out acceptance (calibration part) after {recipe['probe_steps']} steps "
               f"from the initial weights beat theirs, tried largest first: {tried}")
    lines = [f"- learning rate: {rate:.3g}, {why}" if rate else
             f"- learning rate: none, no training: no rate tried beat the initial weights ({why.split(': ', 1)[1]})"]
    if recipe.get("stop_patience"):
        stopped = recipe.get("stopped_at")
        lines.append("- stop rule: " + (f"stopped at step {stopped}, {recipe['stop_patience']} held-out evaluations "
                                          "below the best" if stopped else "trained to the budget")
                     + f"; the weights of step {recipe.get('kept_step')} (calibration-part acceptance "
                       f"{_fmt(recipe.get('kept_acceptance'))}, initial {_fmt(recipe.get('initial_acceptance'))}) "
                       "were the best trained")
    return lines


def model_card(spec: SpeculativeSpec, title: str) -> str:
    """A short README: what the draft is, for which target, and its held-out numbers per domain."""
    acceptance, length, cost = spec.acceptance, spec.mean_accepted_length, spec.cost
    domains = [d for d in acceptance.get("after", {}) if d not in (DEFAULT, "overall")]
    shipped = _shipped_line(spec)
    lines = [f"# {title}", "",
             f"Draft model for speculative decoding with **{spec.target.get('name') or spec.target.get('path')}** "
             f"(target sha256 `{str(spec.target.get('source_sha256'))[:12]}`), distilled on the target's own "
             "generations by this project's distill stage. Loads with `AutoModelForCausalLM.from_pretrained` and "
             "works as `assistant_model` in HF `generate`; `speculative.json` holds the calibration below.", "",
             f"- draft: {_kv(spec.draft)}",
             f"- training: {_kv({k: v for k, v in spec.training.items() if k not in ('recipe', 'keep_best')})}",
             *_recipe_lines(spec.training.get("recipe"), int(spec.training.get("steps") or 0)),
             f"- exported weights: {shipped}",
             f"- serving sampling calibrated for: {_kv(spec.sampling.to_dict())}",
             f"- calibrated for device {cost.get('device')} {cost.get('device_name') or ''} ({cost.get('dtype')}, "
             f"{cost.get('torch_threads')} threads; cost_profile.json): cost ratio c = {_fmt(cost.get('c'))} "
             f"({_fmt(cost.get('draft_forward_ms'), 2)} ms / {_fmt(cost.get('target_forward_ms'), 2)} ms)",
             f"- FR-Spec vocabulary subset: {_subset_line(spec)}",
             f"- held-out prompts: {_kv({k: v for k, v in spec.heldout.items() if k != 'prompt_ids'})}",
             f"- speculation: {_off_line(spec, domains)}", "",
             "Held-out expected acceptance Σ min(p, q) (teacher-forced on held-out collected rows; τ, γ and the "
             "exported weights were chosen on the calibration part, every number here is from the reporting part) "
             f"and predicted mean accepted length at γ={length.get('gamma')}, before and after distillation:", "",
             format_table(spec)]
    verify = cost.get("verify_ratio")
    lines += ["", "Predicted speedup = (1 + A) / (c·D + r) for the domain's drafting, with A the expected accepted "
              "tokens per target pass simulated on held-out rows, D the draft forwards per pass (a tree: its depth), "
              "c the draft/target step cost and r the target's verify forward over its 1-token forward for the "
              "drafted tokens (a tree: all its nodes)"
              + (f" (measured: {_kv(verify)})" if verify else " (1: free verification)") + "."]
    lines += _engine_lines(spec)
    if spec.batching:  # calibrate.batch_sizes: γ per batch size (distill/batch_sizes.py)
        lines += ["", "```", format_batching(spec.batching), "```"]
    lines += ["", "Use: `python -m pipeline stage=eval eval.draft=<this directory>`; with HF: "
              "`target.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained(<dir>))`; "
              "with vLLM, SGLang or TensorRT-LLM: each domain's config in speculative.json `engines` "
              "(calibrate.engines; \".\" = <dir>).", ""]
    return "\n".join(lines)


def format_table(spec: SpeculativeSpec) -> str:
    """Per domain (reporting part): acceptance and mean accepted length before and after, and the calibration chosen
    on the calibration part; the model card's table, printed by the calibrate stage too."""
    acceptance, length = spec.acceptance, spec.mean_accepted_length
    lines = ["| domain | acceptance before | after | after (calibrated τ) | mean acc. length before | after "
             "| draft τ | best fixed γ | drafting | predicted speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for domain in [d for d in acceptance["after"] if d not in (DEFAULT, "overall")] + ["overall"]:
        lines.append(f"| {domain} | {_fmt(acceptance['before'].get(domain))} | {_fmt(acceptance['after'].get(domain))} | "
                     f"{_fmt(acceptance['after_calibrated'].get(domain))} | {_fmt(length['before'].get(domain), 2)} | "
                     f"{_fmt(length['after'].get(domain), 2)} | {_fmt(spec.recipe(domain).draft_temperature, 2)} | "
                     f"{spec.recipe(domain).gamma} | {_describe(spec, domain)} | "
                     f"{_fmt(spec.predicted_speedup.get(domain), 2)} |")
    return "\n".join(lines)


def _rule_line(name: str, rule: dict) -> str:
    """One rule an engine was calibrated for (pipeline/engines/rules.py rule_record)."""
    draft = ("its argmax" if rule["draft_sampling"] == "greedy" else f"a token sampled at T = {rule['draft_temperature']:g}"
             + ("" if rule["draft_top_k_top_p"] else ", without top-k/top-p"))
    how = _kv(rule["settings"]) if rule["settings"] else rule["set_by"]
    return f"rule {name}: the draft proposes {draft}, {rule['verification']} verification ({how})"


def _weights_line(spec: SpeculativeSpec, weights: dict | None) -> list[str]:
    """Which weights an engine with a file of its own (llama.cpp's draft.gguf) serves, where it was judged apart."""
    alpha = (weights or {}).get("acceptance_calibration")
    if not alpha:
        return []
    ci = weights.get("ci95")
    judged = (f"under this engine's rule the trained weights accept {_fmt(alpha['distilled'])} on the calibration part, "
              f"the initial ones {_fmt(alpha['init'])}" + (" (difference [{:+.3f}, {:+.3f}], {} rule)".format(
                  *ci, weights.get("rule")) if ci else ""))
    if weights["selected"] == spec.selected:
        return [f"- weights: the same as the checkpoint's; {judged}"]
    return [f"- weights: **the initial draft's**, not the checkpoint's: {judged}"]  # judged only for a trained one


def _engine_lines(spec: SpeculativeSpec) -> list[str]:
    """Per serving engine calibrated for (speculative.json `engines`): the rules it was planned under, what each
    domain runs there, and what each engine's config can and cannot express."""
    lines = []
    for name, entry in spec.engines.items():
        table, cost = entry.get("by_domain", {}), entry.get("cost", {})
        settings = {d: (f"n_max {e['n_max']}, p_min {e['p_min']:g}" if "n_max" in e else
                        f"num_assistant_tokens {e['num_assistant_tokens']}" if "num_assistant_tokens" in e else
                        f"num_speculative_tokens {e['num_speculative_tokens']}") + (f", rule {e['rule']}" if "rule" in e else "")
                    for d, e in table.items()}
        source = cost.get("source") or f"measured in the engine on {cost.get('device_name')}"
        lines += ["", f"In **{name}** ({entry.get('version', 'version not recorded')}; c = {_fmt(cost.get('c'))}; "
                      f"{source}), per domain:"]
        lines += [f"- {d}: " + (f"{settings[d]} (predicted {e['predicted_speedup']:.2f}×)" if e["speculate"] else
                                f"off, serve without the draft ({e['predicted_speedup_if_on']:.2f}× if on)")
                  for d, e in table.items()]
        lines += [f"- {_rule_line(r, rule)}" for r, rule in entry.get("rules", {}).items()]
        lines += _weights_line(spec, entry.get("weights"))
    known = [name for name in spec.engines if name in EXPRESSES]
    if known:
        lines += ["", "What each engine's config can express (its version above):", "",
                  "| engine | T, top-k/top-p | draft τ apart from T | off per domain | draft length per batch size |",
                  "|---|---|---|---|---|", *(f"| {name} | " + " | ".join(EXPRESSES[name]) + " |" for name in known)]
    return lines
