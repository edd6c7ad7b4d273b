"""What a GPU changes, checked on one device through the product's own code: collect (data/collect_hf.py), a few
distill steps (distill/trainer.py) and the export (distill/export.py), our decoder's greedy exactness and speed
(pipeline/decoding, timed as eval times), and HF assisted generation with the export (README, "Check a GPU machine").

    python -m pipeline.tools gpu-check [tool.device=cuda] [tool.target=<dir> tool.random_weights=true] [tool.out=...]

Exactness: greedy outputs equal token for token; in fp32 any difference fails, in bf16 (where the verify pass and
the 1-token step round differently) a difference must sit at a near-tie of the target's top two logits
(eval/fidelity.py) and vanish in fp32. A failure makes the result `passed: false` (exit 1). Imports neither MLflow,
DVC nor gguf (what a GPU machine needs: README).
"""
from __future__ import annotations

import copy
import platform
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from omegaconf import OmegaConf

from eval.fidelity import divergence
from eval.harness import by_method, time_requests
from eval.intervals import bootstrap_ci, speedup_stat
from pipeline.atomic import write_json
from pipeline.settings import register, setting
from pipeline.modelio.chat import encode_chat, stop_token_ids
from pipeline.measure.cost_profile import machine, random_model
from pipeline.decoding import GREEDY, DraftPlan, autoregressive_generate, speculative_generate
from pipeline.engines.hf import hf_generate
from pipeline.errors import PipelineError
from pipeline.modelio.models import load_model, load_tokenizer, resolve_device, resolve_model
from pipeline.timing import synced_clock
from pipeline.control.prompts import load_prompts


@dataclass(frozen=True)
class GpuCheckSettings:
    """gpu-check: collect, distill steps, the decoder's exactness and speed, HF assisted, on one device.

    collect.*, distill.objective/trainer and model.draft as the stages read them. A few
    minutes with a 135M target; a first H200 (a VM) ran past 200 s at these sizes (docs/results.md): the JSON is
    written after each phase, so time a small run first."""
    device: str = setting("${runtime.device}", "auto (CUDA when present) | cuda | cpu; the dtype is runtime.dtype")
    target: str | None = setting(None, "HF model directory of the target; null = the model preset's (converted) target")
    random_weights: bool = setting(False, "true = random weights of tool.target's config.json, with its tokenizer: a "
                                   "machine without the weights needs only the directory's JSON files, a few MB")
    prompts: str = setting("data/prompts/qa_python_faq.jsonl", "a prompt JSONL (checked in: no prepare stage needed)")
    n_prompts: int = setting(16, "first user turns, spread over the file: collected, distilled on and decoded")
    collect_tokens: int = setting(64, "new tokens per collected completion")
    distill_steps: int = setting(8, "DistillTrainer optimizer steps on the collected rows")
    max_new_tokens: int = setting(96, "new tokens per exactness and speed request (greedy)")
    gamma: int = setting(4, "our decoder's fixed draft length")
    repeats: int = setting(2, "timed rounds over the prompts, plain and speculative interleaved")
    out: str = setting("gpu_check.json", "the result, written atomically")


register("tools", GpuCheckSettings, name="gpu-check", package="tool")


# ---------------------------------------------------------------- the decoders, fn(models, ids, n) -> (tokens, stats)
def ours_plain(m, ids, n):
    out = autoregressive_generate(m.target, ids, max_new_tokens=n, eos_token_id=m.stop)
    return out.tokens.tolist(), out.stats


def ours_speculative(m, ids, n):
    out = speculative_generate(m.target, m.draft, ids, plan=DraftPlan(m.gamma), max_new_tokens=n, eos_token_id=m.stop)
    return out.tokens.tolist(), out.stats


def hf_plain(m, ids, n):
    return hf_generate(m.target, ids, n, GREEDY, m.stop)


def hf_assisted(m, ids, n):  # the export's own generation_config, as `generate(assistant_model=...)` reads it
    return hf_generate(m.target, ids, n, GREEDY, m.stop, m.draft, m.export_config)


# ---------------------------------------------------------------- the checks
def exactness(reference, candidate, m, prompts: list, n: int) -> dict:
    """Greedy outputs of two decoders on every prompt; each difference located (target's top-2 gap there) and, below
    fp32, both rerun in fp32 copies of the models."""
    mismatches = []
    for k, ids in enumerate(prompts):
        a, b = reference(m, ids, n)[0], candidate(m, ids, n)[0]
        if a != b:
            mismatches.append({"prompt": k} | divergence(m.target, ids, a, b))
    result = {"prompts": len(prompts), "identical": len(prompts) - len(mismatches), "mismatches": mismatches}
    if m.dtype == torch.float32 or not mismatches:
        return result | {"passed": not mismatches}
    fp32 = fp32_models(m)
    persisting = [d["prompt"] for d in mismatches
                  if reference(fp32, prompts[d["prompt"]], n)[0] != candidate(fp32, prompts[d["prompt"]], n)[0]]
    return result | {"fp32_persisting": persisting, "passed": all(d["near_tie"] for d in mismatches) and not persisting}


def speed(m, prompts: list, n: int, repeats: int) -> dict:
    """Plain and speculative tokens/s on the same requests, interleaved in eval's rotating order."""
    methods = {"plain": lambda ids, _d, k, _s: ours_plain(m, ids, k),
               "speculative": lambda ids, _d, k, _s: ours_speculative(m, ids, k)}
    requests = [{"ids": ids, "domain": "all", "seed": r * len(prompts) + k}
                for r in range(repeats) for k, ids in enumerate(prompts)]
    records = by_method(time_requests(requests, methods, n, synced_clock(m.device), "gpu-check speed", warmup_tokens=8))
    tok = {name: np.array([len(r["tokens"]) for r in recs], float) for name, recs in records.items()}
    sec = {name: np.array([r["time_s"] for r in recs]) for name, recs in records.items()}
    samples = (tok["speculative"], sec["speculative"], tok["plain"], sec["plain"])
    stats = [r["stats"] for r in records["speculative"]]
    drafted, accepted = sum(s.n_drafted for s in stats), sum(s.n_accepted for s in stats)
    return {"requests": len(requests), "plain_tokens_per_s": float(tok["plain"].sum() / sec["plain"].sum()),
            "speculative_tokens_per_s": float(tok["speculative"].sum() / sec["speculative"].sum()),
            "speedup": float(speedup_stat(*samples)), "speedup_ci95": bootstrap_ci(samples, speedup_stat),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": float(tok["speculative"].sum()) / max(1, sum(s.target_passes for s in stats))}


# ---------------------------------------------------------------- collect, distill, export
def collect(cfg, m, prompts: list[dict], tokens: int) -> tuple[list[dict], dict]:
    """The collect stage's rows (HF backend, collect.* sampling and top-k labels) for the prompts, on the device."""
    from data.collect_hf import HFBackend
    from data.collect_rows import CollectSettings, collect_shard

    settings = replace(CollectSettings.from_config(cfg.collect, cfg.seed), max_new_tokens=tokens, samples_per_prompt=1,
                       hidden_states=False)
    clock = synced_clock(m.device)
    started = clock()
    rows, _ = collect_shard(HFBackend(m.target, m.tokenizer.pad_token_id, m.stop, settings), m.tokenizer, prompts, 1,
                            seed=int(cfg.seed))
    seconds, n = clock() - started, sum(len(r["completion_ids"]) for r in rows)
    return rows, {"rows": len(rows), "tokens": n, "seconds": seconds, "tokens_per_s": n / seconds,
                  "batch_size": settings.batch_size, "topk": settings.topk}


def distill(cfg, m, rows: list[dict], steps: int, out: Path) -> tuple[Path, dict]:
    """model.draft built from the target, `steps` DistillTrainer steps on the rows (distill.objective and .trainer,
    as the stage passes them), exported as the stage writes a draft; returns the export's directory."""
    from datasets import Dataset

    from distill.export import save_draft
    from distill.settings import OUR_TRAINER_KEYS, trainer_arguments
    from distill.trainer import DistillConfig, DistillTrainer
    from distill.training import mixed_bf16
    from pipeline.modelio.draft_init import build_draft

    rows = [r for r in rows if r["completion_ids"]]
    draft = build_draft(cfg.model.draft, m.target, m.tokenizer, cfg.paths, seed=int(cfg.seed))[0].train()
    training = {k: v for k, v in trainer_arguments(OmegaConf.to_container(cfg.distill.trainer, resolve=True)).items()
                if k not in OUR_TRAINER_KEYS}
    objective = OmegaConf.to_container(cfg.distill.objective, resolve=True)
    if "topk_ids" not in rows[0]:  # collect.topk=0: no cached labels, the target labels each batch
        objective["teacher"] = "online"
    args = DistillConfig(output_dir=str(out / "checkpoints"), **training | {
        "max_steps": steps, "warmup_steps": 0, "bf16": mixed_bf16(training["bf16"], m.target)}, **objective,
        save_strategy="no", logging_steps=1, report_to="none", remove_unused_columns=False,
        length_column_name="length", use_cpu=m.device.type == "cpu", seed=int(cfg.seed), disable_tqdm=True)
    dataset = Dataset.from_list(rows).add_column("length", [len(r["prompt_ids"]) + len(r["completion_ids"])
                                                            for r in rows])
    trainer = DistillTrainer(draft, args, dataset, teacher_model=m.target, stop_ids=m.stop, processing_class=m.tokenizer)
    started = time.time()
    steps_done = trainer.train().global_step
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    export = save_draft(draft.eval(), m.tokenizer, out / "draft", m.target.generation_config)
    return export, {"steps": steps_done, "seconds": time.time() - started, "train_tokens": trainer.train_tokens,
                    "first_loss": losses[0], "last_loss": losses[-1], "bf16_autocast": bool(args.bf16),
                    "loss": objective["loss"], "teacher": objective["teacher"]}


# ---------------------------------------------------------------- the run
def first_turns(path: str | Path, n: int) -> list[dict]:
    """{domain, text}: the first user turn of n prompts spread over the file (Spec-Bench groups its categories)."""
    if not Path(path).is_file():
        raise PipelineError(f"tool.prompts={path} is not a file: pass a prompt JSONL")
    rows = load_prompts(Path(path))
    step = max(1, len(rows) // n)
    return [{"domain": row.get("domain", "default"), "text": row["turns"][0]} for row in rows[::step]][:n]


def options(cfg) -> SimpleNamespace:
    args = SimpleNamespace(**cfg.tool)
    for key in ("n_prompts", "collect_tokens", "distill_steps", "max_new_tokens", "gamma", "repeats"):
        if getattr(args, key) < 1:
            raise PipelineError(f"tool.{key}={getattr(args, key)} is not an integer >= 1")
    return args


def load(cfg, args) -> SimpleNamespace:
    """The target (tool.target, else the model preset's converted one) on tool.device in runtime.dtype (random
    weights of its config with tool.random_weights)."""
    if cfg.tool.target is None:
        path = resolve_model(cfg.model.target, "target", cfg.paths)
    elif not (Path(cfg.tool.target) / "config.json").is_file():
        raise PipelineError(f"tool.target={cfg.tool.target} is not an HF model directory (no config.json)")
    else:
        path = Path(cfg.tool.target)
    device, dtype = resolve_device({"device": args.device, "dtype": cfg.runtime.dtype},
                                   None if args.random_weights else path, cfg.paths.models)
    target = random_model(path, dtype, device, cfg.seed) if args.random_weights else load_model(path, device, dtype)
    tokenizer = load_tokenizer(path)
    return SimpleNamespace(target=target, draft=None, tokenizer=tokenizer, stop=stop_token_ids(tokenizer, target),
                           device=device, dtype=dtype, gamma=int(args.gamma), path=path, export_config=None, fp32=None)


def fp32_models(m) -> SimpleNamespace:
    """float32 copies of both models (made once): where greedy decoders must agree exactly."""
    if m.fp32 is None:
        m.fp32 = SimpleNamespace(**vars(m) | {"target": copy.deepcopy(m.target).float(), "dtype": torch.float32,
                                              "draft": copy.deepcopy(m.draft).float()})
    return m.fp32


def table(r: dict) -> str:
    c, d, s, e = r["collect"], r["distill"], r["speed"], r["exactness"]
    ci = "[n<2]" if s["speedup_ci95"] is None else "[{:.2f}, {:.2f}]".format(*s["speedup_ci95"])
    lines = [f"gpu-check on {r['device']} ({r['device_name']}), {r['dtype']}, torch {r['torch']}, transformers "
             f"{r['transformers']}; target {r['target']}" + (" (random weights)" if r["random_weights"] else ""),
             f"{'collect':<22}{'ok':<6}{c['rows']} rows, {c['tokens']} tokens in {c['seconds']:.1f} s "
             f"({c['tokens_per_s']:.0f} tokens/s, batch {c['batch_size']})",
             f"{'distill':<22}{'ok':<6}{d['steps']} steps, {d['loss']} loss {d['first_loss']:.3f} -> "
             f"{d['last_loss']:.3f}, {d['seconds']:.1f} s"]
    for name, check in e.items():
        ties = sum(d["near_tie"] for d in check["mismatches"])
        lines.append(f"{'exactness ' + name:<22}{'PASS' if check['passed'] else 'FAIL':<6}{check['identical']}/"
                     f"{check['prompts']} identical" + (f", {ties} of {len(check['mismatches'])} differences at "
                                                        "near-ties" if check["mismatches"] else "")
                     + (f", persisting in fp32: {check['fp32_persisting']}" if "fp32_persisting" in check else ""))
    lines.append(f"{'speed':<22}{'-':<6}plain {s['plain_tokens_per_s']:.1f} tokens/s, speculative "
                 f"{s['speculative_tokens_per_s']:.1f}: {s['speedup']:.2f}x {ci} over {s['requests']} requests, "
                 f"acceptance {s['acceptance_rate']:.2f}, {s['mean_accepted_length']:.2f} tokens per pass")
    return "\n".join(lines)


def run(cfg) -> dict:
    args, started = options(cfg), time.time()
    turns = first_turns(args.prompts, args.n_prompts)
    m = load(cfg, args)
    info = machine(m.device, m.dtype)
    result = {"device": str(m.device), "device_name": info["device_name"], "torch": info["torch_version"],
              "transformers": info["transformers_version"], "python": platform.python_version(),
              "dtype": info["dtype"], "target": str(m.path), "random_weights": args.random_weights,
              "settings": dict(vars(args)), "phase_seconds": {}, "passed": None}

    def done(phase: str, began: float) -> None:
        """The phase's time, and the result so far written at once: a run a time limit kills leaves what it measured."""
        result["phase_seconds"][phase] = round(time.time() - began, 2)
        write_json(args.out, result)
        print(f"gpu-check: {phase} done in {result['phase_seconds'][phase]:.1f} s", flush=True)

    prompts = [encode_chat(m.tokenizer, [{"role": "user", "content": t["text"]}]).to(m.device) for t in turns]
    began = time.time()
    rows, result["collect"] = collect(cfg, m, [{"id": f"p{k}", "domain": t["domain"], "turns": [t["text"]]}
                                               for k, t in enumerate(turns)], args.collect_tokens)
    done("collect", began)
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        export, result["distill"] = distill(cfg, m, rows, args.distill_steps, Path(tmp))
        m.draft = load_model(export, m.device, m.dtype)  # the export as a user loads it, in the serving dtype
    m.export_config = copy.deepcopy(m.draft.generation_config)
    done("distill", began)
    n, checks = args.max_new_tokens, result.setdefault("exactness", {})
    for phase, (reference, candidate) in {"decoder": (ours_plain, ours_speculative),
                                          "hf_assisted": (hf_plain, hf_assisted)}.items():
        began = time.time()
        checks[phase] = exactness(reference, candidate, m, prompts, n)
        done(f"exactness {phase}", began)
    began = time.time()
    result["speed"] = speed(m, prompts, n, args.repeats)
    done("speed", began)
    result |= {"seconds": time.time() - started, "passed": all(check["passed"] for check in checks.values())}
    write_json(args.out, result)
    print(table(result) + f"\nwrote {args.out}")
    return result
