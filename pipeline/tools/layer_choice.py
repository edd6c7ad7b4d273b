"""Which decoder layers a shallow draft keeps, chosen by measurement on the target's own held-out rows: a search
(greedy, or over contiguous blocks dropped) over the source model's layers (the target, for a derived draft;
model.draft, for a pruned pretrained one), each candidate subset judged untrained by its held-out acceptance
Σ min(p, q) at the serving temperature on the calibration part, or after `tool.steps` training steps of distill's
recipe each. The chosen subset and a baseline (the configured list, else the first `keep` layers) are then compared
on the reporting part with a paired bootstrap CI over rows, so the rows that choose never judge. Equal depth is equal
cost on a device where a draft's cost follows its depth, so only the acceptance is compared.

    python -m pipeline.tools layer-choice tool.keep=2 [tool.steps=10] [tool.source=draft] [tool.search=block] \
        [paths.collect=<collect>]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from distill import simulator as sim
from distill.heldouts import build_heldouts, load_target_inputs, split_collected
from pipeline.settings import register, setting
from pipeline.errors import PipelineError
from pipeline.modelio.models import derive_draft
from pipeline.tools.compare_drafts import compare, render


@dataclass(frozen=True)
class LayerChoiceSettings:
    """layer-choice: the layers a shallow draft keeps, chosen by held-out acceptance.

    On one collect's rows (paths.collect); the choice against a baseline with a paired CI."""
    keep: int = setting(2, "layers the draft keeps")
    search: str = setting("greedy", "greedy (one layer added or removed per step, ~keep*n subsets judged) | block (each "
                          "contiguous block of n - keep layers dropped: keep + 1 subsets, for deep sources)")
    source: str = setting("target", "target (a draft derived from the target's layers) | draft (model.draft, "
                          "pretrained, pruned)")
    steps: int = setting(0, "judge each subset after this many constant-rate steps of distill's recipe, as the "
                         "learning-rate probe does; 0 = untrained")
    baseline: list[int] | None = setting(None, "the subset compared with; null = the configured list "
                                         "(model.draft.derive.layers or keep_layers) where it has `keep` layers, else "
                                         "the first `keep`")
    json: str | None = setting(None, "also write the result to this file")


register("tools", LayerChoiceSettings, name="layer-choice", package="tool")

SOURCES = ("target", "draft")


def subset_acceptance(source, layers: list[int], heldout: sim.HeldOut) -> torch.Tensor:
    """α per held-out position [N] of the draft made of `layers` of `source`, untrained, at the serving temperature."""
    draft = derive_draft(source, layers)
    return sim.acceptance(draft, heldout, [heldout.sampling.temperature])[0]


def after_steps(inputs, source, steps: int, out_dir: Path):
    """A scorer like `subset_acceptance` that first trains each subset `steps` constant-rate steps by distill's own
    recipe (distill.* settings, its train rows and labels, its FR-Spec head), as the learning-rate probe does: how fast
    a start climbs, where an untrained shallow subset's acceptance cannot tell starts apart."""
    from dataclasses import replace

    from distill.heldouts import served_acceptance
    from distill.labels import attach_teacher_labels
    from distill.stage import split_rows
    from distill.trainer import DistillTrainer
    from distill.training import training_arguments
    from pipeline.heads import use_subset_head

    # distill's split logs its draft: here the source the candidates are cut from
    split = split_rows(replace(inputs, draft=source, draft_info={"layer-choice": "the source of the candidates"}))
    split = attach_teacher_labels(inputs, split, lambda message: None)
    rate = float(inputs.settings.trainer["learning_rate"])

    def score(source, layers: list[int], heldout: sim.HeldOut) -> torch.Tensor:
        job = replace(inputs, draft=derive_draft(source, layers).float())
        use_subset_head(job.draft, split.vocab)  # the trainer's draft carries the FR-Spec head, as distill's does
        job.draft.train()
        arguments = training_arguments(job, len(split.train), out_dir, learning_rate=rate, max_steps=steps,
                                       warmup_steps=0, lr_scheduler_type="constant", save_strategy="no",
                                       logging_strategy="no", disable_tqdm=True)
        DistillTrainer(job.draft, arguments, split.train, teacher_model=job.target, vocab=split.vocab,
                       stop_ids=job.stops, processing_class=job.tokenizer, callbacks=[]).train()
        return served_acceptance(job.draft, job.serving_dtype, heldout, [heldout.sampling.temperature],
                                 split.vocab)[0]

    return score


def greedy_layers(source, keep: int, heldout: sim.HeldOut, score=subset_acceptance, log=print) -> list[dict]:
    """The search path: from no layers upwards (keep ≤ half the layers) or from all downwards, one layer added or
    removed per step, the one whose subset has the highest mean α (`score`: untrained by default). Returns
    [{"layers", "acceptance"}] per step."""
    n = source.config.num_hidden_layers
    growing = keep <= n // 2
    chosen, path = ([] if growing else list(range(n))), []
    while len(chosen) != keep:
        options = [sorted({*chosen, i}) for i in range(n) if i not in chosen] if growing else \
            [[j for j in chosen if j != i] for i in chosen]
        scores = [float(score(source, layers, heldout).mean()) for layers in options]
        best = max(range(len(options)), key=lambda i: (scores[i], [-j for j in options[i]]))  # ties: earlier layers
        chosen = options[best]
        path.append({"layers": chosen, "acceptance": scores[best]})
        log(f"[layer-choice] {len(chosen):>3} layers: {chosen}  held-out acceptance (calibration part) "
            f"{scores[best]:.3f}")
    return path


def block_layers(source, keep: int, heldout: sim.HeldOut, score=subset_acceptance, log=print) -> list[dict]:
    """Every subset that drops one contiguous block of n − keep layers (Gromov et al. 2024, "The Unreasonable
    Ineffectiveness of the Deeper Layers": a pretrained model loses least to one deep-but-not-last block), keep + 1
    candidates where the greedy search judges ~keep·n: a search cheap enough for a deep source. Returns
    [{"layers", "acceptance"}] per candidate, the best (ties: earlier layers) last."""
    n = source.config.num_hidden_layers
    path = []
    for start in range(keep + 1):
        layers = [*range(start), *range(start + n - keep, n)]
        path.append({"layers": layers, "acceptance": float(score(source, layers, heldout).mean())})
        log(f"[layer-choice] without layers {start}..{start + n - keep - 1}: held-out acceptance (calibration part) "
            f"{path[-1]['acceptance']:.3f}")
    return sorted(path, key=lambda step: (step["acceptance"], [-j for j in step["layers"]]))


SEARCHES = {"greedy": greedy_layers, "block": block_layers}


def _source(cfg, inputs):
    """The model whose layers are chosen from: the target, or model.draft's pretrained weights (all its layers)."""
    if cfg.tool.source == "target":
        return inputs.target
    from pipeline.modelio.draft_init import build_draft

    spec = OmegaConf.to_container(cfg.model.draft, resolve=True)
    if (spec.get("init") or "derive") != "pretrained":
        raise PipelineError("tool.source=draft prunes a pretrained draft: set model.draft.init=pretrained (and its "
                            "path), or use tool.source=target for a draft derived from the target")
    spec.pop("keep_layers", None)
    draft, _, _ = build_draft(spec, inputs.target, inputs.tokenizer, cfg.paths, seed=int(cfg.seed))
    return draft.to(next(inputs.target.parameters()).dtype).eval()


def _baseline(cfg, keep: int) -> list[int]:
    configured = cfg.tool.baseline
    if configured is None:
        draft = cfg.model.draft
        configured = (draft.get("derive") or {}).get("layers") if cfg.tool.source == "target" else draft.get("keep_layers")
    configured = [int(i) for i in configured or []]
    return configured if len(configured) == keep else list(range(keep))


def run(cfg) -> dict:
    options = cfg.tool
    if options.source not in SOURCES:
        raise PipelineError(f"tool.source={options.source!r}: use target or draft")
    if options.search not in SEARCHES:
        raise PipelineError(f"tool.search={options.search!r}: use {' or '.join(SEARCHES)}")
    keep = int(options.keep)
    inputs = load_target_inputs(cfg, None, "distill")  # it trains: the trainer settings
    _, held_idx = split_collected(inputs.collected, inputs.settings.split, int(cfg.seed))
    heldouts = build_heldouts(inputs, held_idx)
    source = _source(cfg, inputs)
    n = source.config.num_hidden_layers
    if not 0 < keep < n:
        raise PipelineError(f"tool.keep={keep} must be between 1 and {n - 1} for a {n}-layer source")
    steps = int(options.steps)
    if steps < 0:
        raise PipelineError(f"tool.steps={steps} must be ≥ 0 (0 = judge the subsets untrained)")
    score = after_steps(inputs, source, steps, Path(cfg.paths.artifacts) / "layer_choice") if steps \
        else subset_acceptance
    judged = f"after {steps} training steps" if steps else "untrained"
    print(f"[layer-choice] {keep} of the {source.config.num_hidden_layers} layers of the {options.source}, judged "
          f"{judged} on {len(heldouts.calibration.rows)} calibration rows ({inputs.sampling})")
    path = SEARCHES[options.search](source, keep, heldouts.calibration, score=score)
    chosen, baseline = path[-1]["layers"], _baseline(cfg, keep)
    names = ["baseline", "chosen"] if chosen != baseline else ["baseline"]  # short: long lists collide in a column
    alphas = {name: score(source, layers, heldouts.reporting) for name, layers in zip(names, (baseline, chosen))}
    print(f"reporting part: {len(heldouts.reporting.rows)} rows, {heldouts.reporting.n_positions} positions; "
          f"drafts {judged}: baseline {baseline}, chosen {chosen}; Δ = chosen − baseline [95% paired bootstrap over "
          "rows]")
    table = compare(alphas, heldouts.reporting) if len(names) > 1 else None
    if table:
        print(render(table, names))
    result = {"source": options.source, "search": options.search, "keep": keep, "steps": steps, "chosen": chosen,
              "baseline": baseline, "path": path, "sampling": inputs.sampling.to_dict(), "reporting": table,
              "set_it": (f"model.draft.derive.layers={chosen}" if options.source == "target"
                         else f"model.draft.keep_layers={chosen}")}
    print(f"[layer-choice] to train it: {result['set_it']}")
    if options.json:
        Path(options.json).write_text(json.dumps(result, indent=2))
    return result
