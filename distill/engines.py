"""Calibration for the engines that serve the export (speculative.json `engines`), beside our decoder's own
(`calibrate.engines`), each planned under the draft sampling and verification it runs at the version named
(pipeline/engines/rules.py), recorded per engine (`rules`) and per domain (`rule`).

llama.cpp drafts greedily, at most n_max tokens, and stops *before* a token whose draft probability (softmax over the
top-10 logits of its draft sampler) is below p_min; the target keeps the draft's tokens while its own equal them
(pipeline/engines/llamacpp.py). So the simulator (distill/policy.py, `stop_before=True`) runs with α_t = p_T(argmax
q_t) and κ_t = 1[top-10 softmax max ≥ p_min], priced through the engine on this device (llama-bench's forwards,
llama-server's timings for its work between them: `server_host`). Per domain the (n_max, p_min) predicted fastest on
the calibration part wins; "off" (plain decoding) unless it beats 1 + margin.
"""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from distill import simulator as sim
from distill.export import exported_weights
from distill.policy import pass_profile_rows, simulate
from pipeline.measure import speculation_profile as sp
from pipeline.decoding.cost import pass_speedup, verify_cost
from pipeline.engines import hf, llamacpp
from pipeline.engines.rules import (
    UNFILTERED_DRAFT,
    VERSIONS,
    candidate_rules,
    rule_record,
)
from pipeline.machine import cpu_name
from pipeline.modelio.models import model_gguf, resolve_model
from pipeline.sampling import Sampling
from pipeline.decoding.spec import DEFAULT, SpeculativeSpec

DRAFT_TOP_K = 10  # llama.cpp's draft sampler (common/speculative.cpp: top_k = 10, the only sampler)


@torch.no_grad()
def llamacpp_keep(draft, heldout: sim.HeldOut, thresholds: list[float], vocab=None) -> torch.Tensor:
    """κ [len(thresholds), N]: 1 where llama.cpp would still propose the draft's token at a held-out position."""
    limits = torch.tensor(thresholds, device=next(draft.parameters()).device).view(-1, 1)
    out = []
    for logits in sim.draft_logits(draft, heldout, vocab):
        top = logits.topk(min(DRAFT_TOP_K, logits.shape[-1]), -1).values.softmax(-1)[:, 0]
        out.append((top >= limits).float().cpu())
    return torch.cat(out, 1)


def weights_for_rule(trained, initial, heldout: sim.HeldOut, vocab=None, rule: str = "interval") -> dict:
    """keep_best under greedy drafting, on the calibration part: distill's keep_best judged the trained weights by
    α with the draft sampled at τ (our decoder's rule); an engine that drafts the argmax accepts p_T(argmax q),
    which training can lower while Σ min(p_T, q) rises (docs/results.md: the refined Qwen draft in llama-server).
    Returns speculative.json's `weights` record: {"selected": "distilled" | "init", "acceptance_calibration":
    {"distilled", "init"}, "difference", "ci95", "rule"}, judged as keep_best judges (distill/simulator.py)."""
    greedy = {name: sim.acceptance(model, heldout, [0.0], vocab)[0] for name, model in (("init", initial),
                                                                                       ("distilled", trained))}
    verdict = sim.keep_best(greedy["init"], greedy["distilled"], heldout, rule)
    return {"selected": verdict["selected"], "acceptance_calibration": {"distilled": verdict["trained"],
                                                                       "init": verdict["initial"]},
            **{key: verdict[key] for key in ("difference", "ci95", "rule")}}


def engine_cost(root: Path, target_gguf: Path, draft_gguf: Path, max_draft: int, depth: int, repeats: int,
                threads: int | None) -> dict:
    """The cost summary (pipeline/decoding/cost.py) of llama.cpp's passes on this device, from llama-bench."""
    target = llamacpp.bench(root, target_gguf, tuple(range(1, max_draft + 2)), depth, repeats, threads)
    draft = llamacpp.bench(root, draft_gguf, (1,), depth, repeats, threads)
    step = target[1]
    return {"engine": "llamacpp", "c": draft[1] / step, "verify_ratio": {n: target[n + 1] / step for n in range(1, max_draft + 1)},
            "target_forward_ms": step, "draft_forward_ms": draft[1], "context": depth, "device_name": cpu_name()}


HOST_SETTINGS = (llamacpp.DraftSettings(1, 0.0), llamacpp.DraftSettings(4, 0.0))  # drafts per pass the host is timed at
HOST_TOKENS, HOST_PROMPTS = 32, 4


def server_host(root: Path, target_gguf: Path, draft_gguf: Path, prompts: list[list[int]], cost: dict,
                engine) -> dict:
    """The `host` block of llama.cpp's cost (pipeline/decoding/cost.py host_cost): llama-server's own work per pass
    beyond the forwards llama-bench prices (sampling over the whole vocabulary, the draft's sampler, the slot's
    bookkeeping), in llama-bench target steps. Timed from the server's per-request `timings` of greedy decodes of
    `prompts`: plain decoding, and drafting with each of HOST_SETTINGS (no p_min stop, so the drafts per pass are
    known); per pass, its milliseconds less what llama-bench prices for the same forwards."""
    step = cost["target_forward_ms"]

    def decode(settings):  # (ms per pass, drafts per pass)
        draft = draft_gguf if settings else None
        with llamacpp.Server(root, target_gguf, draft, settings or llamacpp.DraftSettings(), engine.threads,
                             context=int(engine.context), start_timeout=float(engine.start_timeout)) as server:
            server.complete(prompts[0], 4, Sampling(0.0), 0)  # the first request warms the server's buffers
            ms = passes = drafted = 0.0
            for ids in prompts:
                timings = server.complete(ids, HOST_TOKENS, Sampling(0.0), 0)["timings"]
                ms += timings["predicted_ms"]
                passes += max(timings["predicted_n"] - timings.get("draft_n_accepted", 0), 1)  # accepted + 1 a pass
                drafted += timings.get("draft_n", 0)
        return ms / passes, drafted / passes

    plain_ms, _ = decode(None)
    chain = {}
    for settings in HOST_SETTINGS:
        ms, drafted = decode(settings)
        priced = drafted * cost["c"] + verify_cost(cost["verify_ratio"], drafted)
        chain[f"{drafted:.2f}"] = round(max(ms / step - priced, 0.0), 4)
    return {"plain": round(max(plain_ms / step - 1.0, 0.0), 4), "chain": chain, "source": "llama-server timings"}


def choose_llamacpp(draft, heldouts, vocab, cost: dict, chosen) -> dict[str, dict]:
    """Per domain (and default): the llama.cpp setting (`chosen`: calibrate.llamacpp's n_max and p_min candidates and
    margin) chosen on the calibration part of `heldouts`, with its predicted speedup and acceptance on the reporting
    part and the prediction for llama-server's own defaults beside it."""
    n_maxes, margin = list(chosen.n_max), chosen.margin
    thresholds = sorted({0.0, *chosen.p_min})
    parts = {}
    for name, heldout in (("calibration", heldouts.calibration), ("reporting", heldouts.reporting)):
        parts[name] = (sim.acceptance(draft, heldout, [0.0], vocab)[0], dict(zip(thresholds, llamacpp_keep(
            draft, heldout, thresholds, vocab))), heldout)

    def predict(part, mask, setting):
        alpha, keep, heldout = parts[part]
        drafted, accepted = simulate(alpha, keep[setting[1]], heldout, mask, setting[0], stop_before=True)
        return pass_speedup(accepted, drafted, drafted, cost), accepted / max(drafted, 1e-9)

    def per_pass(mask, setting):  # per draft position, what llama-server's counters measure (eval.engine=llamacpp)
        alpha, keep, heldout = parts["reporting"]
        rows = pass_profile_rows(alpha, keep[setting[1]], heldout, mask, setting[0], stop_before=True)
        return per_pass_prediction(*rows)

    def keys(best, shown):  # and the prediction for llama-server's own defaults beside the chosen setting
        server = (llamacpp.SERVER_DEFAULTS.n_max, llamacpp.SERVER_DEFAULTS.p_min)
        return {"rule": "greedy", "n_max": best[0], "p_min": best[1],
                "predicted_speedup_server_defaults": round(predict("reporting", shown, server)[0], 3),
                "predicted_per_pass": per_pass(shown, best),
                "predicted_per_pass_server_defaults": per_pass(shown, server)}
    return choose_per_domain(heldouts.calibration, heldouts.reporting, [(n, p) for n in n_maxes for p in chosen.p_min],
                             predict, margin, keys)


def choose_per_domain(calibration: sim.HeldOut, reporting: sim.HeldOut, options: list, predict, margin: float,
                      keys) -> dict[str, dict]:
    """Per domain (and default): the option with the best predicted speedup on `calibration` ("off" below 1 + margin)
    and its speedup and acceptance on `reporting`; predict(part, mask, option) -> (speedup, acceptance), keys(option,
    reporting mask) the engine's own keys for it."""
    out, reporting_masks = {}, sim.domain_index(reporting)
    for domain, mask in sim.domain_index(calibration).items():
        best = max(options, key=lambda option: predict("calibration", mask, option)[0])
        on = predict("calibration", mask, best)[0] > 1 + margin
        shown = reporting_masks.get(domain, reporting_masks[sim.OVERALL])
        speedup, acceptance = predict("reporting", shown, best)
        out[DEFAULT if domain == sim.OVERALL else domain] = {
            "speculate": on, **keys(best, shown), "predicted_speedup": round(speedup if on else 1.0, 3),
            "predicted_speedup_if_on": round(speedup, 3), "predicted_acceptance": round(acceptance, 4)}
    return out


def per_pass_prediction(proposed: torch.Tensor, accepted: torch.Tensor, passes: torch.Tensor) -> dict:
    """pass_profile's rates with percentile bootstrap intervals over held-out rows (pipeline/measure/speculation_profile.py
    section: a ratio of sums resampled by row), so eval can judge measured − predicted with both errors in it."""
    rows = passes > 0  # rows with no position in the domain carry no passes
    if not rows.any():
        return {"proposed": [], "accepted": [], "proposed_ci95": [], "accepted_ci95": [], "rows": 0}
    passes = passes[rows, None].expand(-1, proposed.shape[1]).numpy()  # every position's denominator
    out = {"rows": int(rows.sum())}
    for key, counts in (("proposed", proposed[rows]), ("accepted", accepted[rows])):
        section = sp.section(counts.numpy(), passes)
        out[key] = [round(float(v), 4) for v in section["marginal_accept_rates"]]
        out[f"{key}_ci95"] = section["marginal_accept_rates_ci95"]
    return out


def describe_table(table: dict, setting) -> str:
    """A chosen table in one log line: per domain setting(entry) and its predicted speedup, or "off"."""
    return "; ".join(f"{d} " + (f"{setting(e)} → {e['predicted_speedup']:.2f}×" if e["speculate"] else
                                f"off ({e['predicted_speedup_if_on']:.2f}× if on)") for d, e in table.items())


def draft_gguf(root: Path, draft, tokenizer, out: Path, quant: str | None) -> Path:
    """The export's weights (a model in memory) as GGUF, through a temporary HF directory."""
    with tempfile.TemporaryDirectory() as tmp:
        draft.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return llamacpp.hf_to_gguf(root, tmp, out, quant)


def typical_context(heldout: sim.HeldOut) -> int:
    """The KV-cache length a verify pass typically runs at: prompt plus half the completion, averaged."""
    lengths = [len(r["prompt_ids"]) + len(r["completion_ids"]) // 2 for r in heldout.rows]
    return max(1, int(sum(lengths) / max(len(lengths), 1)))


def calibrate_engines(inputs, split, heldouts, spec: SpeculativeSpec, head_fill, log,
                      initial=None) -> tuple[SpeculativeSpec, dict[str, Path]]:
    """speculative.json `engines` for the engines calibrate.engines names, and the files the export
    ships for them ({"draft.gguf": path}); (spec, {}) when none is asked for. `initial`: the draft's weights before
    training, which llama.cpp's draft.gguf is made from where they accept more under its rule (weights_for_rule)."""
    settings = inputs.settings.calibration
    if gpu_engines(settings) or "hf" in settings.engines:  # they run the full head, in the serving dtype
        weights = exported_weights(inputs.draft, split.vocab_list, head_fill).to(inputs.serving_dtype)
    if gpu_engines(settings):
        spec = replace(spec, engines={**spec.engines, **calibrate_gpu_engines(
            inputs.draft, weights, inputs.target, heldouts, split.vocab, settings, log)})
    if "hf" in settings.engines:
        spec = replace(spec, engines={**spec.engines, "hf": calibrate_hf(inputs, weights, heldouts, settings.hf, log)})
    if "llamacpp" not in settings.engines:
        return spec, {}
    engine, paths, chosen = inputs.cfg.engines.llamacpp, inputs.cfg.paths, settings.llamacpp
    root = llamacpp.build(paths.engines, str(engine.version), log)
    scratch = Path(paths.engines) / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    target = model_gguf(inputs.cfg.model.target, "target", paths)
    if target is None:  # an HF-directory target: llama.cpp's own converter, unquantised
        target = scratch / f"target-{split.fingerprint}-F16.gguf"
        if not target.is_file():
            llamacpp.hf_to_gguf(root, resolve_model(inputs.cfg.model.target, "target", paths), target, None)
    quant = engine.draft_quant or llamacpp.gguf_file_type(target)
    draft, chosen_weights = inputs.draft, {"selected": spec.selected}
    if initial is not None:
        chosen_weights = weights_for_rule(inputs.draft, initial, heldouts.calibration, split.vocab,
                                          settings.keep_best_rule)
        if chosen_weights["selected"] == "init":
            draft, head_fill = initial, sim.out_of_subset_fill(initial, heldouts.calibration, split.vocab)
        alpha = chosen_weights["acceptance_calibration"]
        log(f"llama.cpp serves the {chosen_weights['selected']} weights: under its greedy drafting the trained ones "
            f"accept {alpha['distilled']:.3f} on the calibration part, the initial ones {alpha['init']:.3f} "
            f"({chosen_weights['rule']} rule, interval of the difference {chosen_weights['ci95']})")
    weights = exported_weights(draft, split.vocab_list, head_fill).to(inputs.serving_dtype)
    name = f"draft-{split.fingerprint}-{chosen_weights['selected']}.gguf"
    gguf = draft_gguf(root, weights, inputs.draft_tokenizer, scratch / name, quant)
    cost = engine_cost(root, target, gguf, max(chosen.n_max), typical_context(heldouts.reporting), chosen.repeats,
                       engine.threads)
    prompts = [list(r["prompt_ids"]) for r in heldouts.reporting.rows[:HOST_PROMPTS]]
    cost["host"] = server_host(root, target, gguf, prompts, cost, engine)
    table = choose_llamacpp(draft, heldouts, split.vocab, cost, chosen)
    flags = {domain: llamacpp.draft_flags("draft.gguf", llamacpp.DraftSettings(entry["n_max"], entry["p_min"]))
             if entry["speculate"] else [] for domain, entry in table.items()}
    log("llama.cpp calibration (c = {:.3f}, r(1) = {:.2f}, server host work per pass: plain {:.2f}, drafting {}): {}".format(
        cost["c"], cost["verify_ratio"][1], cost["host"]["plain"],
        ", ".join(f"{n} → {h:.2f}" for n, h in cost["host"]["chain"].items()),
        describe_table(table, lambda e: f"n_max {e['n_max']} p_min {e['p_min']:g}")))
    entry = {"version": str(engine.version), "quant": quant, "target_gguf": target.name, "draft_gguf": "draft.gguf",
             "weights": chosen_weights, "cost": cost, "by_domain": table, "flags": flags,
             "rules": {"greedy": rule_record("llamacpp", "greedy", inputs.sampling.temperature)}}
    return replace(spec, engines={**spec.engines, "llamacpp": entry}), {"draft.gguf": gguf}


# ---------------------------------------------------------------- vLLM, SGLang and TensorRT-LLM

def weights_read_per_step(model) -> int:
    """Parameters a batch-1 decoding step reads: all but the input embedding, of which it reads one row (a tied
    embedding is read whole, as the head)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    return total - (0 if embedding is head else embedding.numel())


def gpu_cost(exported_draft, target, settings) -> dict:
    """The cost summary the GPU engines are planned with: measured on the GPU that serves them when the user gives
    `calibrate.gpu.c`, else the memory-bound model of batch-1 GPU decoding (a step costs the weights it
    reads; a verify of a few tokens costs one step, Leviathan et al. 2023 §3.4)."""
    measured = settings.c is not None
    c = float(settings.c) if measured else weights_read_per_step(exported_draft) / weights_read_per_step(target)
    return {"engine": "gpu", "c": c, "verify_ratio": {n: float(settings.verify_ratio) for n in settings.gammas},
            "source": "given (calibrate.gpu)" if measured else
            "assumed: memory-bound batch-1 decoding (c = weights read per step, draft / target; verify = 1 step)"}


def rule_alpha(draft, heldouts, vocab, rule: str, filtered: bool = True) -> dict[str, torch.Tensor]:
    """α per position of both held-out parts under an engine's rule (pipeline/engines/rules.py): "greedy" is
    Σ min(p_T, one-hot argmax q) = p_T(argmax q); "tau" is Σ min(p_T, q) with the draft at the serving T."""
    tau = 0.0 if rule == "greedy" else float(heldouts.calibration.sampling.temperature)
    return {part: sim.acceptance(draft, getattr(heldouts, part), [tau], vocab, filtered)[0]
            for part in ("calibration", "reporting")}


def choose_fixed(alphas: dict[str, dict], heldouts, cost: dict, gammas: list[int], margin: float,
                 key: str = "num_speculative_tokens") -> dict[str, dict]:
    """Per domain (and default): the rule (`alphas`: {rule: rule_alpha}) and γ (written under `key`) of a
    fixed-length chain with the best predicted speedup on the calibration part, "off" below 1 + margin."""
    def predict(part, mask, option):
        rule, gamma = option
        drafted, accepted = simulate(alphas[rule][part], None, getattr(heldouts, part), mask, gamma)
        return pass_speedup(accepted, drafted, drafted, cost), accepted / max(drafted, 1e-9)

    return choose_per_domain(heldouts.calibration, heldouts.reporting, [(r, g) for r in alphas for g in gammas],
                             predict, margin, lambda best, _: {"rule": best[0], key: best[1]})


# engine: (its key in speculative.json, the config of k drafts with a rule's settings, the config of "off")
GPU_CONFIGS = {
    "vllm": ("speculative_config", lambda k, rule: {"model": ".", "method": "draft_model", "num_speculative_tokens": k,
                                                    **rule}, None),
    "sglang": ("args", lambda k, rule: ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", ".",
                                        "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                                        "--speculative-num-draft-tokens", str(k + 1),
                                        *(x for kv in rule.items() for x in kv)], []),
    "trtllm": ("speculative_config", lambda k, rule: {"decoding_type": "Draft_Target", "max_draft_len": k,
                                                      "speculative_model": ".", **rule}, None),
}


def gpu_engines(settings) -> list[str]:
    """The GPU engines calibrate.engines names, in GPU_CONFIGS' order."""
    return [name for name in GPU_CONFIGS if name in settings.engines]


def calibrate_gpu_engines(draft, exported_draft, target, heldouts, vocab, settings, log) -> dict[str, dict]:
    """speculative.json `engines.<engine>` for the GPU engines calibrate.engines names (`settings`: the calibrate
    group; its `gpu` says how they are planned): vLLM's speculative_config (method
    draft_model), SGLang's STANDALONE server arguments and TensorRT-LLM's DraftTargetDecodingConfig per domain
    ("off": null or [] = serve that domain without a draft), each with the rule (pipeline/engines/rules.py) and
    fixed k predicted fastest. Each engine routes per domain only by running two servers: the tables say which
    domain goes where. The draft directory is this export ("." in the configs: replace with where it is served)."""
    gpu = settings.gpu
    cost, sampling = gpu_cost(exported_draft, target, gpu), heldouts.calibration.sampling
    alphas, out = {}, {}
    for engine in gpu_engines(settings):
        rules = candidate_rules(engine, sampling.greedy)
        keys = {r: (r, r == "greedy" or engine not in UNFILTERED_DRAFT) for r in rules}  # a one-hot q has no filters
        for rule, key in keys.items():
            if key not in alphas:  # each α once for every engine
                alphas[key] = rule_alpha(draft, heldouts, vocab, *key)
        table = choose_fixed({r: alphas[key] for r, key in keys.items()}, heldouts, cost, list(gpu.gammas),
                             gpu.margin)
        key, config, off = GPU_CONFIGS[engine]
        out[engine] = {"version": VERSIONS[engine], "cost": cost, "by_domain": table,
                       "rules": {r: rule_record(engine, r, sampling.temperature) for r in rules},
                       key: {d: config(e["num_speculative_tokens"], rules[e["rule"]]) if e["speculate"] else off
                             for d, e in table.items()}}
        described = describe_table(table, lambda e: f"{e['rule']} k {e['num_speculative_tokens']}")
        log(f"{engine} calibration (c = {cost['c']:.3f}, {cost['source'].split(':')[0]}): {described}")
    return out


# ---------------------------------------------------------------- HF assisted generation

def calibrate_hf(inputs, exported_draft, heldouts, settings, log) -> dict:
    """speculative.json `engines.hf`: per domain the num_assistant_tokens (constant schedule, no confidence stop)
    HF assisted generation is predicted fastest with, or "off", priced by HF's own passes timed here
    (pipeline/engines/hf.py pass_costs: its per-pass host work included). HF's draft samples with the target's
    generation config and HF verifies by rejection sampling (greedy: argmax match): the "tau" rule at τ = T."""
    import transformers

    rows = heldouts.calibration.rows[:settings.prompts]
    device = next(inputs.target.parameters()).device
    prompts = [torch.tensor([row["prompt_ids"]], device=device) for row in rows]
    cost = hf.pass_costs(inputs.target, exported_draft, prompts, list(settings.gammas), inputs.sampling, inputs.stops,
                         int(settings.max_new_tokens))
    rules = candidate_rules("hf", inputs.sampling.greedy)
    table = choose_fixed({r: rule_alpha(exported_draft, heldouts, None, r) for r in rules}, heldouts, cost,
                         list(settings.gammas), settings.margin, key="num_assistant_tokens")
    log("HF assisted calibration (a pass of γ = {}: {} plain steps): {}".format(
        ", ".join(map(str, settings.gammas)), ", ".join(f"{r:.2f}" for r in cost["verify_ratio"].values()),
        describe_table(table, lambda e: f"γ {e['num_assistant_tokens']}")))
    configs = {d: {"num_assistant_tokens": e["num_assistant_tokens"], "num_assistant_tokens_schedule": "constant",
                   "assistant_confidence_threshold": 0.0} if e["speculate"] else None for d, e in table.items()}
    return {"version": f"transformers {transformers.__version__}", "cost": cost, "by_domain": table,
            "rules": {r: rule_record("hf", r, inputs.sampling.temperature) for r in rules}, "generation_config": configs}
