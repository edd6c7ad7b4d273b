"""`eval.engine=vllm`: the drafts measured inside vLLM's offline engine on CUDA (`pip install vllm`).

Methods: `autoregressive`, `speculative` (speculative.json `engines.vllm` speculative_config per domain, else a fixed
k of its decoder calibration; "off" answered by the plain engine) and `speculative_init` at the same k. One engine per
distinct config shares the GPU; each request is a first user turn as token ids, one at a time (batch 1), engines in
rotating order; times are wall-clock, acceptance vLLM's spec-decode counters read around each request. Each
speculative_config carries the draft and rejection sampling of the rule distill's calibration simulated
(pipeline/engines/rules.py); the fallback drafts the argmax, vLLM's default.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from omegaconf import DictConfig

from eval.engine_llamacpp import (EngineStats, engine_records, finish, method_metrics, requests_done, requests_of,
                                  write_engine_outputs)
from pipeline.atomic import atomic_dir
from pipeline.modelio.chat import stop_token_ids
from pipeline.decoding import DraftLength
from pipeline.errors import PipelineError
from pipeline.modelio.models import load_tokenizer, resolve_model
from pipeline.decoding.spec import DEFAULT, SpeculativeSpec
from pipeline.timing import synced_clock

COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


log = partial(print, "[eval:vllm]", flush=True)  # one progress line, tagged with its stage


def require_vllm() -> None:
    """One line naming the fix when vLLM or CUDA is missing (checked before anything is loaded or written)."""
    import torch

    try:
        import vllm  # noqa: F401
    except ImportError:
        raise PipelineError("eval.engine=vllm needs `pip install vllm` on a CUDA machine: install it, or use "
                            "eval.engine=ours|hf|llamacpp") from None
    if not torch.cuda.is_available():
        raise PipelineError("eval.engine=vllm needs a CUDA GPU (torch.cuda.is_available() is False): run it on a GPU "
                            "machine, or use eval.engine=ours|hf|llamacpp")


def speculative_config(spec: SpeculativeSpec | None, domain: str, draft_dir: Path, default_k: int) -> dict | None:
    """The vLLM speculative_config a domain is served with: speculative.json engines.vllm's (None = "off"), else
    method draft_model at the decoder calibration's fixed γ (or `default_k`)."""
    table = ((spec.engines or {}).get("vllm") or {}).get("speculative_config") if spec is not None else None
    if table:
        config = table.get(domain, table.get(DEFAULT))
        return None if config is None else {**config, "model": str(draft_dir)}
    k = (spec.recipe(domain).gamma if spec is not None else None) or default_k
    return {"model": str(draft_dir), "method": "draft_model", "num_speculative_tokens": int(k)}


def engine_plan(drafts: dict[str, Path], domains: list[str], default_k: int) -> dict[str, dict[str, str | None]]:
    """{method: {domain: config key | None}} and the configs by key (JSON of the speculative_config)."""
    spec = SpeculativeSpec.read(drafts["speculative"])
    plan = {"autoregressive": {d: None for d in domains}}
    for name, path in drafts.items():
        plan[name] = {}
        for d in domains:
            config = speculative_config(spec, d, path, default_k)  # every draft at the tuned draft's calibration
            plan[name][d] = None if config is None else json.dumps(config, sort_keys=True)
    return plan


def start_engines(target: Path, plan: dict, options, dtype: str) -> dict:
    """{config key | None: vllm.LLM}, one engine per distinct speculative_config (None: the plain engine)."""
    from vllm import LLM

    keys = sorted({key for by_domain in plan.values() for key in by_domain.values()}, key=lambda k: k or "")
    share = float(options.gpu_memory_utilization) / len(keys)
    engines = {}
    for key in keys:
        engines[key] = LLM(model=str(target), dtype=dtype, gpu_memory_utilization=share, seed=0,
                           max_model_len=options.max_model_len, enforce_eager=bool(options.enforce_eager),
                           disable_log_stats=False, speculative_config=None if key is None else json.loads(key))
        log(f"engine {'plain' if key is None else key} ready ({share:.2f} of GPU memory)")
    return engines


def counters(llm) -> dict[str, float]:
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name in COUNTERS}


def generate(llm, ids: list[int], n: int, settings, seed: int, stop: list[int]) -> tuple[list[int], EngineStats]:
    """One request at batch 1: (token ids, the engine's drafted/accepted counts for it)."""
    from vllm import SamplingParams, TokensPrompt

    sampling = settings.sampling
    params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1,
                            max_tokens=n, seed=seed % 2**31, stop_token_ids=stop, detokenize=False)
    before = counters(llm)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
    after = counters(llm)
    drafted, accepted = (int(after.get(name, 0.0) - before.get(name, 0.0)) for name in COUNTERS)
    return list(out.token_ids), EngineStats([accepted], [drafted])


def _decode(engines: dict, routes: dict, settings, stop: list[int], ids, domain, n, seed):
    return generate(engines[routes[domain]], ids, n, settings, seed, stop)


def run_vllm(cfg: DictConfig, tracker, settings, prompts: dict, source: str, out_dir: Path) -> dict:
    """The eval stage inside vLLM (module docstring): metrics.json, requests.jsonl and report.md under `out_dir`."""
    drafts = {"speculative": Path(settings.draft or cfg.paths.draft)}
    if settings.draft_init != "none" and Path(settings.draft_init or cfg.paths.draft_init).is_dir():
        drafts["speculative_init"] = Path(settings.draft_init or cfg.paths.draft_init)
    for path in drafts.values():
        if not (path / "config.json").is_file():
            raise PipelineError(f"no draft export at {path}: run stage=calibrate first or set eval.draft=<dir>")
    target = Path(resolve_model(cfg.model.target, "target", cfg.paths))
    tokenizer = load_tokenizer(target)
    stop = stop_token_ids(tokenizer)
    plan = engine_plan(drafts, list(prompts), settings.drafting if isinstance(settings.drafting, int) else DraftLength().max)
    requests = requests_of(prompts, tokenizer)
    engines = start_engines(target, plan, cfg.engines.vllm, "bfloat16" if cfg.runtime.dtype == "auto" else
                            str(cfg.runtime.dtype))
    for llm in engines.values():  # warm-up: CUDA graphs and the allocator stay out of the timed requests
        generate(llm, requests[0]["ids"], settings.warmup_tokens, settings, int(cfg.seed), stop)
    methods = list(plan)
    decoders = {name: partial(_decode, engines, plan[name], settings, stop) for name in methods}
    records = engine_records(requests, decoders, int(cfg.seed), "vllm", settings, synced_clock("cuda"))
    greedy = settings.sampling.greedy
    metrics = {"engine": "vllm", "version": __import__("vllm").__version__, "temperature": settings.temperature,
               "methods": methods, "plan": plan, "source": source, "requests": requests_done(records, requests, methods),
               "domains": {d: method_metrics([r for r in records if r["domain"] == d], greedy) for d in prompts},
               "overall": method_metrics(records, greedy)}
    with atomic_dir(out_dir) as tmp:
        write_engine_outputs(tmp, metrics, records)
    return finish(metrics, tracker)
