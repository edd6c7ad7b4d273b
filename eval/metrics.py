"""Aggregating timed generations into eval's metrics (vLLM / Spec-Bench conventions; docs/architecture.md, "Eval
output", defines every metric and the metrics.json schema).

A *record* is one timed request: {"method", "domain", "prompt_id", "turn", "tokens": [ids], "time_s": wall seconds
incl. prefill, "stats": DecodeStats of pipeline.decoding, or None for HF baselines}. Counters are pooled over a
group's requests, as vLLM pools them; intervals are paired bootstraps over requests.
"""
from __future__ import annotations

import statistics

import numpy as np

from eval.intervals import acceptance_ci, compare, paired_ratio, per_request, speedup_ci
from pipeline.measure import speculation_profile as profile

AUTOREGRESSIVE = "autoregressive"
SPECULATIVE = "speculative"


def throughput(records: list[dict]) -> dict:
    """tokens/s and per-request latency percentiles of one method's records."""
    times = [r["time_s"] for r in records]
    n_tokens = sum(len(r["tokens"]) for r in records)
    total = sum(times)
    return {"n_requests": len(records), "n_tokens": n_tokens, "time_s": total,
            "tokens_per_s": n_tokens / total if total > 0 else 0.0,
            "latency_p50_s": float(np.percentile(times, 50)) if times else 0.0,
            "latency_p95_s": float(np.percentile(times, 95)) if times else 0.0}


def per_position_acceptance(stats_list) -> list[float]:
    """P(draft token k accepted) for k = 1..γ, pooled over requests; for a token tree k is a depth, unconditioned
    on reaching k − 1 (the chain's convention; per_depth_acceptance conditions)."""
    accepted, proposed = profile.position_table(stats_list)
    return [float(a / p) for a, p in zip(accepted.sum(0), proposed.sum(0)) if p]


def measured_profile(records: list[dict], conditions: dict) -> dict | None:
    """metrics.json `measured`: the tuned draft's per-position acceptance in speculation_profile.json's shape, per
    domain and overall, with intervals over requests; None when it did not run."""
    stats = {}
    for r in records:
        if r["method"] == SPECULATIVE and r["stats"] is not None:
            stats.setdefault(r["domain"], []).append(r["stats"])
    if not stats:
        return None
    sections = {d: profile.section(*profile.position_table(s)) for d, s in stats.items()}
    sections["overall"] = profile.section(*profile.position_table([s for group in stats.values() for s in group]))
    return profile.build(sections, "overall", {"source": profile.MEASURED, "units": "requests", **conditions},
                         target=None, draft=None)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def speculative_counters(records: list[dict], ar_step_s: float) -> dict:
    """Acceptance, mean accepted length, per-position acceptance and c over speculative records."""
    stats = [r["stats"] for r in records]
    drafted = sum(sum(s.drafted) for s in stats)
    accepted = sum(sum(s.accepted) for s in stats)
    passes = sum(s.target_passes for s in stats)
    generated = sum(s.n_generated for s in stats)
    draft_s = _mean([t for s in stats for t in s.draft_times])
    verify_s = _mean([t for s in stats for t in s.target_times])
    return {"acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": generated / passes if passes else 0.0,
            "per_position_acceptance": per_position_acceptance(stats),
            **({"per_depth_acceptance": per_depth_acceptance(trees)}
               if (trees := [s for s in stats if hasattr(s, "depths")]) else {}),
            "n_drafted": drafted, "n_accepted": accepted, "target_passes": passes,
            "drafted_per_pass": drafted / passes if passes else 0.0, "wasted_drafts": drafted - accepted,
            # a verify pass feeds its drafted nodes and one committed token: output per token the target verified
            "tokens_per_verified_node": generated / (drafted + passes) if passes else 0.0,
            # None where the method timed no forwards (HF assisted generation: counted by hooks, not timed)
            "c": draft_s / ar_step_s if ar_step_s > 0 and draft_s > 0 else None,
            "c_verify": draft_s / verify_s if verify_s > 0 and draft_s > 0 else None,
            "draft_forward_ms": 1000 * draft_s, "verify_forward_ms": 1000 * verify_s, **guard_decisions(stats)}


def guard_decisions(stats_list) -> dict:
    """{"guard_decisions": the online guard's decisions summed over the requests, with the mean cost factor κ}, or
    {} where no request ran under a guard."""
    counts = [s.guard for s in stats_list if getattr(s, "guard", None) is not None]
    if not counts:
        return {}
    total = counts[0]
    for more in counts[1:]:
        total = total.add(more)
    # plans also carry a "guard" (its settings and prior): the decisions sit beside it under their own key
    return {"guard_decisions": total.to_dict() | {"cost_factor": statistics.fmean(c.cost_factor for c in counts)}}


def per_depth_acceptance(stats_list) -> list[float]:
    """Token trees: [d] = P(the accepted path reaches depth d+1 | it reached depth d and the tree goes deeper),
    pooled over every verify pass of every request (the tree's own conditional acceptance per depth)."""
    rates = []
    for d in range(max((depth for s in stats_list for depth in s.depths), default=0)):
        reached = [a for s in stats_list for a, depth in zip(s.accepted, s.depths) if a >= d and depth > d]
        rates.append(sum(a > d for a in reached) / len(reached) if reached else 0.0)
    return rates


def greedy_match(records: list[dict], reference: list[dict]) -> float:
    """Share of prompts whose output equals the reference's on every turn (exact token ids)."""
    ref = {(r["prompt_id"], r["turn"]): r["tokens"] for r in reference}
    same: dict[str, bool] = {}
    for r in records:
        key = (r["prompt_id"], r["turn"])
        if key in ref:
            same[r["prompt_id"]] = same.get(r["prompt_id"], True) and r["tokens"] == ref[key]
    return sum(same.values()) / len(same) if same else 0.0


def _streamed(records: list[dict]) -> dict[tuple, tuple[float, float, int]]:
    """(domain, prompt, turn) → (TTFT, last − first commit, tokens after the first) of the records whose stats
    carry commit times (own methods; HF baselines report none)."""
    out = {}
    for r in records:
        stats = r["stats"]
        if getattr(stats, "chunk_times", None):
            out[(r["domain"], r["prompt_id"], r["turn"])] = (stats.chunk_times[0],
                                                             stats.chunk_times[-1] - stats.chunk_times[0],
                                                             sum(stats.chunk_tokens) - 1)
    return out


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def streaming_latency(records: list[dict]) -> dict:
    """TTFT and inter-token latency of one method's records; {} when none carries commit times."""
    rows = _streamed(records)
    if not rows:
        return {}
    ttft = [row[0] for row in rows.values()]
    gaps = [g for r in records if getattr(r["stats"], "chunk_times", None) for g in r["stats"].token_gaps()]
    later = sum(row[2] for row in rows.values())
    return {"ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": _percentile(ttft, 50),
            "ttft_p95_s": _percentile(ttft, 95),
            "itl_mean_s": sum(row[1] for row in rows.values()) / later if later else None,
            "itl_p50_s": _percentile(gaps, 50), "itl_p95_s": _percentile(gaps, 95)}


def latency_ratios(records: list[dict], ar: list[dict]) -> dict:
    """The method's TTFT over autoregressive's (1 = the same prefill) and autoregressive's mean inter-token
    latency over the method's (the speedup of the stream after its first token), on the requests both ran,
    with paired CIs; {} without commit times."""
    mine, theirs = _streamed(records), _streamed(ar)
    keys = [k for k in mine if k in theirs]
    if not keys:
        return {}
    ttft_m, span_m, later_m, ttft_a, span_a, later_a = (np.array([rows[k][i] for k in keys], dtype=float)
                                                        for rows in (mine, theirs) for i in range(3))
    ones = np.ones(len(keys))
    # TTFT: (Σ ttft_m / n) / (Σ ttft_a / n) through the ratio's form; ITL: tokens/s after the first, method over AR
    (ttft, ttft_ci), (itl, itl_ci) = (paired_ratio((ttft_m, ones, ttft_a, ones)),
                                      paired_ratio((later_m, span_m, later_a, span_a)))
    return {"ttft_ratio": ttft, "ttft_ratio_ci95": ttft_ci, "itl_speedup": itl, "itl_speedup_ci95": itl_ci}


def _method_metrics(recs: list[dict], ar: list[dict], ar_tps: float, ar_step_s: float, greedy: bool) -> dict:
    """One non-AR method's entry: throughput, decode counters when it has them, speedup and their CIs."""
    m = throughput(recs)
    if recs[0]["stats"] is not None:
        m.update(speculative_counters(recs, ar_step_s))
        m["acceptance_rate_ci95"] = acceptance_ci(recs)
    m["speedup"] = m["tokens_per_s"] / ar_tps if ar_tps else 0.0
    m["speedup_ci95"] = speedup_ci(recs, ar)
    m.update(streaming_latency(recs) | latency_ratios(recs, ar))
    if greedy:
        m["greedy_match"] = greedy_match(recs, ar)
    plain = sum(bool(r.get("reused")) for r in recs)  # copies of the plain run (eval/harness.py decodes_plainly)
    if plain == len(recs):
        m["off"] = True  # calibrated off: decoded plainly on every request, its figures are the plain run's
    elif plain:
        m["n_plain_requests"] = plain
    return m


def _withhold_intervals(entry: dict) -> None:
    """Nulls every interval of a group too small to support one (its point estimates stay)."""
    for key, value in entry.items():
        if key.endswith("ci95") or key == "within_noise":
            entry[key] = None
        elif isinstance(value, dict):
            _withhold_intervals(value)


def summarize(records: list[dict], greedy: bool, min_ci_requests: int = 2) -> dict:
    """Metrics of one group of requests (a domain, or all of them): one entry per method, plus the tuned draft's
    headline `speedup` / `greedy_match`; below `min_ci_requests` requests every interval is null (`ci_withheld`)."""
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    ar = by_method[AUTOREGRESSIVE]
    ar_step_s = _mean([t for r in ar for t in r["stats"].target_times])
    out: dict = {"n_prompts": len({r["prompt_id"] for r in ar}), "n_requests": len(ar)}
    ar_tps = throughput(ar)["tokens_per_s"]
    for method, recs in by_method.items():
        out[method] = (throughput(recs) | streaming_latency(recs) if method == AUTOREGRESSIVE
                       else _method_metrics(recs, ar, ar_tps, ar_step_s, greedy))
    spec = out.get(SPECULATIVE, {})
    out["speedup"] = spec.get("speedup", 0.0)
    out["speedup_ci95"] = spec.get("speedup_ci95")
    if greedy:
        out["greedy_match"] = spec.get("greedy_match", 0.0)
    if SPECULATIVE in by_method:
        out["comparisons"] = {f"{SPECULATIVE}_vs_{m}": compare(by_method[SPECULATIVE], recs)
                              for m, recs in by_method.items() if m not in (AUTOREGRESSIVE, SPECULATIVE)}
    if 2 <= len(ar) < min_ci_requests:  # below 2 the bootstrap gives none anyway
        _withhold_intervals(out)
        out["ci_withheld"] = f"n={len(ar)} < {min_ci_requests}"
    return out


def sweep_point(spec: list[dict], ar: list[dict]) -> dict:
    """One γ of the sweep: the speculative records at that γ against AR records of the same requests."""
    ar_step_s = _mean([t for r in ar for t in r["stats"].target_times])
    point = {k: v for k, v in speculative_counters(spec, ar_step_s).items()
             if k in ("acceptance_rate", "mean_accepted_length", "c")}
    point["tokens_per_s"] = throughput(spec)["tokens_per_s"]
    (tok_s, tok_a), (sec_s, sec_a) = ([[len(r["tokens"]) for r in recs] for recs in (spec, ar)],
                                      [[r["time_s"] for r in recs] for recs in (spec, ar)])
    # spec[i] and ar[i] are the same request: pair by position.
    point["speedup"], point["speedup_ci95"] = paired_ratio((tok_s, sec_s, tok_a, sec_a))
    return point


def flat_metrics(metrics: dict) -> dict[str, float]:
    """Scalar metrics as MLflow keys `<domain>.<method>.<name>` (lists and strings left out)."""
    out: dict[str, float] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{prefix}{k}"] = float(v)

    walk({"domains": metrics["domains"], "overall": metrics["overall"]}, "")
    return {k.removeprefix("domains."): v for k, v in out.items()}


# Plain decoding and HF generate run the same computation, so per request their tokens/s agree within a few percent
# on a quiet machine; a request where they part by more than the band (eval.control_band, fixed before a run) was
# disturbed by other load.
CONTROL = "hf_generate"


def disturbed_requests(records: list[dict], band: tuple[float, float]) -> list[tuple]:
    """(domain, prompt_id, turn) of the requests whose control pair (plain decoding, HF generate) disagree beyond
    `band` in tokens/s; [] when HF generate did not run."""
    ar = per_request([r for r in records if r["method"] == AUTOREGRESSIVE])
    control = per_request([r for r in records if r["method"] == CONTROL])
    low, high = band

    def ratio(key) -> float:
        (c_tokens, c_s, *_), (a_tokens, a_s, *_) = control[key], ar[key]
        return (c_tokens / c_s) / (a_tokens / a_s) if c_s > 0 and a_s > 0 and a_tokens > 0 else 1.0
    return [key for key in ar if key in control and not low <= ratio(key) <= high]


def without_disturbed(records: list[dict], stalls: dict | None) -> list[dict]:
    """The records of every request but those the stall rule left disturbed; all of them when every request was
    (nothing else to measure on: the report then says to read no timing)."""
    drop = {tuple(key) for key in (stalls or {}).get("disturbed", [])}
    kept = [r for r in records if (r["domain"], r["prompt_id"], r["turn"]) not in drop]
    return kept if any(r["method"] == AUTOREGRESSIVE for r in kept) else records


def _speedups(summary: dict) -> dict:
    return {m: {"speedup": v["speedup"], "speedup_ci95": v["speedup_ci95"]}
            for m, v in summary.items() if isinstance(v, dict) and "speedup_ci95" in v}


def control_check(records: list[dict], greedy: bool, band: tuple[float, float]) -> dict | None:
    """metrics.json's `control`: the band (fixed before the run), the disturbed requests, each method's overall
    speedup over every request (`unfiltered`, the headline) and, without the disturbed ones, each method's overall
    speedup and the comparisons (`without_disturbed`, the filtered figure; None when HF generate did not run)."""
    if not any(r["method"] == CONTROL for r in records):
        return None
    disturbed = disturbed_requests(records, band)
    out = {"method": CONTROL, "band": [float(band[0]), float(band[1])], "n_requests": len(per_request(
        [r for r in records if r["method"] == AUTOREGRESSIVE])), "disturbed": [list(k) for k in disturbed]}
    if disturbed and len(disturbed) < out["n_requests"]:  # every request disturbed: nothing to recompute on
        drop = set(disturbed)
        clean = summarize([r for r in records if (r["domain"], r["prompt_id"], r["turn"]) not in drop], greedy)
        out["unfiltered"] = {"speedup": _speedups(summarize(records, greedy))}
        out["without_disturbed"] = {"speedup": _speedups(clean), "comparisons": clean.get("comparisons", {})}
    return out


def build(records: list[dict], plans: dict[str, dict[str, dict]], temperature: float, *, band: tuple[float, float],
          min_ci_requests: int, stalls: dict | None = None) -> dict:
    """metrics.json's core; plans[draft][domain] is the DraftPlan that draft ran with ("default" for `overall`).
    Requests `stalls` (eval/harness.py retime_stalls) left disturbed are kept out of every figure
    (`stalls.unfiltered`: the overall speedups with them). Per domain, intervals need `min_ci_requests` requests."""
    greedy = temperature == 0
    every, records = records, without_disturbed(records, stalls)
    domains = {d: summarize([r for r in records if r["domain"] == d], greedy, min_ci_requests)
               for d in dict.fromkeys(r["domain"] for r in records)}
    overall = summarize(records, greedy)
    def as_json(plan) -> dict:  # a DraftPlan, or (tests) a dict of its fields
        if hasattr(plan, "to_dict"):
            return plan.to_dict()
        return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in plan.items()}

    for name, plan in plans.items():
        for d, dm in domains.items():
            dm[name].update(as_json(plan[d]))
        overall[name].update(as_json(plan["default"]))
    # The schema keeps the tuned draft's headline numbers at the top of `overall`.
    overall.update({k: overall[SPECULATIVE][k]
                    for k in ("acceptance_rate", "acceptance_rate_ci95", "mean_accepted_length")})
    metrics = {"gamma": as_json(plans[SPECULATIVE]["default"])["gamma"], "temperature": temperature,
               "methods": list(dict.fromkeys(r["method"] for r in records)), "domains": domains, "overall": overall}
    if stalls is not None:
        excluded = len(every) > len(records)
        metrics["stalls"] = stalls | {"n_excluded": len(stalls["disturbed"]) if excluded else 0}
        if excluded:
            metrics["stalls"]["unfiltered"] = {"speedup": _speedups(summarize(every, greedy))}
    if min_ci_requests > 2:
        metrics["min_requests_for_ci"] = min_ci_requests
    control = control_check(records, greedy, band)
    if control is not None:
        metrics["control"] = control
    if greedy:  # every prompt was decoded greedily by both: the lossless check comes for free
        metrics["fidelity"] = {"n_prompts": None, "temperature": 0.0, "share": overall["greedy_match"],
                               "by_domain": {d: dm["greedy_match"] for d, dm in domains.items()}}
    return metrics
