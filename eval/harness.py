"""The one timing harness of every timed comparison: every request decoded by every method back to back, in
rotating order, after a warm-up (`time_round`, `time_requests`). Eval's benchmark adds its own rules on top: a
method that decodes plainly on a domain (calibrated "off") reuses the plain run (its record, one of
eval/metrics.py's, gets "reused": "autoregressive"), and a request whose timing stalled is re-timed (eval.stall).
The sweeps (eval/sweeps.py), the engines (eval/engine_llamacpp.py, eval/engine_vllm.py) and gpu-check time through
`time_requests`; tests/test_architecture.py fails on a timing loop anywhere else.
"""
from __future__ import annotations

import statistics
import time

from eval.drafts import Evaluation
from pipeline.modelio.chat import encode_chat, messages_for
from pipeline.control.deadline import would_overrun
from pipeline.sampling import derive_seed
from pipeline.timing import synced_clock

PLAIN = "autoregressive"


def timed(fn, ids, domain, n, seed, clock) -> tuple[list[int], object, float]:
    """(tokens, stats, seconds) of one decode; clock None: fn times itself (an engine's own timings, a server's)."""
    if clock is None:
        return fn(ids, domain, n, seed)
    start = clock()
    tokens, stats = fn(ids, domain, n, seed)
    return tokens, stats, clock() - start


def rotated(names: list, k: int) -> list:
    """Who runs first changes with every request, so drift and cache warmth favour no method."""
    return names[k % len(names):] + names[:k % len(names)]


def interleaved(prompts: dict[str, list[dict]], weights: dict[str, int] | None = None) -> list[dict]:
    """Every domain's first prompt, then every second one, ...: a time budget then cuts every domain alike, or, with
    `weights`, in proportion after the first round: a domain of weight 2 has its 2k-th prompt beside the k-th of weight 1."""
    weights = weights or {}
    ranked = [(i / weights.get(domain, 1), -weights.get(domain, 1), order, i, prompt) for order, (domain, domain_prompts)
              in enumerate(prompts.items()) for i, prompt in enumerate(domain_prompts)]
    return [prompt for *_, prompt in sorted(ranked, key=lambda r: r[:4])]


def decodes_plainly(evaluation: Evaluation, method: str, domain: str) -> bool:
    """Whether `method` runs plain decoding on `domain` (its plan calibrated "off", nothing forcing a drafting):
    speculative_generate(plan=PLAIN) is autoregressive_stream itself, so its tokens and cost are the plain
    run's, and timing it again would only measure noise as a speedup."""
    plan = (evaluation.plans or {}).get(method, {}).get(domain)
    return plan is not None and not plan.speculates


def time_round(request: dict, methods: dict, names: list, n: int, clock) -> dict[str, dict]:
    """{name: record} of one request decoded by each of `names`, in that order, all with the request's seed."""
    records = {}
    for name in names:
        tokens, stats, seconds = timed(methods[name], request["ids"], request["domain"], n, request["seed"], clock)
        records[name] = {"method": name, "domain": request["domain"], "prompt_id": request.get("prompt_id"),
                         "turn": request.get("turn", 0), "tokens": tokens, "time_s": seconds, "stats": stats}
    return records


def time_requests(requests: list[dict], methods: dict, n: int, clock, label: str, warmup_tokens: int | None = None,
                  max_minutes: float | None = None) -> list[dict]:
    """Records of every request {ids, domain, seed, prompt_id?, turn?} decoded by every method fn(ids, domain, n,
    seed) -> (tokens, stats) (clock None: -> (tokens, stats, seconds), the method's own timing), who runs first
    rotating with each request; `warmup_tokens`: an untimed decode of the first request by each method first;
    `max_minutes`: no request starts that would end past it (the first round, one request a domain, always runs)."""
    from tqdm.auto import tqdm

    first, names = requests[0], list(methods)
    for name in names if warmup_tokens else ():  # allocator, lazy imports and kernel choice stay out of the timing
        methods[name](first["ids"], first["domain"], warmup_tokens, first["seed"])
    records, started, domains = [], time.time(), len({r["domain"] for r in requests})
    for k, request in enumerate(tqdm(requests, desc=label, unit="req", dynamic_ncols=True)):
        if would_overrun(started, k, max_minutes, first_round=domains):
            print(f"[{label}] the next request would pass {max_minutes} minutes: stopping after {k} of {len(requests)}")
            break
        fresh = time_round(request, methods, rotated(names, k), n, clock)
        records += [fresh[name] for name in names]
    return records


def by_method(records: list[dict]) -> dict[str, list[dict]]:
    """{method: its records in request order}."""
    out: dict[str, list[dict]] = {}
    for record in records:
        out.setdefault(record["method"], []).append(record)
    return out


# ---------------------------------------------------------------- the benchmark

def benchmark(prompts: dict, methods: dict, evaluation: Evaluation, seed: int) -> tuple[list[dict], list[dict]]:
    """Decodes every request with every method while the next one fits in eval.max_minutes (at the mean time per
    prompt so far; the first round, one prompt per domain, always runs), then re-times the requests that stalled
    (eval.stall); returns (records, contexts) — contexts are the encoded requests, reused by the γ sweep and the
    fidelity check so every run sees the same inputs."""
    from tqdm.auto import tqdm

    settings = evaluation.settings
    clock = synced_clock(evaluation.device)
    first = next(iter(prompts.values()))[0]
    warmup_ids = encode_chat(evaluation.tokenizer, messages_for(first, [], 0)).to(evaluation.device)
    for name in methods:  # warm-up: allocator, lazy imports and kernel selection stay out of the timed runs
        methods[name](warmup_ids, first["domain"], settings.warmup_tokens, seed)

    records, contexts, started = [], [], time.time()
    # a domain calibrated off decodes plainly (decodes_plainly): its speedup is plain against plain, so the drafting
    # domains get twice its requests under a budget (min_requests_for_ci in theirs by half that in the others)
    queue = interleaved(prompts, {d: 1 if decodes_plainly(evaluation, "speculative", d) else 2 for d in prompts})
    bar = tqdm(total=sum(len(p["turns"]) for p in queue), desc="eval", unit="req", dynamic_ncols=True)
    for done, prompt in enumerate(queue):
        if would_overrun(started, done, settings.max_minutes, first_round=len(prompts)):
            evaluation.budget = {"max_minutes": settings.max_minutes, "prompts_done": done,
                                 "prompts_planned": len(queue)}
            print(f"[eval] the next prompt would pass eval.max_minutes={settings.max_minutes}: stopping after {done} of "
                  f"{len(queue)} prompts (every domain cut alike); raise it for narrower intervals")
            break
        decode_prompt(prompt, methods, evaluation, seed, clock, records, contexts)
        bar.set_postfix_str(prompt["domain"])
        bar.update(len(prompt["turns"]))
    bar.close()
    evaluation.stalls = retime_stalls(records, contexts, methods, evaluation, clock)
    return records, contexts


def decode_prompt(prompt: dict, methods: dict, evaluation: Evaluation, seed: int, clock, records: list,
                  contexts: list) -> None:
    """Every turn of one prompt with every method, in rotating order; later turns continue from the target's
    own answer, identical for every method."""
    tokenizer, device = evaluation.tokenizer, evaluation.device
    answers: list[str] = []
    for turn in range(len(prompt["turns"])):
        ids = encode_chat(tokenizer, messages_for(prompt, answers, turn)).to(device)
        # the domain's own request count turns the rotation: with D domains interleaved, a global count would give
        # a domain the same order every time whenever D is a multiple of the number of methods
        k = sum(c["domain"] == prompt["domain"] for c in contexts)
        context = {"domain": prompt["domain"], "prompt_id": prompt["id"], "turn": turn, "ids": ids,
                   "seed": derive_seed(seed, "eval", len(contexts)), "rotation": k}
        contexts.append(context)
        fresh = time_request(context, methods, evaluation, clock)
        records.extend(fresh)
        own_answer = next(r["tokens"] for r in fresh if r["method"] == PLAIN)
        answers.append(tokenizer.decode(own_answer, skip_special_tokens=True).strip())


def time_request(context: dict, methods: dict, evaluation: Evaluation, clock) -> list[dict]:
    """One request with every method (the same seed for all), the timed ones in rotating order, the plain ones
    (decodes_plainly) as copies of the autoregressive record."""
    domain, n = context["domain"], evaluation.settings.max_new_tokens
    plain = [name for name in methods if name != PLAIN and decodes_plainly(evaluation, name, domain)]
    records = time_round(context, methods, rotated([m for m in methods if m not in plain], context["rotation"]), n,
                         clock)
    for name in plain:
        records[name] = records[PLAIN] | {"method": name, "reused": PLAIN}
    return [records[name] for name in methods]


# ---------------------------------------------------------------- stalls

def seconds_per_token(record: dict) -> float:
    return record["time_s"] / max(1, len(record["tokens"]))


def method_medians(records: list[dict]) -> dict[str, float]:
    """Each method's median seconds per token over its timed records (copies of the plain run left out)."""
    by_method: dict[str, list[float]] = {}
    for r in records:
        if not r.get("reused"):
            by_method.setdefault(r["method"], []).append(seconds_per_token(r))
    return {method: statistics.median(values) for method, values in by_method.items()}


def stalled(request: list[dict], medians: dict[str, float], factor: float) -> list[str]:
    """The methods of one request whose seconds per token exceed `factor` × their median."""
    return [r["method"] for r in request
            if not r.get("reused") and seconds_per_token(r) > factor * medians.get(r["method"], float("inf"))]


def reproduced(before: list[dict], after: list[dict], agree: float) -> bool:
    """Whether a re-time gave every timed method the same seconds per token within `agree` (either way): a slow
    request that is slow again is slow by its content (short outputs, low acceptance), not by a stall."""
    old = {r["method"]: seconds_per_token(r) for r in before if not r.get("reused")}
    return all(1 / agree <= seconds_per_token(r) / old[r["method"]] <= agree
               for r in after if not r.get("reused") and old.get(r["method"]))


def retime_stalls(records: list[dict], contexts: list[dict], methods: dict, evaluation: Evaluation, clock) -> dict:
    """The stall rule (eval.stall): a request where a method took more than `factor` × its median seconds per token is
    re-timed (every method, same seed) up to `retimes` times; a clean re-time, or one reproducing the first within
    `agree` (slow by content), replaces it; one still stalled is `disturbed` and kept out of the headline. Returns
    metrics.json's `stalls` (None when the rule is off)."""
    rule = evaluation.settings.stall
    if not rule["factor"]:
        return None
    medians = method_medians(records)  # fixed from the first timing: re-times are judged by the same yardstick
    by_key: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        by_key.setdefault((r["domain"], r["prompt_id"], r["turn"]), []).append(i)
    out = {"rule": dict(rule), "n_requests": len(by_key), "suspects": [], "retimed": [], "disturbed": []}
    for context in contexts:
        key = (context["domain"], context["prompt_id"], context["turn"])
        first = [records[i] for i in by_key.get(key, [])]
        slow = stalled(first, medians, rule["factor"])
        if not slow:
            continue
        out["suspects"].append([*key, slow])
        settled = _retime(context, first, medians, methods, evaluation, clock)
        if settled is None:
            out["disturbed"].append(list(key))
            continue
        out["retimed"].append(list(key))
        for i, fresh in zip(by_key[key], settled):
            records[i] = fresh | {"retimed": True}
    if out["suspects"]:
        print(f"[eval] stall rule (eval.stall): {len(out['suspects'])} of {out['n_requests']} requests re-timed, "
              f"{len(out['disturbed'])} still disturbed (kept out of the headline)")
    return out


def _retime(context: dict, first: list[dict], medians: dict, methods: dict, evaluation: Evaluation,
            clock) -> list[dict] | None:
    """Up to `retimes` fresh timings of one request; the first that is clean or reproduces `first`, else None."""
    rule = evaluation.settings.stall
    for attempt in range(rule["retimes"]):
        fresh = time_request(context | {"rotation": context["rotation"] + 1 + attempt}, methods, evaluation, clock)
        if not stalled(fresh, medians, rule["factor"]) or reproduced(first, fresh, rule["agree"]):
            return fresh
    return None
