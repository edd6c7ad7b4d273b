"""Eval stage: the project's speculative decoder against plain target decoding, per domain, timed by
eval/harness.py; writes metrics.json, report.md, requests.jsonl and PNG plots to ${paths.eval} in one atomic rename.

    python -m pipeline stage=eval [eval.draft=<dir>|derive] [eval.prompts_file=<jsonl>] [eval.drafting=...] ...
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from eval import metrics as M
from eval.baselines import hf_engine_methods
from eval.drafts import Draft, Evaluation, load_models  # noqa: F401  (Draft: the plan's input type)
from eval.fidelity import NEAR_TIE_ULPS, diagnose, fidelity_check, fp32_recheck
from eval.report import control_lines, log_to_tracker, machine, slowdown_advice, stall_lines, write_outputs
from eval.tables import batch_rows, batch_verdict, comparison_lines, domain_rows, draft_rows, policy_rows, text_table
from eval.settings import EvalSettings
from eval.harness import benchmark
from eval.sweeps import batch_sweep, gamma_sweep, tree_sweep
from pipeline.decoding import POLICIES, DraftLength, DraftPlan, autoregressive_generate, speculative_generate
from pipeline.decoding.draft_length import UNCALIBRATED_CONFIDENCE
from pipeline.engines.hf import assistant_configs, hf_generate
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from pipeline.decoding.spec import CALIBRATED, Recipe, SpeculativeSpec
from pipeline.timing import Laps

# ---------------------------------------------------------------- inputs

def output_dir(cfg: DictConfig) -> Path:
    """${paths.eval}; under a Hydra multirun each job writes into its own job directory instead
    (`<hydra.sweep.dir>/<job num>/eval`, next to `.hydra/overrides.yaml`), so jobs never overwrite each other."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return Path(hydra_cfg.runtime.output_dir) / "eval"
    except ValueError:  # HydraConfig is unset when run() is called outside @hydra.main (tests, notebooks)
        pass
    return Path(cfg.paths.eval)


def load_eval_prompts(cfg: DictConfig, settings: EvalSettings) -> tuple[dict[str, list[dict]], str]:
    """{domain: prompts} in file order, at most eval.max_prompts_per_domain each; and where they came from."""
    from pipeline.control.prompts import by_domain, keep_domains, load_prompts, load_split

    if settings.prompts_file == HELDOUT:
        ids = heldout_prompt_ids(Path(settings.draft or cfg.paths.draft))
        source = f"{cfg.paths.prompts}/train.jsonl, the draft's reporting part ({len(ids)} prompts)"
        rows = [row for row in load_split(cfg.paths.prompts, "train", settings.domains) if row["id"] in ids]
    elif settings.prompts_file:  # our schema or Spec-Bench's
        source = str(settings.prompts_file)
        rows = keep_domains(load_prompts(source), settings.domains, f"(eval.domains) have no prompts in {source}",
                            "fix eval.domains or the file")
    else:
        source = f"{cfg.paths.prompts}/eval.jsonl (held-out split of the prepare stage)"
        rows = load_split(cfg.paths.prompts, "eval", settings.domains)
    return by_domain(rows, settings.max_prompts_per_domain), source


HELDOUT = "heldout"  # eval.prompts_file: the prompts the calibration's predictions were made on


def heldout_prompt_ids(draft: Path) -> set[str]:
    """The prompts of the reporting part the draft's calibration predicted on (evidence.json heldout.prompt_ids)."""
    spec = SpeculativeSpec.read(draft)
    ids = ((spec.heldout if spec else {}).get("prompt_ids") or {}).get("reporting")
    if not ids:
        raise PipelineError(f"eval.prompts_file={HELDOUT}: {draft} records no held-out prompts (a calibration from "
                            "before they were recorded, or none): rerun stage=calibrate, or give a prompts file")
    return set(ids)


# ---------------------------------------------------------------- plans

def draft_plan(draft: Draft, domain: str, settings: EvalSettings, sampling: Sampling, drafting=None) -> DraftPlan:
    """One draft's plan on one domain: eval.drafting (or `drafting`, a compared policy) applied to the draft's
    calibration (spec.plan: its tree, τ and "off" only for the sampling it was calibrated for, its guard), the
    draft's vocabulary subset, and eval.draft_temperature over the calibrated τ. A domain planned "off" keeps its
    τ, so the sweeps, which force a shape, draft there as everywhere else."""
    wanted = settings.drafting if drafting is None else drafting
    spec = None if wanted == "uncalibrated" else draft.spec
    shape = drafting_shape(wanted, spec, domain, sampling)
    if spec is None:
        plan = DraftPlan(DraftLength() if shape is CALIBRATED else shape)
    else:
        plan = spec.plan(domain, sampling, drafting=shape, guard=settings.guard_settings, vocab=False)
        if not plan.speculates:  # off: the chain's τ, for a sweep that forces drafting here
            plan = replace(spec.plan(domain, sampling, drafting=spec.recipe(domain).chain or DraftLength()),
                           drafting=None)
    tau = plan.draft_temperature if settings.draft_temperature is None else settings.draft_temperature
    return replace(plan, draft_temperature=None if sampling.greedy else tau, draft_vocab=draft.vocab)


def drafting_shape(wanted, spec, domain: str, sampling: Sampling):
    """eval.drafting as what spec.plan's `drafting` takes: CALIBRATED (the recipe's own), None (plain), a policy
    or a tree. A policy the calibration chose is used with its calibrated parameters."""
    recipe = spec.recipe(domain) if spec is not None else Recipe()
    calibrated, gamma = recipe.chain, recipe.gamma or DraftLength().max
    if wanted in ("calibrated", "uncalibrated"):
        return CALIBRATED
    if wanted == "off":
        return None
    if wanted == "chain":  # the calibrated chain, "off" still honoured
        off = spec is not None and spec.sampling == sampling and not recipe.speculate
        return None if off else calibrated or DraftLength("fixed", gamma)
    if isinstance(wanted, dict):
        return DraftLength.from_dict(wanted)
    if wanted in POLICIES:
        if calibrated is not None and calibrated.policy == wanted:
            return calibrated
        return UNCALIBRATED_CONFIDENCE if wanted == "confidence" else DraftLength(wanted, gamma)
    return wanted  # an int γ or a tree's branching factors


def fixed_gamma(draft: Draft, domain: str, settings: EvalSettings) -> int:
    """The fixed γ HF assisted generation's `hf_assisted_fixed` runs."""
    if isinstance(settings.drafting, int):
        return settings.drafting
    spec = draft.spec if settings.drafting != "uncalibrated" else None
    return (spec.recipe(domain).gamma if spec is not None else None) or DraftLength().max


def make_plans(evaluation: Evaluation, domains: list[str]) -> dict:
    """{method: {domain: DraftPlan}} for every draft, the unguarded baseline and each compared policy."""
    settings, sampling = evaluation.settings, evaluation.sampling
    spec = evaluation.drafts["speculative"].spec
    if (settings.drafting != "uncalibrated" and not sampling.greedy and settings.draft_temperature is None
            and spec is not None and spec.sampling != sampling):
        print(f"[eval] note: the draft's τ was calibrated for {spec.sampling}, not {sampling}; the draft samples "
              "at the eval temperature (set eval.draft_temperature to choose one)")
    every = [*domains, "default"]
    plans = {name: {d: draft_plan(draft, d, settings, sampling) for d in every}
             for name, draft in evaluation.drafts.items()}
    if settings.guard["compare"]:  # the evaluated draft as planned, never switched down: the guard's own baseline
        plans["speculative_unguarded"] = {d: replace(plan, guard=None) for d, plan in plans["speculative"].items()}
    for policy in settings.compare_draft_lengths:  # the evaluated draft once per policy, side by side
        plans[f"speculative_{policy}"] = {d: draft_plan(evaluation.drafts["speculative"], d, settings, sampling,
                                                        policy) for d in every}
    return plans


# ---------------------------------------------------------------- timed decoding

def _hf_methods(evaluation: Evaluation) -> dict:
    """The eval.baselines (eval/baselines.py), each domain's γ and policy taken from the assistant draft's plan."""
    settings, sampling = evaluation.settings, evaluation.sampling
    assistant_name = settings.baselines_draft
    if assistant_name not in evaluation.drafts:
        raise PipelineError(f"eval.baselines_draft={assistant_name} is not loaded here (drafts: "
                            f"{', '.join(evaluation.drafts)}): use speculative, or speculative_init when an "
                            "undistilled draft exists")
    draft = evaluation.drafts[assistant_name]
    assistant = draft.model
    configs = {domain: assistant_configs(assistant, fixed_gamma(draft, domain, settings),
                                         plan.as_chain().hf_generation_config())
               for domain, plan in evaluation.plans[assistant_name].items()}

    def hf(draft=None, which: str = "defaults"):
        def generate(ids, domain, n, seed):
            torch.manual_seed(seed)  # HF samples from the global RNG
            config = configs[domain][which] if draft is not None else None
            return hf_generate(evaluation.target, ids, n, sampling, evaluation.stop, draft, config)
        return generate

    every = {"hf_generate": hf(), "hf_assisted": hf(assistant), "hf_assisted_fixed": hf(assistant, "fixed"),
             "hf_assisted_calibrated": hf(assistant, "calibrated")}
    return {name: every[name] for name in settings.baselines}


def make_methods(evaluation: Evaluation) -> dict:
    """{method name: fn(input_ids, domain, max_new_tokens, seed) -> (token ids, DecodeStats | None)}."""
    if evaluation.settings.engine == "hf":
        return hf_engine_methods(evaluation)
    target, sampling, stop = evaluation.target, evaluation.sampling, evaluation.stop

    def autoregressive(ids, domain, n, seed):
        out = autoregressive_generate(target, ids, sampling=sampling, max_new_tokens=n, eos_token_id=stop,
                                      generator=evaluation.generator(seed))
        return out.tokens.tolist(), out.stats

    def speculative(name, draft_name=None):
        draft = evaluation.drafts[draft_name or name]

        def generate(ids, domain, n, seed, gamma=None, tree=None):
            plan = evaluation.plans[name][domain]
            if gamma or tree:  # the sweeps measure each shape as it is: drafting, never switched down
                plan = replace(plan, drafting=tree or gamma, guard=None)
            out = speculative_generate(target, draft.model, ids, plan=plan, sampling=sampling, max_new_tokens=n,
                                       eos_token_id=stop, generator=evaluation.generator(seed))
            return out.tokens.tolist(), out.stats
        return generate

    methods = {"autoregressive": autoregressive, **{name: speculative(name) for name in evaluation.drafts}}
    # the compared plans (unguarded, fixed τ, each policy) all run the evaluated draft
    methods.update({name: speculative(name, "speculative") for name in evaluation.plans if name not in methods})
    if evaluation.settings.baselines:
        methods.update(_hf_methods(evaluation))
    return methods


# ---------------------------------------------------------------- metrics

def core_metrics(records: list[dict], evaluation: Evaluation) -> dict:
    settings, drafts = evaluation.settings, evaluation.drafts
    core = M.build(records, evaluation.plans, evaluation.sampling.temperature, band=settings.control_band,
                   stalls=evaluation.stalls, min_ci_requests=settings.min_requests_for_ci)
    init = drafts.get("speculative_init")
    return {"gamma": core.pop("gamma"), "temperature": core.pop("temperature"), "top_k": settings.top_k,
            "top_p": settings.top_p, "max_new_tokens": settings.max_new_tokens,
            "target": str(evaluation.target_path), "draft": drafts["speculative"].identity["source"],
            "draft_init": init.identity["source"] if init else None, **core, **measured(records, evaluation)}


def measured(records: list[dict], evaluation: Evaluation) -> dict:
    """{"measured": the tuned draft's per-position acceptance in speculation_profile.json's shape} when our
    decoder ran it (an engine's counters are per request, not per pass), else {}."""
    settings = evaluation.settings
    if settings.engine != "ours":
        return {}
    conditions = {**evaluation.sampling.to_dict(), "max_new_tokens": settings.max_new_tokens,
                  "drafting": {d: plan.to_dict() for d, plan in evaluation.plans[M.SPECULATIVE].items()},
                  "dtype": str(evaluation.dtype).removeprefix("torch."), "device": str(evaluation.device),
                  "target": str(evaluation.target_path), "draft": evaluation.drafts[M.SPECULATIVE].identity["source"]}
    profile = M.measured_profile(records, conditions)
    return {"measured": profile} if profile else {}


def predictions(evaluation: Evaluation, domains: list[str]) -> dict | None:
    """Per domain, distill's predicted speedup for what the evaluated draft runs there (1.0 where calibrated
    "off"), when it runs as calibrated for this serving; None when eval overrides the calibration."""
    settings, spec = evaluation.settings, evaluation.drafts[M.SPECULATIVE].spec
    overridden = settings.drafting != "calibrated" or settings.draft_temperature is not None or settings.engine != "ours"
    if spec is None or overridden or spec.sampling != evaluation.sampling:
        return None
    table = {d: spec.predicted_speedup.get(d, spec.predicted_speedup.get("overall")) for d in domains}
    return {d: {"speedup": float(v) if spec.recipe(d).speculate else 1.0, "speculate": spec.recipe(d).speculate}
            for d, v in table.items() if v is not None}


def predicted_overall(predicted: dict, records: list[dict]) -> dict | None:
    """The per-domain predictions mixed as eval mixes its requests: Σ tokens / Σ (tokens / predicted speedup) over
    the domains' tokens the evaluated draft generated, each domain at its own recipe. The calibration's own
    "overall" is its default recipe on every held-out position pooled, which weighs domains by their held-out
    positions, not by these requests (docs/results.md)."""
    tokens: dict[str, int] = {}
    for r in records:
        if r["method"] == M.SPECULATIVE and r["domain"] in predicted:
            tokens[r["domain"]] = tokens.get(r["domain"], 0) + len(r["tokens"])
    if not sum(tokens.values()):
        return None
    plain_equivalent = sum(n / predicted[d]["speedup"] for d, n in tokens.items())  # in plain decoding's token times
    return {"speedup": sum(tokens.values()) / plain_equivalent, "tokens": tokens}


def heldout_acceptance(evaluation: Evaluation) -> dict:
    """Per draft method, the held-out acceptance its calibration measured per domain (at its calibrated τ, on the
    reporting part: speculative.json `acceptance.after_calibrated`), for the report's picture beside eval's own."""
    return {name: dict(draft.spec.acceptance["after_calibrated"]) for name, draft in evaluation.drafts.items()
            if draft.spec is not None and draft.spec.acceptance.get("after_calibrated")}


def fidelity(metrics: dict, records: list[dict], contexts: list[dict], evaluation: Evaluation) -> dict | None:
    """Greedy speculative vs autoregressive output: a separate greedy run when sampling, the benchmark's own
    outputs when greedy; mismatches of the tuned draft in reduced precision are rerun in fp32."""
    settings, target, stop = evaluation.settings, evaluation.target, evaluation.stop
    tuned, plans = evaluation.drafts[M.SPECULATIVE], evaluation.plans[M.SPECULATIVE]
    if not evaluation.sampling.greedy and settings.fidelity_prompts_per_domain:
        result = fidelity_check(contexts, target, tuned, plans, stop, settings)
    elif "fidelity" in metrics:
        own = tuple(m for m in metrics["methods"] if m.startswith(M.SPECULATIVE))  # every draft and policy
        result = metrics["fidelity"] | {"mismatches": diagnose(records, contexts, target, own),
                                        "near_tie_ulps": NEAR_TIE_ULPS}
    else:
        return None
    tuned_mismatches = [m for m in result["mismatches"] if m.get("method", M.SPECULATIVE) == M.SPECULATIVE]
    if settings.fp32_recheck and evaluation.dtype != torch.float32 and tuned_mismatches:
        result["fp32"] = fp32_recheck(contexts, target, tuned, plans, stop, settings, tuned_mismatches)
    return result


def setup_section(evaluation: Evaluation, prompts: dict, source: str) -> dict:
    """Where and with what the numbers were measured."""
    settings = evaluation.settings
    tuned, init = evaluation.drafts["speculative"], evaluation.drafts.get("speculative_init")
    calibrated = settings.drafting == "calibrated" and tuned.spec is not None and bool(tuned.spec.recipes)
    return {
        "machine": machine(), "device": str(evaluation.device), "dtype": str(evaluation.dtype).removeprefix("torch."),
        "target": evaluation.target_identity,
        "draft": tuned.identity | {"vocab_subset": None if tuned.vocab is None else len(tuned.vocab)},
        "draft_init": init.identity if init else None,
        "calibrated": bool(calibrated),
        "prompt_source": source, "settings": asdict(settings),
        "prompts": {domain: {"n_prompts": len(ps), "n_turns": sum(len(p["turns"]) for p in ps)}
                    for domain, ps in prompts.items()},
    }


# ---------------------------------------------------------------- the stage

def run(cfg: DictConfig, tracker) -> dict:
    settings = EvalSettings.from_config(cfg.eval)  # checked before any model is loaded: bad input writes nothing
    sampling = settings.sampling
    out_dir = output_dir(cfg)
    if settings.engine == "vllm":
        from eval.engine_vllm import require_vllm, run_vllm  # imports vLLM only when asked for

        require_vllm()  # before any prompt or model is read
    prompts, source = load_eval_prompts(cfg, settings)
    if settings.engine == "llamacpp":
        from eval.engine_llamacpp import run_llamacpp  # builds and starts llama.cpp only when asked for

        return run_llamacpp(cfg, tracker, settings, prompts, source, out_dir)
    if settings.engine == "vllm":
        return run_vllm(cfg, tracker, settings, prompts, source, out_dir)
    evaluation = load_models(cfg, settings, sampling)
    evaluation.plans = make_plans(evaluation, list(prompts))
    methods = make_methods(evaluation)
    print(f"[eval] {sum(map(len, prompts.values()))} prompts in {len(prompts)} domains from {source}; "
          f"methods: {', '.join(methods)}; T={sampling.temperature}, max_new_tokens={settings.max_new_tokens}")

    started, laps = time.time(), Laps()
    records, contexts = benchmark(prompts, methods, evaluation, cfg.seed)
    laps.lap("requests")
    metrics = core_metrics(records, evaluation)
    predicted = predictions(evaluation, list(prompts))
    if predicted:
        metrics["predicted"] = predicted
        metrics["predicted_overall"] = predicted_overall(predicted, records)
    metrics["heldout_acceptance"] = heldout_acceptance(evaluation)
    if settings.gammas:
        metrics["gamma_sweep"] = gamma_sweep(contexts, methods, evaluation, cfg.seed)
        laps.lap("gamma_sweep")
    if settings.trees:
        metrics["tree_sweep"] = tree_sweep(contexts, methods, evaluation, cfg.seed)
        laps.lap("tree_sweep")
    if settings.batch_sizes:
        metrics["batch_sweep"] = batch_sweep(contexts, evaluation, cfg.seed)
        laps.lap("batch_sweep")
    checked = fidelity(metrics, records, contexts, evaluation)
    if checked is not None:
        metrics["fidelity"] = checked
        laps.lap("fidelity")
    metrics["wall_s"] = time.time() - started
    metrics["wall_s_parts"] = dict(laps.parts)
    metrics["budget"] = evaluation.budget
    metrics["setup"] = setup_section(evaluation, prompts, source)

    plots = write_outputs(out_dir, metrics, records)
    print(text_table(*domain_rows(metrics)))
    if settings.compare_draft_lengths:
        print(text_table(*policy_rows(metrics)))
    if settings.extra_drafts:
        print(text_table(*draft_rows(metrics)))
    if (metrics.get("batch_sweep") or {}).get("by_batch"):
        print(text_table(*batch_rows(metrics["batch_sweep"])) + "\n" + batch_verdict(metrics["batch_sweep"]))
    print("\n".join(comparison_lines(metrics) + control_lines(metrics) + stall_lines(metrics)))
    if advice := slowdown_advice(metrics):
        print(f"[eval] {advice}")
    print(f"[eval] wrote {out_dir}/metrics.json, report.md and {len(plots)} plots; {laps.summary()}")
    log_to_tracker(tracker, metrics, out_dir)
    overall = metrics["overall"]
    return {"metrics": str(out_dir / "metrics.json"),
            "overall": {key: overall[key] for key in ("acceptance_rate", "mean_accepted_length", "speedup")}}
