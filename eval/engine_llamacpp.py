"""`eval.engine=llamacpp`: the drafts measured inside llama.cpp's own server, on the same held-out prompts.

Methods: `autoregressive` (llama-server, no draft), `speculative` (the tuned draft with speculative.json
`engines.llamacpp` where it has one, a domain calibrated "off" served plainly; else the server's defaults),
`speculative_defaults` (server defaults, when a calibration exists), `speculative_init`. Each request is a prompt's
first user turn as token ids, sent to every server in rotating order; times are the server's own, acceptance its
draft counters. Drafts are converted by llama.cpp's converter and quantised to the target's family, cached under
${paths.engines}/gguf by weight hash.
"""
from __future__ import annotations

import functools
import hashlib
import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from eval import metrics as M
from eval.harness import interleaved, time_requests
from pipeline.measure import speculation_profile as sp
from pipeline.atomic import atomic_dir, write_json
from pipeline.modelio.chat import encode_chat, messages_for, stop_token_ids
from pipeline.engines import llamacpp
from pipeline.errors import PipelineError
from pipeline.modelio.models import load_tokenizer, model_gguf, resolve_model
from pipeline.sampling import derive_seed
from pipeline.decoding.spec import DEFAULT, SpeculativeSpec


log = functools.partial(print, "[eval:llamacpp]", flush=True)  # one progress line, tagged with its stage


@dataclass
class EngineStats:
    """The draft counters llama-server reports for one request, in DecodeStats' shape for eval/metrics.py."""
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)


def cached_gguf(root: Path, model_dir: Path, out_dir: Path, quant: str | None) -> Path:
    """An HF model directory as GGUF (llamacpp.hf_to_gguf), cached under `out_dir` by the hash of its weights."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise PipelineError(f"{model_dir} holds no safetensors weights: point eval.draft at a draft export")
    digest = hashlib.sha256(b"".join(w.read_bytes()[:1 << 20] + str(w.stat().st_size).encode() for w in weights))
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{model_dir.name}-{digest.hexdigest()[:12]}-{quant or 'F16'}.gguf"
    return final if final.is_file() else llamacpp.hf_to_gguf(root, model_dir, final, quant)


def calibrated(spec: SpeculativeSpec | None, domain: str) -> dict | None:
    """The tuned draft's llama.cpp setting for a domain ({"speculate", "n_max", "p_min"}), or None."""
    table = ((spec.engines or {}).get("llamacpp") or {}).get("by_domain") if spec is not None else None
    if not table:
        return None
    return table.get(domain, table.get(DEFAULT))


def server_plan(spec: SpeculativeSpec | None, domains: list[str], drafts: dict[str, Path]) -> dict:
    """{method: {domain: (draft name or None, DraftSettings)}}: which server answers each method's requests."""
    defaults = llamacpp.DraftSettings()
    plan = {"autoregressive": {d: (None, defaults) for d in domains}}
    if calibrated(spec, DEFAULT) is None:
        plan["speculative"] = {d: ("speculative", defaults) for d in domains}
    else:
        plan["speculative"] = {}
        for d in domains:
            setting = calibrated(spec, d)
            plan["speculative"][d] = (("speculative", llamacpp.DraftSettings(setting["n_max"], setting["p_min"]))
                                      if setting["speculate"] else (None, defaults))
        plan["speculative_defaults"] = {d: ("speculative", defaults) for d in domains}
    if "speculative_init" in drafts:
        plan["speculative_init"] = {d: ("speculative_init", defaults) for d in domains}
    return plan


def requests_of(prompts: dict[str, list[dict]], tokenizer) -> list[dict]:
    """The first user turn of every prompt, domains interleaved, as token ids."""
    return [{"domain": p["domain"], "prompt_id": p["id"], "turn": 0,
             "ids": encode_chat(tokenizer, messages_for(p, [], 0))[0].tolist()} for p in interleaved(prompts)]


def engine_records(requests: list[dict], methods: dict, seed: int, engine: str, settings, clock=None) -> list[dict]:
    """Every request through every method fn(ids, domain, n, seed) -> (tokens, EngineStats) timed by `clock`, or
    (clock None) -> (tokens, EngineStats, the engine's own seconds), through eval's harness (a seed per request;
    eval.max_minutes as eval's own loop). The caller warms each engine up: a method's server may differ by domain."""
    requests = [r | {"seed": derive_seed(seed, f"eval-{engine}", r["prompt_id"])} for r in requests]
    return time_requests(requests, methods, settings.max_new_tokens, clock, f"eval ({engine})",
                         max_minutes=settings.max_minutes)


def run_requests(requests: list[dict], plan: dict, servers: dict, settings, seed: int, stop: list[int]) -> list[dict]:
    """Every request through every method's server (a warm-up request to each first, untimed); times are the
    server's."""
    for server in servers.values():
        server.complete(requests[0]["ids"], settings.warmup_tokens, settings.sampling, seed)

    def method(name):
        def decode(ids, domain, n, request_seed):
            out = servers[plan[name][domain]].complete(ids, n, settings.sampling, request_seed, stop)
            timings, passes = out["timings"], out.get("passes") or []
            return (out["tokens"], EngineStats([a for a, _ in passes], [d for _, d in passes]),
                    (float(timings.get("prompt_ms", 0)) + float(timings["predicted_ms"])) / 1e3)
        return decode
    return engine_records(requests, {name: method(name) for name in plan}, seed, "llamacpp", settings)


def start_servers(stack: ExitStack, root: Path, target: Path, drafts: dict[str, Path], plan: dict, engine,
                  out_dir: Path) -> dict:
    """{(draft name | None, DraftSettings): llamacpp.Server}, one per distinct setting the plan uses."""
    servers = {}
    for key in {entry for by_domain in plan.values() for entry in by_domain.values()}:
        name, setting = key
        servers[key] = stack.enter_context(llamacpp.Server(
            root, target, drafts.get(name), setting, engine.threads, context=int(engine.context),
            start_timeout=float(engine.start_timeout), log_path=out_dir / f"server-{name or 'plain'}-{len(servers)}.log",
            trace=True))
        log(f"llama-server {name or 'plain'} {' '.join(setting.flags()) or '(defaults)'} on {servers[key].url}")
    return servers


def predicted_per_pass(spec: SpeculativeSpec | None, domain: str, setting) -> dict | None:
    """The calibration's per-position prediction (distill/engines.py `predicted_per_pass`) for the setting a
    domain's server runs: the calibrated one, or the server's defaults; None where it predicted neither."""
    entry = calibrated(spec, domain)
    if entry is None:
        return None
    if setting.n_max is None:
        return entry.get("predicted_per_pass_server_defaults")
    return entry.get("predicted_per_pass") if (setting.n_max, setting.p_min) == (entry["n_max"], entry["p_min"]) \
        else None


def overall_predictions(specs: dict, plan: dict) -> dict:
    """Per method, the calibration's prediction over all its reporting rows (its default entry) where every domain's
    server ran the same setting (the server's defaults); a per-domain setting mixes predictions, so none there."""
    out = {}
    for method, by in plan.items():
        served = set(by.values())
        if len(served) == 1 and (only := served.pop())[0] is not None:
            out[method] = predicted_per_pass(specs.get(only[0]), DEFAULT, only[1])
    return out


def per_pass(records: list[dict], predicted: dict | None) -> dict | None:
    """Per draft position k, from the servers' per-pass logs: the share of passes that proposed a k-th draft and that
    accepted at least k, with intervals over requests, beside `predicted` (`inside`: within the measured interval).
    The log lists no pass that drafted nothing: a request's passes are its tokens after the first less its accepted."""
    counts = [(sum(r["stats"].accepted), r["stats"].accepted, r["stats"].drafted, len(r["tokens"])) for r in records]
    width = max((max(drafted, default=0) for _, _, drafted, _ in counts), default=0)
    if width == 0:
        return None
    accepted, proposed, passes = (np.zeros((len(counts), width)) for _ in range(3))
    for u, (total, acc, drafted, n_tokens) in enumerate(counts):
        passes[u] = max(n_tokens - 1 - total, len(drafted))
        for k in range(width):
            accepted[u, k] = sum(a > k for a in acc)
            proposed[u, k] = sum(d > k for d in drafted)
    rates, offered = sp.section(accepted, passes), sp.section(proposed, passes)
    out = {"accepted": rates["marginal_accept_rates"], "accepted_ci95": rates["marginal_accept_rates_ci95"],
           "proposed": offered["marginal_accept_rates"], "proposed_ci95": offered["marginal_accept_rates_ci95"],
           "passes": int(passes[:, 0].sum()), "requests": len(counts)}
    if predicted:
        out["predicted"] = predicted
        out["inside"] = {key: [bool(ci and ci[0] - 5e-4 <= v <= ci[1] + 5e-4) for v, ci in
                               zip(predicted[key], out[f"{key}_ci95"] + [None] * len(predicted[key]))]
                         for key in ("accepted", "proposed")}
        if predicted.get("accepted_ci95"):  # a prediction with its own interval (over held-out rows)
            out["difference"] = {key: [difference(*pair) for pair in zip(
                zip(out[key], out[f"{key}_ci95"]), zip(predicted[key], predicted[f"{key}_ci95"]))]
                for key in ("accepted", "proposed")}
    return out


def difference(measured: tuple, predicted: tuple) -> list[float] | None:
    """measured − predicted with a 95% interval: two independent estimates (eval's requests, calibrate's held-out
    rows), each interval read as ±1.96 standard errors and the errors added in quadrature. [d, lo, hi]; None where
    either has no interval."""
    (m, m_ci), (p, p_ci) = measured, predicted
    if not m_ci or not p_ci:
        return None
    se = (((m_ci[1] - m_ci[0]) / 3.92) ** 2 + ((p_ci[1] - p_ci[0]) / 3.92) ** 2) ** 0.5
    d = m - p
    return [round(d, 4), round(d - 1.96 * se, 4), round(d + 1.96 * se, 4)]


def method_metrics(records: list[dict], greedy: bool, predictions: dict | None = None) -> dict:
    """Per method: throughput, speedup over the plain server, acceptance (with CIs) and per_pass."""
    ar = [r for r in records if r["method"] == "autoregressive"]
    ar_tps = M.throughput(ar)["tokens_per_s"]
    out = {}
    for method in dict.fromkeys(r["method"] for r in records):
        recs = [r for r in records if r["method"] == method]
        m = M.throughput(recs)
        if method != "autoregressive":
            drafted = sum(sum(r["stats"].drafted) for r in recs)
            m.update({"speedup": m["tokens_per_s"] / ar_tps if ar_tps else 0.0, "speedup_ci95": M.speedup_ci(recs, ar),
                      "n_drafted": drafted, "acceptance_rate": sum(sum(r["stats"].accepted) for r in recs) / drafted
                      if drafted else 0.0, "acceptance_rate_ci95": M.acceptance_ci(recs) if drafted else None})
            if greedy:
                m["greedy_match"] = M.greedy_match(recs, ar)
            m["per_pass"] = per_pass(recs, (predictions or {}).get(method))
        out[method] = m
    return out


def draft_comparisons(records: list[dict]) -> dict:
    """Every pair of drafting methods on the same requests ({"<a>_vs_<b>": eval/intervals.py `compare`}): the tuned
    draft, calibrated and at the server's defaults, against the draft before it or a published one, paired."""
    by: dict[str, list[dict]] = {}
    for r in records:
        if r["method"] != "autoregressive":
            by.setdefault(r["method"], []).append(r)
    names = list(by)
    return {f"{a}_vs_{b}": M.compare(by[a], by[b]) for i, a in enumerate(names) for b in names[i + 1:]}


def draft_sources(settings, paths) -> dict[str, Path]:
    """The drafts an engine eval serves: the tuned export (eval.draft, else ${paths.draft}) and, unless `none`, the
    one before it (eval.draft_init, else ${paths.draft_init}) where it exists: a directory or a .gguf file (a
    published draft as packaged)."""
    drafts = {"speculative": Path(settings.draft or paths.draft)}
    init = Path(settings.draft_init or paths.draft_init)
    if settings.draft_init != "none" and (init.is_dir() or init.suffix == ".gguf" and init.is_file()):
        drafts["speculative_init"] = init
    return drafts


def run_llamacpp(cfg: DictConfig, tracker, settings, prompts: dict, source: str, out_dir: Path) -> dict:
    """The eval stage inside llama.cpp (module docstring): metrics.json and report.md under `out_dir`."""
    engine = cfg.engines.llamacpp
    root = llamacpp.build(cfg.paths.engines, str(engine.version), log)
    target_path = resolve_model(cfg.model.target, "target", cfg.paths)
    gguf_dir = Path(cfg.paths.engines) / "gguf"
    target = model_gguf(cfg.model.target, "target", cfg.paths) or cached_gguf(root, Path(target_path), gguf_dir, None)
    quant = engine.draft_quant or llamacpp.gguf_file_type(target)
    draft_dirs = draft_sources(settings, cfg.paths)
    for path in draft_dirs.values():
        if not ((path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file())):
            raise PipelineError(f"no draft export at {path}: run stage=distill first or set eval.draft=<dir | .gguf>")
    drafts = {name: path if path.suffix == ".gguf" else path / "draft.gguf" if (path / "draft.gguf").is_file()
              else cached_gguf(root, path, gguf_dir, quant) for name, path in draft_dirs.items()}
    # a .gguf draft is served as published (e.g. a pretrained draft); an export calibrated for llama.cpp ships its
    # draft.gguf; any other export is converted here
    tokenizer = load_tokenizer(target_path)
    stop = stop_token_ids(tokenizer)  # EOS and the template's end-of-turn marker
    specs = {name: SpeculativeSpec.read(path) for name, path in draft_dirs.items() if path.is_dir()}
    plan = server_plan(specs.get("speculative"), list(prompts), drafts)
    requests = requests_of(prompts, tokenizer)
    log(f"{len(requests)} requests in {len(prompts)} domains from {source}; methods {', '.join(plan)}; target "
        f"{target.name}, drafts {', '.join(p.name for p in drafts.values())}")
    with atomic_dir(out_dir) as tmp, ExitStack() as stack:
        servers = start_servers(stack, root, target, drafts, plan, engine, tmp)
        records = run_requests(requests, plan, servers, settings, int(cfg.seed), stop)
        greedy = settings.sampling.greedy
        metrics = {"engine": "llamacpp", "version": str(engine.version), "temperature": settings.temperature,
                   "methods": list(plan), "target_gguf": target.name, "requests": requests_done(records, requests, plan),
                   "drafts": {name: p.name for name, p in drafts.items()},
                   "plan": {m: {d: {"draft": e[0], "flags": e[1].flags()} for d, e in by.items()} for m, by in plan.items()},
                   "domains": {d: method_metrics([r for r in records if r["domain"] == d], greedy,
                                                 {m: predicted_per_pass(specs.get(by[d][0]), d, by[d][1])
                                                  for m, by in plan.items()}) for d in prompts},
                   "overall": method_metrics(records, greedy, overall_predictions(specs, plan)),
                   "comparisons": {scope: draft_comparisons([r for r in records if scope in ("overall", r["domain"])])
                                   for scope in [*prompts, "overall"]}}
        write_engine_outputs(tmp, metrics, records)
    return finish(metrics, tracker)


def requests_done(records: list[dict], requests: list[dict], methods) -> dict:
    """How many of the planned requests ran (eval.max_minutes may stop the loop early)."""
    return {"done": len(records) // max(1, len(methods)), "planned": len(requests)}


ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM"}


def write_engine_outputs(out_dir: Path, metrics: dict, records: list[dict]) -> None:
    """metrics.json, requests.jsonl (one line per timed request) and report.md of an engine eval into `out_dir`."""
    write_json(out_dir / "metrics.json", metrics)
    with open(out_dir / "requests.jsonl", "w") as f:
        for r in records:
            stats = r["stats"]
            f.write(json.dumps({**{k: r[k] for k in ("method", "domain", "prompt_id", "turn", "time_s")},
                                "n_tokens": len(r["tokens"]), "accepted": sum(stats.accepted),
                                "drafted": sum(stats.drafted),
                                "passes": [list(p) for p in zip(stats.accepted, stats.drafted)]}) + "\n")
    (out_dir / "report.md").write_text(report(metrics))


def finish(metrics: dict, tracker) -> dict:
    """The report on stdout and every method's speedup per domain in the tracker, as `<engine>.<domain>.<method>`;
    returns the stage's result."""
    print(report(metrics))
    tracker.log_metrics({f"{metrics['engine']}.{d}.{m}.speedup": v.get("speedup", 1.0)
                         for d, by in [*metrics["domains"].items(), ("overall", metrics["overall"])] for m, v in by.items()})
    return {"speedup": metrics["overall"].get("speculative", {}).get("speedup")}


CONTROL_BAND = 0.05  # plain server against plain server: a reading further than this from 1.00× is other load


def report(metrics: dict) -> str:
    name = ENGINE_NAMES[metrics["engine"]]
    ran = metrics.get("requests") or {}
    cut = ([f"eval.max_minutes stopped the run after {ran['done']} of {ran['planned']} requests.", ""]
           if ran and ran["done"] < ran["planned"] else [])
    lines = [f"# {name} {metrics['version']}: plain vs drafts (T = {metrics['temperature']})", "", *cut,
             "| domain | method | tok/s | speedup [95% CI] | acceptance [95% CI] |", "|---|---|---|---|---|"]
    plan = metrics.get("plan") or {}
    for domain, by in [*metrics["domains"].items(), ("overall", metrics["overall"])]:
        for method, m in by.items():
            ci, aci = m.get("speedup_ci95"), m.get("acceptance_rate_ci95")
            speed = "1.00×" if method == "autoregressive" else f"{m['speedup']:.2f}×{_interval(ci, '.2f')}"
            if method != "autoregressive" and _plain_only(plan.get(method), domain):
                speed = f"off (plain server: {speed})"
            accept = "–" if not m.get("n_drafted") else f"{m['acceptance_rate']:.3f}{_interval(aci)}"
            lines.append(f"| {domain} | {method} | {m['tokens_per_s']:.1f} | {speed} | {accept} |")
    return "\n".join(lines + comparison_table(metrics) + control_flags(metrics) + per_pass_table(metrics)) + "\n"


def comparison_table(metrics: dict) -> list[str]:
    """The paired draft-against-draft ratios (tokens/s on the same requests), where two drafts ran."""
    rows = [(scope, key, c) for scope, pairs in (metrics.get("comparisons") or {}).items() for key, c in pairs.items()]
    if not rows:
        return []
    lines = ["", "Draft against draft, paired on the same requests (tokens/s ratio, 95% CI over requests):", "",
             "| domain | methods | ratio [95% CI] | requests |", "|---|---|---|---|"]
    return lines + [f"| {scope} | {key.replace('_vs_', ' / ')} | {c['ratio']:.2f}×{_interval(c['ci95'], '.2f')} | "
                    f"{c['n_requests']} |" for scope, key, c in rows]


def _plain_only(by_domain: dict | None, domain: str) -> bool:
    """Whether a method's requests in `domain` ("overall": in every domain) were all answered by the plain server."""
    if not by_domain:
        return False
    served = by_domain.values() if domain == "overall" else [by_domain.get(domain, {"draft": ""})]
    return all(entry["draft"] is None for entry in served)


def control_flags(metrics: dict) -> list[str]:
    """Rows where a method was served by the plain server (calibrated "off") but read beyond ±CONTROL_BAND of 1.00×:
    the same computation timed twice disagreed, so that run's timings were disturbed by other load."""
    plan = metrics.get("plan") or {}
    flagged = [f"{domain} {method} {m['speedup']:.2f}×"
               for domain, by in [*metrics["domains"].items(), ("overall", metrics["overall"])]
               for method, m in by.items() if method != "autoregressive" and _plain_only(plan.get(method), domain)
               and abs(m.get("speedup", 1.0) - 1.0) > CONTROL_BAND]
    if not flagged:
        return []
    flag = (f"**Timings disturbed:** plain server against plain server read beyond ±{CONTROL_BAND:.0%} of 1.00× "
            f"({', '.join(flagged)}): other load on this machine; read no speedup of this run (acceptance counts "
            "are unaffected).")
    return ["", flag]


def per_pass_table(metrics: dict) -> list[str]:
    """per_pass of every method and domain as a table (the caption says what each column is)."""
    rows = [(d, method, m["per_pass"]) for d, by in [*metrics["domains"].items(), ("overall", metrics["overall"])]
            for method, m in by.items() if m.get("per_pass")]
    if not rows:
        return []
    caption = ("Per draft position k, the share of verify passes that accepted at least k drafts (llama-server's "
               "per-pass log; 95% CI over requests), beside the calibration's prediction on the held-out rows (95% "
               "CI over rows); inside: the prediction lies in the measured interval; difference: measured − "
               "predicted with both errors:")
    header = "| domain | method | passes | k | measured [95% CI] | predicted [95% CI] | inside | difference [95% CI] |"
    lines = ["", caption, "", header, "|---|---|---|---|---|---|---|---|"]
    for domain, method, m in rows:
        predicted = m.get("predicted") or {}
        guesses = predicted.get("accepted", [])
        diff = (m.get("difference") or {}).get("accepted", [])
        for k, (value, ci) in enumerate(zip(m["accepted"], m["accepted_ci95"])):
            known = k < len(guesses)
            guess = f"{guesses[k]:.3f}{_interval((predicted.get('accepted_ci95') or [None] * (k + 1))[k])}" \
                if known else "–"
            inside = ("yes" if m["inside"]["accepted"][k] else "**no**") if known else "–"
            shown = f"{diff[k][0]:+.3f}{_interval(diff[k][1:])}" if k < len(diff) and diff[k] else "–"
            lines.append(f"| {domain} | {method} | {m['passes']} | {k + 1} | {value:.3f}{_interval(ci)} | {guess} "
                         f"| {inside} | {shown} |")
    return lines


def _interval(ci, fmt: str = ".3f") -> str:
    return f" [{ci[0]:{fmt}}, {ci[1]:{fmt}}]" if ci else ""
