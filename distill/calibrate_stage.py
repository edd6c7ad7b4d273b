"""Calibrate stage: `python -m pipeline stage=calibrate`. It turns a draft's weights, the held-out rows and a cost
profile into the draft's serving recipe, and writes the exports eval and users read.

    inputs      = load_target_inputs(cfg, ...)     settings, collected rows, target
    drafts      = trained_drafts | given_draft     ${paths.trained}'s draft and draft_init, or calibrate.draft
    heldouts    = build_heldouts(inputs, ...)      the rows distill held out (training.json), same parts
    profile     = cost_profile(...)                this device's pass costs (or a given profile)
    spec        = calibrate_draft(...)             τ, γ, policy and tree per domain; speculative.json's numbers
    spec, files = calibrate_engines(...)           + the engines asked for (llama.cpp) and draft.gguf
    spec        = calibrate_batching(...)          + γ per batch size (calibrate.batch_sizes)
    save_calibrated(...)                           ${paths.draft}, its card and speculation_profile.json
    and the same for ${paths.draft_init} (its own calibration; uncalibrated when calibrate_init=false)

Each draft is loaded from disk in the serving dtype (the target's), so every number is measured on the weights and
arithmetic that serve (docs/journal.md, "The draft judged as it serves"), and exported as a copy: no step changes a
model another step uses, so a calibration setting reruns this stage and eval, never training.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from distill import simulator as sim
from distill.batch_sizes import calibrate_batching
from distill.engines import calibrate_engines
from distill.export import ExportParts, exported_weights, format_table, model_card, save_draft
from distill.heldouts import acceptances, build_heldouts, load_target_inputs, serving_acceptance, split_collected
from distill.job import Calibration, HeldOuts, Inputs, Split
from distill.serving import choose_recipe, cost_profile, predict_speedup, tree_candidates
from pipeline.modelio.trained import read_record
from pipeline.measure import speculation_profile as sp
from pipeline.measure.cost_profile import FILENAME
from pipeline.errors import PipelineError
from pipeline.modelio.models import check_compatible, load_model, load_tokenizer
from pipeline.decoding.spec import DEFAULT, SpeculativeSpec
from pipeline.timing import Laps


log = functools.partial(print, "[calibrate]", flush=True)  # one progress line, tagged with its stage


@dataclass(frozen=True)
class DraftSource:
    """A draft to calibrate: where its weights are, where its export goes, and what its speculative.json says
    about how it was made (from distill's training.json, or from the given draft's own speculative.json)."""
    weights: Path
    out: Path
    label: str                  # the model card's title suffix
    distilled: bool
    selected: str               # "distilled" | "init": which weights these are
    info: dict                  # speculative.json `draft`
    training: dict              # speculative.json `training`
    curve: list
    after_training: dict | None  # reporting-part acceptance of the trained weights (None: the draft's own)


# ---------------------------------------------------------------- the stage
def run(cfg: DictConfig, tracker) -> dict:
    t_start, laps = time.time(), Laps()
    given = cfg.calibrate.get("draft")
    record = check_draft_dir(Path(given)) if given else read_record(cfg.paths.trained)  # before loading anything
    inputs = load_target_inputs(cfg, tracker, "calibrate")
    main, init, split = given_draft(inputs, Path(given)) if given else trained_drafts(inputs, record)
    heldouts = build_heldouts(inputs, split.heldout_idx, inputs.settings.calibration.request_tokens)
    laps.lap("heldout")
    init_job = with_draft(inputs, init.weights) if init else None
    main_job = with_draft(inputs, main.weights)
    before = serving_acceptance(init_job or main_job, heldouts.reporting, split.vocab)
    profile = cost_profile(main_job, split.vocab)
    laps.lap("cost_profile")
    spec, calibration = calibrate_draft(main_job, split, heldouts, before, profile, main)
    spec, engine_files = calibrate_engines(main_job, split, heldouts, spec, calibration.head_fill, log,
                                           engine_rival(init_job, main, inputs.settings.calibration.keep_best))
    spec = calibrate_batching(main_job, split, spec, log)
    save_calibrated(main_job, spec, profile, calibration.head_fill, main, engine_files,
                    speculation_profile(main_job, split, heldouts, spec, main))
    report(inputs, spec, main.out)
    laps.lap("draft")
    if init is not None:
        export_init(init_job, split, heldouts, before, profile, init,
                    calibration if main.selected == "init" else None)
        laps.lap("draft_init")
    log(f"exported {main.out}" + (f" and {init.out}" if init else "") + f" in {time.time() - t_start:.0f}s: "
        f"{laps.summary()}")
    tracker.log_metrics({f"calibrate_seconds/{name}": seconds for name, seconds in laps.parts.items()})
    return {"acceptance_before": spec.acceptance["before"][sim.OVERALL],
            "acceptance_after": spec.acceptance["after"][sim.OVERALL], "c": spec.cost["c"], "draft": str(main.out)}


# ---------------------------------------------------------------- which drafts
def trained_drafts(inputs: Inputs, record: dict) -> tuple[DraftSource, DraftSource, Split]:
    """${paths.trained}'s draft and draft_init (its training.json `record`), to ${paths.draft} and
    ${paths.draft_init}, on the rows distill held out."""
    paths = inputs.cfg.paths
    if record["rows"] != len(inputs.collected):
        raise PipelineError(f"{paths.trained} was trained on a collect of {record['rows']} rows, {paths.collect} has "
                            f"{len(inputs.collected)}: rerun stage=distill on this collect")
    vocab = None if record["vocab_subset"] is None else torch.tensor(record["vocab_subset"], dtype=torch.long)
    split = Split(None, list(record["heldout_idx"]), record["fingerprint"], vocab)
    trained = Path(paths.trained)
    main = DraftSource(trained / "draft", Path(paths.draft), "distilled", True, record["selected"], record["draft"],
                       record["training"], record["learning_curve"], record["after_training"])
    none = {**record["training"], "steps": 0, "train_tokens": 0, "minutes": 0.0}
    init = DraftSource(trained / "draft_init", Path(paths.draft_init), "undistilled, calibrated", False, "init",
                       record["draft"], none, [], None)
    return main, init, split


def given_draft(inputs: Inputs, weights: Path) -> tuple[DraftSource, None, Split]:
    """calibrate.draft=<dir> (a published draft, another run's export) to ${paths.draft}, alone, on the
    held-out rows distill.split chooses; its FR-Spec head and provenance from its speculative.json if it has one."""
    own = SpeculativeSpec.read(weights)
    _, heldout_idx = split_collected(inputs.collected, inputs.settings.split, int(inputs.cfg.seed))
    vocab = torch.tensor(own.vocab_subset, dtype=torch.long) if own and own.vocab_subset else None
    name = hashlib.sha256(str(weights.resolve()).encode()).hexdigest()[:16]  # names its engine files
    source = DraftSource(weights, Path(inputs.cfg.paths.draft), "calibrated", bool(own and own.distilled),
                         own.selected if own else "init", own.draft if own else {"init": "pretrained", "path": str(weights)},
                         own.training if own else {}, own.learning_curve if own else [], None)
    return source, None, Split(None, heldout_idx, name, vocab)


def engine_rival(init_job: Inputs | None, main: DraftSource, keep_best: bool):
    """The initial weights an engine with a rule of its own judges the trained ones against (distill/engines.py
    weights_for_rule): only where training ran, was kept, and keep_best is on (keep_best=false ships the trained
    weights to every engine)."""
    return init_job.draft if init_job is not None and main.selected == "distilled" and keep_best else None


def check_draft_dir(weights: Path) -> None:
    if not (weights / "config.json").is_file():
        raise PipelineError(f"calibrate.draft={weights} is not a model directory (no config.json): point it "
                            "at a draft's weights or export")


def with_draft(inputs: Inputs, weights: Path) -> Inputs:
    """`inputs` with the draft at `weights`, loaded in the serving dtype on the target's device, its tokenizer
    checked."""
    device = next(inputs.target.parameters()).device
    draft, tokenizer = load_model(weights, device, inputs.serving_dtype), load_tokenizer(weights)
    check_compatible(inputs.tokenizer, tokenizer, inputs.target, draft)
    return replace(inputs, draft=draft, draft_tokenizer=tokenizer, draft_info={})


# ---------------------------------------------------------------- one draft's recipe
def calibrate_draft(job: Inputs, split: Split, heldouts: HeldOuts, before: dict, profile: dict, source: DraftSource,
                    calibration: Calibration | None = None) -> tuple[SpeculativeSpec, Calibration]:
    """The draft's calibration on the calibration part (or `calibration`, already chosen for the same weights)
    and its speculative.json, every number on the reporting part."""
    calibration = calibration or choose_recipe(job, split, heldouts.calibration, profile, str(source.out))
    after = serving_acceptance(job, heldouts.reporting, split.vocab)
    return build_spec(job, split, heldouts, before, after, source, calibration), calibration


def build_spec(job: Inputs, split: Split, heldouts: HeldOuts, before: dict, after: dict, source: DraftSource,
               calibration: Calibration) -> SpeculativeSpec:
    """speculative.json: the calibration, and every reported number measured on the reporting part."""
    gamma, reporting = int(job.settings.heldout.gamma), heldouts.reporting
    calibrated = sim.acceptance_at(job.draft, reporting, calibration.temperature, split.vocab)
    trees = tree_candidates(job, split, reporting, calibration)
    # what engines that run the exported checkpoint's full head get (export.py writes the subset into it)
    full_head = sim.acceptance_at(exported_weights(job.draft, split.vocab_list, calibration.head_fill), reporting,
                                  calibration.temperature)
    return SpeculativeSpec(
        job.target_ident, job.sampling, {**source.info, "parameters": sum(p.numel() for p in job.draft.parameters())},
        split.vocab_list, distilled=source.distilled, recipes=_with_default(calibration.recipes),
        tree_candidates=_with_default(trees) if trees else {}, selected=source.selected,
        acceptance={"before": acceptances(before), "after": acceptances(after),
                    "after_training": source.after_training or acceptances(after),
                    "after_calibrated": _per_domain(calibrated, reporting), "full_head": _per_domain(full_head, reporting)},
        mean_accepted_length={"gamma": gamma, **{name: {k: v["mean_accepted_length"] for k, v in summary.items()}
                                                 for name, summary in (("before", before), ("after", after))}},
        per_position_acceptance={k: v["per_position_acceptance"] for k, v in after.items()},
        predicted_speedup=predict_speedup(job, split, reporting, calibrated, calibration, trees),
        cost=calibration.cost, training=source.training, learning_curve=source.curve, heldout=heldouts.sizes)


def export_init(job: Inputs, split: Split, heldouts: HeldOuts, before: dict, profile: dict, source: DraftSource,
                calibration: Calibration | None) -> None:
    """${paths.draft_init} with its own serving calibration (τ, γ, policy, tree for the same cost profile):
    comparing the distilled draft against an uncalibrated one would credit distillation with what calibration
    alone buys. calibrate.calibrate_init=false: the weights with their held-out acceptance alone."""
    if not job.settings.calibration.calibrate_init:
        spec = SpeculativeSpec(job.target_ident, job.sampling, source.info, split.vocab_list, distilled=False,
                               selected="init", acceptance={"before": acceptances(before)}, heldout=heldouts.sizes)
        save_draft(copy.deepcopy(job.draft).to(job.serving_dtype), job.draft_tokenizer, source.out,
                   job.target.generation_config,
                   ExportParts(spec, head_fill=sim.out_of_subset_fill(job.draft, heldouts.calibration, split.vocab)))
        return
    spec, calibration = calibrate_draft(job, split, heldouts, before, profile, source, calibration)
    save_calibrated(job, spec, profile, calibration.head_fill, source,
                    speculation=speculation_profile(job, split, heldouts, spec, source))
    log(f"exported {source.out} with its own calibration (predicted speedup "
        f"{spec.predicted_speedup.get(sim.OVERALL)}×)")


# ---------------------------------------------------------------- export
def save_calibrated(job: Inputs, spec: SpeculativeSpec, profile: dict, head_fill: torch.Tensor | None,
                    source: DraftSource, files: dict[str, Path] | None = None, speculation: dict | None = None) -> None:
    """A copy of the draft in the serving dtype with its calibration, model card, cost profile and
    speculation profile."""
    generation_config = copy.deepcopy(job.target.generation_config)
    hf_setting = ((spec.engines.get("hf") or {}).get("generation_config") or {}).get(DEFAULT)
    # HF assisted generation reads these from the assistant: HF's own calibration where there is one (a default
    # calibrated "off" keeps our decoder's; the card says to serve without the draft there)
    for key, value in (hf_setting or spec.recipe(DEFAULT).chain.hf_generation_config()).items():
        setattr(generation_config, key, value)
    card = model_card(spec, f"{job.cfg.model.draft.name} ({source.label})")
    save_draft(copy.deepcopy(job.draft).to(job.serving_dtype), job.draft_tokenizer, source.out, generation_config,
               ExportParts(spec, card, {FILENAME: profile, sp.FILENAME: speculation and sp.check(speculation, sp.FILENAME)},
                           head_fill, files))


def speculation_profile(job: Inputs, split: Split, heldouts: HeldOuts, spec: SpeculativeSpec,
                        source: DraftSource) -> dict:
    """speculation_profile.json (pipeline/measure/speculation_profile.py): per domain and overall, the reporting part's
    per-position rates with the draft sampled at the serving temperature — the numbers evidence.json's
    per_position_acceptance and mean_accepted_length give — with intervals over its rows. α is computed again
    as serving_acceptance computed it (one draft pass over the reporting part) because only per-row sums
    give intervals."""
    reporting, sampling = heldouts.reporting, job.sampling
    alpha = sim.acceptance(job.draft, reporting, [sampling.temperature], split.vocab)[0]
    sections = profile_sections(alpha, reporting, len(spec.per_position_acceptance[sim.OVERALL]))
    conditions = {
        "source": sp.HELDOUT, **sampling.to_dict(), "draft_temperature": sampling.temperature,
        # the rates are of the draft sampled at T, which is what an engine that cannot set τ serves
        "recipe_draft_temperature": {d: r.draft_temperature for d, r in spec.recipes.items()},
        "draft_length_policy": "every block of k = 1..K drafts at every completion position, teacher-forced",
        "recipe_drafting": {d: r.to_dict()["drafting"] for d, r in spec.recipes.items()},
        "draft_dtype": str(job.draft.dtype).removeprefix("torch."),
        "target_dtype": str(job.serving_dtype).removeprefix("torch."),
        "device": str(next(job.target.parameters()).device),
        "heldout": {"part": "reporting", **heldouts.sizes["reporting"], "disjoint": heldouts.sizes["disjoint"]},
        "units": "held-out rows", "interval": f"percentile bootstrap over units, {sp.N_RESAMPLES} resamples"}
    draft = {"name": job.cfg.model.draft.get("name"), "selected": source.selected, "distilled": source.distilled,
             **spec.draft}
    return sp.build(sections, sim.OVERALL, conditions, target=spec.target, draft=draft,
                    reported={"gamma": spec.mean_accepted_length["gamma"], **spec.mean_accepted_length["after"]})


def profile_sections(alpha: torch.Tensor, heldout: sim.HeldOut, k: int) -> dict[str, dict]:
    """Per domain and overall, the profile's rates of blocks of up to k drafts, with intervals over rows."""
    return {name: sp.section(*(t.numpy() for t in sim.per_position_windows(alpha, heldout, mask, k)))
            for name, mask in sim.domain_index(heldout).items()}


def report(inputs: Inputs, spec: SpeculativeSpec, out: Path) -> None:
    """The per-domain table, and the calibration's numbers to MLflow."""
    cost, acceptance = spec.cost, spec.acceptance
    print(f"{format_table(spec)}\nc = {cost['c']:.3f} (draft {cost['draft_forward_ms']:.1f} ms, target "
          f"{cost['target_forward_ms']:.1f} ms, {cost['device']} {cost['dtype']}); numbers on the reporting part")
    inputs.tracker.log_metrics({
        **{f"calibrated_acceptance/{k}": v for k, v in acceptance["after_calibrated"].items()},
        **{f"full_head_acceptance/{k}": v for k, v in acceptance["full_head"].items()},
        **{f"draft_temperature/{k}": r.draft_temperature for k, r in spec.recipes.items()},
        **{f"best_gamma/{k}": r.gamma for k, r in spec.recipes.items()},
        **{f"predicted_speedup/{k}": v for k, v in spec.predicted_speedup.items()}, "c": spec.cost["c"]})
    for name in ("speculative.json", "README.md", sp.FILENAME):
        inputs.tracker.log_artifact(str(out / name))


def _per_domain(alpha: torch.Tensor, heldout: sim.HeldOut) -> dict[str, float]:
    return {domain: float(alpha[mask].mean()) if mask.any() else 0.0 for domain, mask in sim.domain_index(heldout).items()}


def _with_default(per_domain: dict) -> dict:
    out = {k: v for k, v in per_domain.items() if k != sim.OVERALL}
    out[DEFAULT] = per_domain[sim.OVERALL]
    return out
