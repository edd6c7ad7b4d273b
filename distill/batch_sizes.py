"""Where speculation stops paying: the draft length per batch size, per domain (speculative.json `batching`;
docs/architecture.md says how it is measured and priced).

Per domain and measured batch size B, the γ predicted fastest under that B's cost (pipeline/measure/batch_profile.py) is kept
when it beats plain decoding by `calibrate.speculate_margin`, else 0 ("off"). A batch size between two
measured ones takes the larger one's setting: costs grow with B, so this never drafts where a measured neighbour would
not. Where the export has engines.vllm or engines.trtllm, each drafting domain's speculative_config gains that
engine's draft length per batch size.
"""
from __future__ import annotations

import copy
from dataclasses import replace

from distill.simulator import best_gamma
from pipeline.measure.batch_profile import (BatchPlan, batch_cost, batch_sizes_of, break_even, forwards_only,
                                     measure_batch_profile)
from pipeline.decoding.cost import pass_speedup
from pipeline.errors import PipelineError
from pipeline.decoding.spec import DEFAULT, SpeculativeSpec
from pipeline.timing import synced_clock

OVERALL = "overall"  # distill's name for the pooled domain (distill/simulator.py); speculative.json says "default"


def choose(per_position_by_domain: dict, profile: dict, gammas, margin: float) -> dict:
    """speculative.json `batching` (module docstring) from per-domain acceptance and a batch cost profile."""
    sizes = batch_sizes_of(profile)
    costs = {size: batch_cost(profile, size) for size in sizes}
    block = {"batch_sizes": sizes, "margin": margin, "by_domain": {}, "gamma_if_on": {}, "predicted_speedup": {},
             "predicted_speedup_no_host": {}, "break_even": {}}
    for domain, per_position in per_position_by_domain.items():
        name = DEFAULT if domain == OVERALL else domain
        best = {str(size): best_gamma(per_position, costs[size], gammas) for size in sizes}
        chosen = {size: (gamma, speedups[gamma]) for size, (gamma, speedups) in best.items()}
        block["gamma_if_on"][name] = {size: gamma for size, (gamma, _) in chosen.items()}
        block["predicted_speedup"][name] = {size: round(speedup, 3) for size, (_, speedup) in chosen.items()}
        # what the forwards-only model said of the same γ: how much of the prediction the host work took back
        block["predicted_speedup_no_host"][name] = {
            size: round(pass_speedup(sum(per_position[:g]), g, g, forwards_only(costs[int(size)])), 3)
            for size, (g, _) in chosen.items()}
        block["by_domain"][name] = {size: gamma if speedup >= 1 + margin else 0
                                    for size, (gamma, speedup) in chosen.items()}
        block["break_even"][name] = break_even({int(s): x for s, x in block["predicted_speedup"][name].items()})
    block["cost"] = {"machine": profile["machine"], "context": profile["context"],
                     "host_settings": profile.get("host_settings"),
                     "by_batch": {str(size): cost_record(cost, max(gammas)) for size, cost in costs.items()}}
    return block


def cost_record(cost: dict, longest: int) -> dict:
    """A batch size's cost summary as speculative.json keeps it (the verify ratios of the γ compared, the host
    work per pass where the profile timed it)."""
    record = {"c": round(cost["c"], 4), "target_step_ms": round(cost["target_step_ms"], 3),
              "verify_ratio": {str(n): round(r, 4) for n, r in cost["verify_ratio"].items() if n <= longest}}
    return record if "host" not in cost else {**record, "host": cost["host"]}


def vllm_schedule(gammas_by_batch: dict, k_max: int) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: inclusive [start, end, K] ranges from 1, K ≤ k_max (vLLM
    clamps to its num_speculative_tokens anyway). A range ends at a measured B and takes its setting (the module
    docstring's rule); vLLM carries the last K beyond the last range (vllm/v1/spec_decode/dynamic/utils.py)."""
    schedule, start = [], 1
    for size in sorted(int(b) for b in gammas_by_batch):
        k = min(int(gammas_by_batch[str(size)]), k_max)
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = size
        else:
            schedule.append([start, size, k])
        start = size + 1
    return schedule


def trtllm_schedule(gammas_by_batch: dict, k: int) -> dict[str, int] | None:
    """TensorRT-LLM's draft_len_schedule: {largest batch size of a range: draft length ≤ k}, no drafts above its
    largest key (llmapi/llm_args.py DecodingBaseConfig; the module docstring's rule up to there). Its smallest key
    must map to max_draft_len (k): a domain whose smallest calibrated batch size drafts less gets none (None)."""
    schedule = {str(b): min(int(g), k) for b, g in sorted(gammas_by_batch.items(), key=lambda item: int(item[0]))}
    return schedule if next(iter(schedule.values())) == k else None


# engine: (the speculative_config key of its per-batch-size draft length, that value from {B: γ} and the domain's k)
SCHEDULES = {"vllm": ("num_speculative_tokens_per_batch_size", lambda table, config: vllm_schedule(
                 table, config["num_speculative_tokens"])),
             "trtllm": ("draft_len_schedule", lambda table, config: trtllm_schedule(table, config["max_draft_len"]))}


def with_engine_schedules(engines: dict, block: dict) -> dict:
    """engines with each vLLM and TensorRT-LLM speculative_config (a domain that drafts there) given its draft
    length per batch size (vLLM takes its key for every method: vllm/config/speculative.py)."""
    out = dict(engines)
    for name, (key, schedule) in SCHEDULES.items():
        if not engines.get(name):
            continue
        configs = {}
        for domain, config in engines[name]["speculative_config"].items():
            table = block["by_domain"].get(domain, block["by_domain"].get(DEFAULT))
            value = None if config is None or table is None else schedule(table, config)
            configs[domain] = config if value is None else {**config, key: value}
        out[name] = {**engines[name], "speculative_config": configs}
    return out


def with_batching(spec: SpeculativeSpec, profile: dict, gammas, margin: float) -> SpeculativeSpec:
    """The spec with its `batching` block and the vLLM schedule it implies."""
    if not spec.per_position_acceptance:
        raise PipelineError("speculative.json has no per_position_acceptance: re-export the draft with stage=calibrate")
    block = choose(spec.per_position_acceptance, profile, gammas, margin)
    return replace(spec, batching=block, engines=with_engine_schedules(spec.engines, block))


def calibrate_batching(inputs, split, spec: SpeculativeSpec, log) -> SpeculativeSpec:
    """The distill stage's optional step: the batch profile of the target and the draft as served, then
    with_batching; the spec unchanged when calibrate.batch_sizes is empty."""
    settings = inputs.settings.calibration
    if not settings.batch_sizes:
        return spec
    draft = copy.deepcopy(inputs.draft).to(inputs.target.dtype)  # as exported: in the serving dtype
    device = next(inputs.target.parameters()).device
    plan = BatchPlan(tuple(settings.batch_sizes), tuple(g + 1 for g in settings.gammas),
                     repeats=int(settings.cost.repeats), sampling=spec.sampling)
    profile = measure_batch_profile(inputs.target, draft.to(device), plan, synced_clock(device), split.vocab)
    spec = with_batching(spec, profile, settings.gammas, float(settings.speculate_margin))
    log(format_batching(spec.batching))
    return spec


def format_batching(block: dict) -> str:
    sizes = block["batch_sizes"]
    lines = ["draft length per batch size (0 = plain decoding; predicted speedup of the best γ):",
             f"{'domain':<14}" + "".join(f"{'B=' + str(s):>14}" for s in sizes) + f"{'break-even':>12}"]
    for domain, table in block["by_domain"].items():
        speedups = block["predicted_speedup"][domain]
        cells = "".join(f"{f'{table[str(s)]} ({speedups[str(s)]:.2f}×)':>14}" for s in sizes)
        lines.append(f"{domain:<14}{cells}{str(block['break_even'][domain]):>12}")
    return "\n".join(lines)
