"""Eval stage: the project's speculative decoder against plain target decoding, per domain.

    python -m pipeline stage=eval [eval.draft=<dir>|derive] [eval.prompts_file=<jsonl>] [eval.gamma=4] ...

Every held-out request (one user turn of one prompt, chat template applied; later turns conditioned on
the target's own autoregressive answer) is decoded by every method back to back, in rotating order,
after a warm-up, so machine drift hits all methods alike. Methods (names as in metrics.json):
  autoregressive     own plain decoding (eval.speculative.autoregressive_generate)
  speculative        own speculative decoding with the tuned draft (eval.draft, default ${paths.draft})
  speculative_init   the same with the undistilled draft (${paths.draft_init}), when it exists
  hf_generate, hf_assisted, hf_assisted_fixed   HF peers (eval/baselines.py), with eval.baselines=true
Writes metrics.json, report.md, requests.jsonl and PNG plots to ${paths.eval} in one atomic rename.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from eval import metrics as M
from eval.baselines import assistant_configs, hf_generate
from eval.fidelity import NEAR_TIE_ULPS, diagnose, fidelity_check, first_prompts, fp32_recheck
from eval.report import domain_rows, log_to_tracker, machine, text_table, write_outputs
from eval.speculative import autoregressive_generate, speculative_generate
from pipeline.chat import encode_chat, messages_for, stop_token_ids
from pipeline.errors import PipelineError
from pipeline.models import (check_compatible, derive_draft, load_model, load_role, load_tokenizer,
                             model_identity, resolve_device, resolve_model)


# ---------------------------------------------------------------- settings and inputs

def settings_from(cfg: DictConfig) -> dict:
    """The eval knobs, checked before any model is loaded: bad input fails fast and writes nothing."""
    s = OmegaConf.to_container(cfg.eval, resolve=True)

    def bad(key: str, problem: str, fix: str):
        raise PipelineError(f"eval.{key}={s[key]!r} {problem}: {fix}")

    if s["gamma"] is not None and (not isinstance(s["gamma"], int) or s["gamma"] < 1):
        bad("gamma", "is not a draft length >= 1", "use e.g. eval.gamma=4, or null for the calibrated γ")
    if not isinstance(s["default_gamma"], int) or s["default_gamma"] < 1:
        bad("default_gamma", "is not a draft length >= 1", "use e.g. eval.default_gamma=4")
    s["gammas"] = list(s["gammas"] or [])
    if any(not isinstance(g, int) or g < 1 for g in s["gammas"]):
        bad("gammas", "holds a γ < 1", "list draft lengths >= 1, e.g. eval.gammas=[1,2,4,6,8], or [] for no sweep")
    if s["temperature"] is None or s["temperature"] < 0:
        bad("temperature", "is negative", "use 0 for greedy decoding or a positive temperature")
    if s["draft_temperature"] is not None and s["draft_temperature"] < 0:
        bad("draft_temperature", "is negative", "use a positive value, or null for the calibrated/target temperature")
    if s["top_p"] is None or not 0 < s["top_p"] <= 1:
        bad("top_p", "is outside (0, 1]", "use a nucleus mass in (0, 1]; 1 switches top-p off")
    if not isinstance(s["top_k"], int) or s["top_k"] < 0:
        bad("top_k", "is not an integer >= 0", "use 0 to switch top-k off, or a positive k")
    for key in ("max_new_tokens", "sweep_prompts_per_domain", "warmup_tokens"):
        if not isinstance(s[key], int) or s[key] < 1:
            bad(key, "is not an integer >= 1", f"set eval.{key} to a positive integer")
    for key in ("max_prompts_per_domain", "fidelity_prompts_per_domain"):
        if s[key] is not None and (not isinstance(s[key], int) or s[key] < 0 + (key == "max_prompts_per_domain")):
            bad(key, "is not a valid count", f"set eval.{key} to a positive integer (null = all)")
    if s.get("baselines_draft", "speculative") not in ("speculative", "speculative_init"):
        bad("baselines_draft", "is not a draft eval loads", "use speculative (the tuned export) or speculative_init")
    if isinstance(s["domains"], str):
        s["domains"] = [s["domains"]]
    return s


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


def load_eval_prompts(cfg: DictConfig, s: dict) -> tuple[dict[str, list[dict]], str]:
    """{domain: prompts} in file order, at most eval.max_prompts_per_domain each; and where they came from."""
    from pipeline.prompts import load_prompts, load_split

    if s["prompts_file"]:
        source = str(s["prompts_file"])
        rows = load_prompts(source)  # our schema or Spec-Bench's; raises on an empty or malformed file
        if s["domains"]:
            available = sorted({p["domain"] for p in rows})
            missing = [d for d in s["domains"] if d not in available]
            if missing:
                raise PipelineError(f"eval.domains {missing} have no prompts in {source} (available: {available}): "
                                    "fix eval.domains or the file")
            rows = [p for p in rows if p["domain"] in s["domains"]]
    else:
        source = f"{cfg.paths.prompts}/eval.jsonl (held-out split of the prepare stage)"
        rows = load_split(cfg.paths.prompts, "eval", s["domains"])
    by_domain: dict[str, list[dict]] = {}
    for p in rows:
        by_domain.setdefault(p["domain"], []).append(p)
    n = s["max_prompts_per_domain"]
    return {d: ps[:n] if n else ps for d, ps in by_domain.items()}, source


# ---------------------------------------------------------------- drafts

@dataclass
class Draft:
    model: torch.nn.Module
    identity: dict
    calibration: dict = field(default_factory=dict)  # speculative.json of the export (may be empty)
    vocab: torch.Tensor | None = None  # FR-Spec head subset (target ids)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _read_calibration(path: Path) -> dict:
    """speculative.json of a draft export, or {} (a plain HF directory has none)."""
    file = path / "speculative.json"
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{file} is not valid JSON ({e.msg}): re-export the draft or delete the file") from None
    return data if isinstance(data, dict) else {}


def _draft_from_dir(path: Path, target, tokenizer, device, dtype, s: dict, role: str,
                    target_sha: str | None = None) -> Draft:
    model = load_model(path, device, dtype)
    try:
        draft_tok = load_tokenizer(path)
    except Exception:  # a weights-only directory: fall back to comparing the output heads
        draft_tok = None
        print(f"[eval] note: {path} has no tokenizer; checking only that its vocabulary size matches the target's")
    if draft_tok is not None:
        check_compatible(tokenizer, draft_tok, target, model)
    elif model.config.vocab_size != target.config.vocab_size:
        raise PipelineError(f"{role} {path} predicts over {model.config.vocab_size:,} tokens, the target over "
                            f"{target.config.vocab_size:,}: use a draft that shares the target's tokenizer")
    calibration = _read_calibration(path)
    ident = {**model_identity(path), "source": str(path), "n_params": _n_params(model)}
    trained_for = calibration.get("target")
    trained_for = trained_for.get("source_sha256") if isinstance(trained_for, dict) else None
    if trained_for and target_sha and trained_for != target_sha:
        print(f"[eval] note: {path} was distilled for another target (sha256 {trained_for[:12]}…, "
              f"this target {target_sha[:12]}…); its calibration may not fit")
    vocab = calibration.get("vocab_subset")
    vocab = torch.tensor(vocab, dtype=torch.long, device=device) if vocab and s["use_vocab_subset"] else None
    return Draft(model, ident, calibration, vocab)


def _derived(cfg: DictConfig, target) -> Draft:
    layers = list(cfg.model.draft.derive.layers or [])
    model = derive_draft(target, layers)
    ident = {"source": f"derived from target layers {layers} (not distilled)", "architecture": type(model).__name__,
             "num_hidden_layers": len(layers), "hidden_size": model.config.hidden_size,
             "vocab_size": model.config.vocab_size, "n_params": _n_params(model)}
    return Draft(model, ident)


def load_drafts(cfg: DictConfig, s: dict, target, tokenizer, device, dtype, target_sha=None) -> dict[str, Draft]:
    """{"speculative": the draft under evaluation, "speculative_init": the undistilled draft (when there is one)}."""
    def from_dir(path: Path, role: str) -> Draft:
        return _draft_from_dir(path, target, tokenizer, device, dtype, s, role, target_sha)

    choice, default, path = s["draft"], Path(cfg.paths.draft), None
    if choice == "derive":
        draft = _derived(cfg, target)
    elif choice:
        path = Path(choice)
        if not (path / "config.json").exists():
            raise PipelineError(f"eval.draft={choice} is not a model directory (no config.json): point it at a "
                                "Hugging Face model directory, or use eval.draft=derive")
        draft = from_dir(path, "eval.draft")
    elif (default / "config.json").exists():
        path = default
        draft = from_dir(path, "draft")
    elif cfg.model.draft.get("init") == "pretrained":
        path = resolve_model(cfg.model.draft, "draft", cfg.paths)
        print(f"[eval] note: no exported draft at {default}; evaluating the preset's pretrained draft {path}")
        draft = from_dir(path, "draft")
    else:
        print(f"[eval] note: no exported draft at {default}; evaluating a draft derived from target layers "
              f"{list(cfg.model.draft.derive.layers or [])} (run stage=distill, or set eval.draft=<dir>)")
        draft = _derived(cfg, target)
    drafts = {"speculative": draft}

    init_choice = s["draft_init"]
    if init_choice != "none":
        init_path = Path(init_choice or cfg.paths.draft_init)
        if init_choice and not (init_path / "config.json").exists():
            raise PipelineError(f"eval.draft_init={init_choice} is not a model directory (no config.json): "
                                "point it at the undistilled draft, or use eval.draft_init=none")
        same = path is not None and init_path.resolve() == Path(path).resolve()
        if (init_path / "config.json").exists() and not same:
            drafts["speculative_init"] = from_dir(init_path, "draft_init")
    return drafts


def _per_domain(value, domain: str):
    """A speculative.json entry that is either one number or {domain: number, "default": number}."""
    if isinstance(value, dict):
        return value.get(domain, value.get("default"))
    return value if isinstance(value, (int, float)) else None


def draft_plan(draft: Draft, domain: str, s: dict) -> dict:
    """γ and draft temperature for one draft on one domain: the user's override, else the draft's calibration
    (eval.use_calibration), else eval.default_gamma and the target's temperature."""
    calib = draft.calibration if s["use_calibration"] else {}
    gamma = s["gamma"] or _per_domain(calib.get("gamma"), domain) or s["default_gamma"]
    tau = s["draft_temperature"]
    # A calibrated τ only means something for sampling at the temperature it was calibrated against; at T=0
    # the target is greedy and the draft should propose its argmax (q one-hot), so τ is not used at all.
    calibrated_for = calib.get("serving_temperature", calib.get("temperature"))
    if tau is None and s["temperature"] > 0 and (calibrated_for is None or calibrated_for == s["temperature"]):
        tau = _per_domain(calib.get("draft_temperature"), domain)
    return {"gamma": int(gamma), "draft_temperature": None if tau is None or s["temperature"] == 0 else float(tau)}


# ---------------------------------------------------------------- timed decoding

def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # CUDA runs asynchronously: the clock must wait for the kernels
        torch.cuda.synchronize(device)


def make_methods(target, drafts: dict[str, Draft], plans: dict, stop: list[int], s: dict, device) -> dict:
    """{method name: fn(input_ids, domain, max_new_tokens, seed) -> (token ids, DecodeStats | None)}."""
    T, top_k, top_p = s["temperature"], s["top_k"], s["top_p"]

    def generator(seed: int):
        return torch.Generator(device=device).manual_seed(seed)

    def ours_ar(ids, domain, n, seed):
        out = autoregressive_generate(target, ids, n, temperature=T, top_k=top_k, top_p=top_p,
                                      eos_token_id=stop, generator=generator(seed))
        return out.tokens.tolist(), out.stats

    def ours_spec(name):
        def fn(ids, domain, n, seed, gamma=None):
            plan = plans[name][domain]
            out = speculative_generate(target, drafts[name].model, ids, n, gamma=gamma or plan["gamma"],
                                       temperature=T, top_k=top_k, top_p=top_p,
                                       draft_temperature=plan["draft_temperature"], eos_token_id=stop,
                                       generator=generator(seed), draft_vocab=drafts[name].vocab)
            return out.tokens.tolist(), out.stats
        return fn

    methods = {"autoregressive": ours_ar}
    methods.update({name: ours_spec(name) for name in drafts})
    if s["baselines"]:
        which = s.get("baselines_draft") or "speculative"
        if which not in drafts:
            raise PipelineError(f"eval.baselines_draft={which} is not loaded here (drafts: {', '.join(drafts)}): use "
                                "speculative, or speculative_init when an undistilled draft exists")
        draft = drafts[which].model
        # The fixed-γ run uses the γ our decoder runs with on each domain (calibrated or overridden).
        configs = {d: assistant_configs(draft, plan["gamma"]) for d, plan in plans["speculative"].items()}

        def hf(assistant=None, which=0):
            def fn(ids, domain, n, seed):
                torch.manual_seed(seed)  # HF samples from the global RNG
                config = configs[domain][which] if assistant is not None else None
                return hf_generate(target, ids, n, T, top_k, top_p, stop, assistant, config), None
            return fn

        methods.update({"hf_generate": hf(), "hf_assisted": hf(draft, 0), "hf_assisted_fixed": hf(draft, 1)})
    return methods


def timed(fn, ids, domain, n, seed, device, **kw) -> tuple[list[int], object, float]:
    _sync(device)
    t0 = time.perf_counter()
    tokens, stats = fn(ids, domain, n, seed, **kw)
    _sync(device)
    return tokens, stats, time.perf_counter() - t0


def benchmark(prompts, methods, tokenizer, device, s: dict, seed: int) -> tuple[list[dict], list[dict]]:
    """Decodes every request with every method; returns (records, contexts) — contexts are the encoded
    requests, reused by the γ sweep and the fidelity check so every run sees the same inputs."""
    from tqdm.auto import tqdm

    n = s["max_new_tokens"]
    names = list(methods)
    first = next(iter(prompts.values()))[0]
    warm = encode_chat(tokenizer, messages_for(first, [], 0)).to(device)
    for name in names:  # warm-up: allocator, lazy imports and kernel selection stay out of the timed runs
        methods[name](warm, first["domain"], s["warmup_tokens"], seed)

    records, contexts = [], []
    total = sum(len(p["turns"]) for ps in prompts.values() for p in ps)
    bar = tqdm(total=total, desc="eval", unit="req", dynamic_ncols=True)
    k = 0
    for domain, plist in prompts.items():
        for prompt in plist:
            answers: list[str] = []
            for turn in range(len(prompt["turns"])):
                ids = encode_chat(tokenizer, messages_for(prompt, answers, turn)).to(device)
                contexts.append({"domain": domain, "prompt_id": prompt["id"], "turn": turn, "ids": ids})
                rec_seed = seed * 1_000_003 + k  # same seed for every method of a request
                for name in names[k % len(names):] + names[:k % len(names)]:  # rotate who runs first
                    tokens, stats, t = timed(methods[name], ids, domain, n, rec_seed, device)
                    records.append({"method": name, "domain": domain, "prompt_id": prompt["id"], "turn": turn,
                                    "tokens": tokens, "time_s": t, "stats": stats})
                # The next turn continues from the target's own answer, identical for every method.
                ar_tokens = next(r["tokens"] for r in reversed(records) if r["method"] == "autoregressive")
                answers.append(tokenizer.decode(ar_tokens, skip_special_tokens=True).strip())
                k += 1
                bar.set_postfix_str(domain)
                bar.update()
    bar.close()
    return records, contexts


def gamma_sweep(contexts, methods, device, s: dict, seed: int) -> dict:
    """Acceptance and speedup vs γ (tuned draft) on the first eval.sweep_prompts_per_domain prompts per domain,
    each γ interleaved with an autoregressive run of the same request."""
    from tqdm.auto import tqdm

    subset = first_prompts(contexts, s["sweep_prompts_per_domain"])
    runs: dict = {"ar": [], **{g: [] for g in s["gammas"]}}
    for k, c in enumerate(tqdm(subset, desc="γ sweep", unit="req", dynamic_ncols=True)):
        order = list(runs)
        for key in order[k % len(order):] + order[:k % len(order)]:
            fn, kw = (methods["autoregressive"], {}) if key == "ar" else (methods["speculative"], {"gamma": key})
            seed_k = seed * 1_000_003 - k - 1  # other seeds than the main run's
            tokens, stats, t = timed(fn, c["ids"], c["domain"], s["max_new_tokens"], seed_k, device, **kw)
            runs[key].append({"tokens": tokens, "time_s": t, "stats": stats})
    return {"gammas": s["gammas"], "n_prompts_per_domain": s["sweep_prompts_per_domain"], "n_requests": len(subset),
            "by_gamma": {str(g): M.sweep_point(runs[g], runs["ar"]) for g in s["gammas"]}}


# ---------------------------------------------------------------- the stage

def run(cfg: DictConfig, tracker) -> dict:
    s = settings_from(cfg)
    out_dir = output_dir(cfg)
    prompts, source = load_eval_prompts(cfg, s)
    device, dtype = resolve_device(cfg.get("runtime"))
    target, tokenizer, target_path = load_role(cfg, "target")
    target_ident = {**model_identity(target_path), "source": str(target_path), "n_params": _n_params(target)}
    drafts = load_drafts(cfg, s, target, tokenizer, device, dtype, target_ident.get("source_sha256"))
    stop = stop_token_ids(tokenizer, target)
    plans = {name: {d: draft_plan(draft, d, s) for d in [*prompts, "default"]} for name, draft in drafts.items()}
    served = drafts["speculative"].calibration.get("serving_temperature")
    if s["use_calibration"] and s["temperature"] > 0 and served is not None and served != s["temperature"]:
        print(f"[eval] note: the draft's τ was calibrated for T={served}, not T={s['temperature']}; "
              "the draft samples at the eval temperature (set eval.draft_temperature to choose one)")
    methods = make_methods(target, drafts, plans, stop, s, device)
    print(f"[eval] {sum(map(len, prompts.values()))} prompts in {len(prompts)} domains from {source}; "
          f"methods: {', '.join(methods)}; T={s['temperature']}, max_new_tokens={s['max_new_tokens']}")

    t0 = time.time()
    records, contexts = benchmark(prompts, methods, tokenizer, device, s, cfg.seed)
    core = M.build(records, plans, s["temperature"])
    metrics = {"gamma": core.pop("gamma"), "temperature": core.pop("temperature"), "top_k": s["top_k"],
               "top_p": s["top_p"], "max_new_tokens": s["max_new_tokens"], "target": str(target_path),
               "draft": drafts["speculative"].identity["source"],
               "draft_init": drafts["speculative_init"].identity["source"] if "speculative_init" in drafts else None,
               **core}
    if s["gammas"]:
        metrics["gamma_sweep"] = gamma_sweep(contexts, methods, device, s, cfg.seed)
    if s["temperature"] > 0 and s["fidelity_prompts_per_domain"]:
        metrics["fidelity"] = fidelity_check(contexts, target, drafts["speculative"], plans["speculative"], stop, s)
    elif "fidelity" in metrics:
        metrics["fidelity"] |= {"mismatches": diagnose(records, contexts, target), "near_tie_ulps": NEAR_TIE_ULPS}
    spec = M.SPECULATIVE
    found = [m for m in metrics.get("fidelity", {}).get("mismatches", []) if m.get("method", spec) == spec]
    if s.get("fp32_recheck") and dtype != torch.float32 and found:
        metrics["fidelity"]["fp32"] = fp32_recheck(contexts, target, drafts[spec], plans[spec], stop, s, found)
    metrics["wall_s"] = time.time() - t0
    tuned = drafts["speculative"]
    metrics["setup"] = {
        "machine": machine(), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "target": target_ident,
        "draft": tuned.identity | {"vocab_subset": None if tuned.vocab is None else len(tuned.vocab)},
        "draft_init": drafts["speculative_init"].identity if "speculative_init" in drafts else None,
        "calibrated": bool(s["use_calibration"] and tuned.calibration and s["gamma"] is None),
        "prompt_source": source, "settings": s,
        "prompts": {d: {"n_prompts": len(ps), "n_turns": sum(len(p["turns"]) for p in ps)}
                    for d, ps in prompts.items()},
    }
    plots = write_outputs(out_dir, metrics, records)
    print(text_table(*domain_rows(metrics)))
    print(f"[eval] wrote {out_dir}/metrics.json, report.md and {len(plots)} plots")
    log_to_tracker(tracker, metrics, out_dir)
    return {"metrics": str(out_dir / "metrics.json"),
            "overall": {k: metrics["overall"][k] for k in ("acceptance_rate", "mean_accepted_length", "speedup")}}
