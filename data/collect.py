"""Collect stage: the target's own generations on the train prompts (same-source distillation data).

`python -m pipeline stage=collect` renders each train prompt with the target's chat template and
samples completions with the serving settings in `collect.*` (later turns of a multi-turn prompt
are conditioned on the target's own earlier answer, sample 0's). Optionally it stores white-box
labels: per completion position the target's top-k ids and log-probs at temperature 1, taken from
the very forward pass that produced the token.

Output contract (distill reads exactly this):
  {paths.collect}/dataset/      a `datasets.Dataset` (save_to_disk), one row per completion:
    id             str        "{prompt_id}/t{turn}/s{sample}", unique
    prompt_id      str
    domain         str
    turn           int32      0-based user turn of the prompt
    sample         int32      0 .. samples_per_prompt-1
    prompt_ids     [int32]    the full chat-templated context, earlier turns included
    completion_ids [int32]    generated tokens, the stop token included when finish_reason is
                              "eos", nothing after it, no padding
    text           str        completion decoded without special tokens
    finish_reason  str        "eos" | "length"
    topk_ids       [[int32]]  (collect.topk > 0) row j: top-k ids of the distribution that
                              produced completion_ids[j], most likely first
    topk_logprobs  [[float16]] their log-probs (log_softmax of the raw logits, temperature 1)
  {paths.collect}/manifest.json written last: its presence marks a complete dataset.

Resume and scale-out: prompts are cut into shards (collect.shard_size prompts per domain) under
{paths.collect}/shards/<fingerprint>/; each finished shard is written atomically and skipped on a
rerun. The fingerprint hashes the target (weights, tokenizer, chat template), the sampling
settings, seed, top-k, shard size and the prompts, so old shards never mix into a new setup. Each
shard's RNG is seeded from (seed, domain, shard index, turn), so a resumed run, or one split over
`accelerate launch --num_processes N` (shard i goes to process i % N), reproduces an
uninterrupted single-process run row for row on CPU (given the same batch size).

Disk (Arrow, uncompressed; `python -m data.bench_collect` measures it): the top-k columns cost
k x (4 B id + 2 B log-prob) + 8 B of list offsets per completion token, i.e. 200 B/token or
~201 MB per million completion tokens at topk=32 (measured: 200.7). Without them a row costs
4 B per completion token + 4 B per prompt token + its text: ~13 B per completion token for
128-token answers to MT-Bench-length prompts.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from pipeline.atomic import atomic_dir, write_json
from pipeline.chat import encode_chat, messages_for, stop_token_ids
from pipeline.errors import PipelineError

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Sampling:
    """The serving sampling settings the target generates with (temperature 0 = greedy)."""
    temperature: float
    top_p: float
    top_k: int                 # 0 = off
    max_new_tokens: int
    samples_per_prompt: int


@dataclass
class Completion:
    ids: list[int]
    finish_reason: str                     # "eos" | "length"
    topk_ids: np.ndarray | None = None     # [len(ids), k] int32
    topk_logprobs: np.ndarray | None = None  # [len(ids), k] float16


def features(topk: int):
    from datasets import Features, List, Value

    cols = {"id": Value("string"), "prompt_id": Value("string"), "domain": Value("string"),
            "turn": Value("int32"), "sample": Value("int32"),
            "prompt_ids": List(Value("int32")), "completion_ids": List(Value("int32")),
            "text": Value("string"), "finish_reason": Value("string")}
    if topk:
        cols["topk_ids"] = List(List(Value("int32")))
        cols["topk_logprobs"] = List(List(Value("float16")))
    return Features(cols)


# ----------------------------------------------------------------------------- settings & inputs

def _settings(c: DictConfig) -> tuple[Sampling, int]:
    """Validate collect.* before anything is loaded or written."""
    try:
        s = Sampling(float(c.temperature), float(c.top_p), int(c.top_k), int(c.max_new_tokens),
                     int(c.samples_per_prompt))
        topk, batch, shard = int(c.topk), int(c.batch_size), int(c.shard_size)
    except (TypeError, ValueError) as e:
        raise PipelineError(f"collect settings must be numbers ({e}): fix conf/collect or the override") from None
    fix = "fix the override or conf/collect/default.yaml"
    checks = [(s.max_new_tokens <= 0, f"collect.max_new_tokens={s.max_new_tokens} must be ≥ 1: {fix}"),
              (s.samples_per_prompt < 1, f"collect.samples_per_prompt={s.samples_per_prompt} must be ≥ 1: {fix}"),
              (s.temperature < 0, f"collect.temperature={s.temperature} must be ≥ 0 (0 = greedy): {fix}"),
              (not 0 < s.top_p <= 1, f"collect.top_p={s.top_p} must be in (0, 1]: {fix}"),
              (s.top_k < 0, f"collect.top_k={s.top_k} must be ≥ 0 (0 = off): {fix}"),
              (topk < 0, f"collect.topk={topk} must be ≥ 0 (0 = no white-box labels): {fix}"),
              (batch < 1, f"collect.batch_size={batch} must be ≥ 1: {fix}"),
              (shard < 1, f"collect.shard_size={shard} must be ≥ 1: {fix}"),
              (s.temperature == 0 and s.samples_per_prompt > 1,
               "collect.temperature=0 (greedy) makes every sample identical: use samples_per_prompt=1 "
               "or a temperature > 0"),
              (c.backend not in ("hf", "vllm"), f"unknown collect.backend={c.backend!r}: use hf or vllm")]
    for bad, message in checks:
        if bad:
            raise PipelineError(message)
    return s, topk


def _load_prompts(cfg: DictConfig) -> dict[str, list[dict]]:
    """Train prompts per domain, in the configured domain order (or file order when domains=null)."""
    from pipeline.prompts import load_split

    domains = cfg.collect.domains
    if isinstance(domains, str):
        domains = [domains]
    domains = list(domains) if domains is not None else None
    if domains is not None and not domains:
        raise PipelineError("collect.domains is empty: list domains to collect or set collect.domains=null for all")
    rows = load_split(cfg.paths.prompts, "train", domains)
    by_domain: dict[str, list[dict]] = {d: [] for d in (domains or [])}
    for row in rows:
        by_domain.setdefault(row["domain"], []).append(row)
    cap = cfg.collect.get("max_prompts_per_domain")  # load_split already refused unknown/empty domains
    return {domain: prompts[:int(cap)] if cap else prompts for domain, prompts in by_domain.items()}


def _sha256_text(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None


def _target_identity(path: Path, tokenizer) -> dict:
    """What makes the data this target's: architecture, weight / tokenizer / template hashes."""
    from pipeline.models import model_identity
    from pipeline.packaged import sha256_of

    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    tok_file = path / "tokenizer.json"
    return {"model": model_identity(path),
            "weights_sha256": {p.name: sha256_of(p) for p in weights},
            "tokenizer_sha256": sha256_of(tok_file) if tok_file.exists() else None,
            "chat_template_sha256": _sha256_text(tokenizer.chat_template),
            "chat_template": tokenizer.chat_template}


def _fingerprint(identity: dict, sampling: Sampling, seed: int, topk: int, backend: str, dtype: str,
                 shard_size: int, prompts: dict[str, list[dict]]) -> str:
    target = {k: v for k, v in identity.items() if k != "model"}
    target["model"] = {k: v for k, v in identity["model"].items() if k != "path"}  # moving a dir is fine
    payload = {"format": FORMAT_VERSION, "target": target, "sampling": asdict(sampling), "seed": seed,
               "topk": topk, "backend": backend, "dtype": dtype, "shard_size": shard_size,
               "prompts": prompts}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from (seed, domain, shard, turn, ...): independent of process and order."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big") >> 1


# ----------------------------------------------------------------------------- shards

def collect_shard(backend, tokenizer, prompts: list[dict], sampling: Sampling, seed: int,
                  progress=None) -> list[dict]:
    """Rows for one shard: every turn of every prompt, samples_per_prompt completions each.

    Turn t+1 of a prompt is conditioned on sample 0's answer to turn t. Each turn is one
    `backend.generate` call seeded from (shard seed, turn).
    """
    answers: dict[str, list[str]] = {p["id"]: [] for p in prompts}
    rows = []
    for turn in range(max(len(p["turns"]) for p in prompts)):
        active = [p for p in prompts if len(p["turns"]) > turn]
        contexts = [encode_chat(tokenizer, messages_for(p, answers[p["id"]], turn))[0].tolist() for p in active]
        items = [(p, ctx, s) for p, ctx in zip(active, contexts) for s in range(sampling.samples_per_prompt)]
        completions = backend.generate([ctx for _, ctx, _ in items], derive_seed(seed, turn), progress)
        for (p, ctx, s), c in zip(items, completions):
            text = tokenizer.decode(c.ids, skip_special_tokens=True)
            if s == 0:
                answers[p["id"]].append(text)
            row = {"id": f"{p['id']}/t{turn}/s{s}", "prompt_id": p["id"], "domain": p["domain"],
                   "turn": turn, "sample": s, "prompt_ids": ctx, "completion_ids": c.ids, "text": text,
                   "finish_reason": c.finish_reason}
            if c.topk_ids is not None:
                row["topk_ids"], row["topk_logprobs"] = c.topk_ids, c.topk_logprobs
            rows.append(row)
    position = {p["id"]: i for i, p in enumerate(prompts)}
    rows.sort(key=lambda r: (position[r["prompt_id"]], r["turn"], r["sample"]))
    return rows


@contextlib.contextmanager
def _quiet_datasets():
    """No "Saving the dataset" bar per shard: the stage has its own progress bar."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _save_shard(final: Path, rows: list[dict], topk: int, meta: dict) -> None:
    from datasets import Dataset

    with atomic_dir(final) as tmp, _quiet_datasets():
        Dataset.from_list(rows, features=features(topk)).save_to_disk(str(tmp / "data"))
        write_json(tmp / "meta.json", meta)


def _plan(prompts: dict[str, list[dict]], shard_size: int) -> list[tuple[str, int, list[dict]]]:
    return [(domain, i // shard_size, rows[i:i + shard_size])
            for domain, rows in prompts.items() for i in range(0, len(rows), shard_size)]


def _shard_name(domain: str, index: int) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in domain)
    return f"{safe}-{hashlib.sha256(domain.encode()).hexdigest()[:6]}-{index:05d}"


def _stop_ids(path: Path, tokenizer) -> list[int]:
    """The chat's stop tokens, the checkpoint's generation_config EOS ids included, without
    loading the weights (every process needs them for the fingerprint)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(str(path)) if (path / "generation_config.json").exists() else None
    return stop_token_ids(tokenizer, SimpleNamespace(generation_config=gen))


def _make_backend(cfg: DictConfig, path: Path, pad_id: int, stop_ids, sampling, topk, state):
    from pipeline.models import load_model, resolve_device

    device, dtype = resolve_device(cfg.get("runtime"))
    if cfg.collect.backend == "vllm":
        from data.collect_vllm import VLLMBackend

        return VLLMBackend(path, sampling, topk, stop_ids, dtype, cfg.collect.get("vllm") or {})
    if device.type == "cuda" and state.num_processes > 1:
        device = state.device  # one GPU per accelerate process
    model = load_model(path, device, dtype)
    if topk > model.config.vocab_size:
        raise PipelineError(f"collect.topk={topk} exceeds the target's vocabulary "
                            f"({model.config.vocab_size}): lower collect.topk")
    from data.collect_hf import HFBackend

    return HFBackend(model, pad_id, stop_ids, sampling, topk, int(cfg.collect.batch_size))


# ----------------------------------------------------------------------------- the stage

def run(cfg: DictConfig, tracker) -> dict:
    from accelerate import PartialState
    from tqdm.auto import tqdm

    from pipeline.models import load_tokenizer, resolve_device, resolve_model

    t0 = time.time()
    c = cfg.collect
    sampling, topk = _settings(c)
    seed = int(c.seed if c.get("seed") is not None else cfg.seed)
    prompts = _load_prompts(cfg)
    device, dtype = resolve_device(cfg.get("runtime"))
    dtype = str(dtype).removeprefix("torch.")
    # Under `accelerate launch` (torch.distributed env vars) this joins the process group; CPU
    # processes need cpu=True to get the gloo backend. A plain run is one process.
    state = PartialState(cpu=device.type == "cpu")
    if c.backend == "vllm" and state.num_processes > 1:
        raise PipelineError("collect.backend=vllm batches and spreads over GPUs itself: run it in one process "
                            "(set collect.vllm.tensor_parallel_size) or use collect.backend=hf under accelerate")
    path = resolve_model(cfg.model.target, "target", cfg.paths)
    tokenizer = load_tokenizer(path)
    stop_ids = _stop_ids(path, tokenizer)
    identity = _target_identity(path, tokenizer) | {"stop_token_ids": stop_ids}
    fingerprint = _fingerprint(identity, sampling, seed, topk, c.backend, dtype, int(c.shard_size), prompts)
    out_dir = Path(cfg.paths.collect)
    shard_dir = out_dir / "shards" / fingerprint
    plan = _plan(prompts, int(c.shard_size))

    def finished(domain, index):
        return (shard_dir / _shard_name(domain, index) / "meta.json").exists()

    mine = [(i, s) for i, s in enumerate(plan)
            if i % state.num_processes == state.process_index and not finished(s[0], s[1])]
    if state.is_main_process:
        done = sum(finished(d, i) for d, i, _ in plan)
        print(f"[collect] {sum(map(len, prompts.values()))} prompts in {len(prompts)} domain(s), {len(plan)} "
              f"shards ({done} already done) under {shard_dir}; {state.num_processes} process(es)")
        stale = sorted(p.name for p in shard_dir.parent.glob("*") if p.name != fingerprint)
        if stale:
            print(f"[collect] ignoring shards of other targets/settings (delete to free disk): {stale}")

    if mine:
        backend = _make_backend(cfg, path, tokenizer.pad_token_id, stop_ids, sampling, topk, state)
        for domain in prompts:
            todo = [(i, s) for i, s in mine if s[0] == domain]
            if not todo:
                continue
            total = sum(len(p["turns"]) for _, s in todo for p in s[2]) * sampling.samples_per_prompt
            with tqdm(total=total, desc=f"collect {domain}", unit="compl", dynamic_ncols=True,
                      disable=not state.is_local_main_process) as bar:
                for i, (_, index, shard_prompts) in todo:
                    t = time.perf_counter()
                    rows = collect_shard(backend, tokenizer, shard_prompts, sampling,
                                         derive_seed(seed, domain, index), bar.update)
                    seconds = time.perf_counter() - t
                    tokens = sum(len(r["completion_ids"]) for r in rows)
                    _save_shard(shard_dir / _shard_name(domain, index), rows, topk,
                                {"domain": domain, "index": index, "rows": len(rows), "tokens": tokens,
                                 "generate_s": seconds, "batch_size": getattr(backend, "batch_size", None),
                                 "process_index": state.process_index})
                    bar.set_postfix(tok_s=f"{tokens / seconds:.1f}")
                    tracker.log_metrics({"collect/shard_tokens_per_s": tokens / seconds}, step=i)

    state.wait_for_everyone()
    if not state.is_main_process:
        return {}
    return _finish(cfg, tracker, plan, shard_dir, fingerprint, identity, sampling, seed, topk, dtype,
                   state.num_processes, t0)


def _finish(cfg, tracker, plan, shard_dir, fingerprint, identity, sampling, seed, topk, dtype,
            num_processes, t0) -> dict:
    """Merge the shards into the final dataset + manifest, both replaced atomically."""
    from datasets import concatenate_datasets, load_from_disk

    parts, metas = [], []
    for domain, index, _ in plan:
        d = shard_dir / _shard_name(domain, index)
        if not (d / "meta.json").exists():
            raise PipelineError(f"shard {d} is missing after generation: rerun stage=collect to finish it")
        parts.append(load_from_disk(str(d / "data")))
        metas.append(json.loads((d / "meta.json").read_text()))
    dataset = concatenate_datasets(parts)
    out_dir = Path(cfg.paths.collect)
    manifest_path = out_dir / "manifest.json"
    with atomic_dir(out_dir / "dataset") as tmp, _quiet_datasets():
        dataset.save_to_disk(str(tmp))
        # The old manifest must not outlive the dataset it describes: the new one is written last.
        manifest_path.unlink(missing_ok=True)
    disk_bytes = sum(f.stat().st_size for f in (out_dir / "dataset").rglob("*") if f.is_file())

    summary = summarize(dataset)
    tokens = sum(s["tokens"] for s in summary.values())
    generate_s = sum(m["generate_s"] for m in metas)  # all shards, whichever run or process made them
    c = cfg.collect
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "target": identity["model"] | {"name": cfg.model.target.get("name"),
                                       "weights_sha256": identity["weights_sha256"]},
        "tokenizer_sha256": identity["tokenizer_sha256"],
        "chat_template_sha256": identity["chat_template_sha256"],
        "chat_template": identity["chat_template"],
        "stop_token_ids": identity["stop_token_ids"],
        "sampling": asdict(sampling),
        "seed": seed,
        "topk": topk,
        "backend": c.backend, "dtype": dtype, "num_processes": num_processes,
        "shard_size": int(c.shard_size), "shards": len(plan),
        "domains": summary,
        "rows": len(dataset),
        "total_tokens": tokens,
        "generate_s": round(generate_s, 3),
        "tokens_per_s": round(tokens / generate_s, 2) if generate_s else None,
        "wall_s": round(time.time() - t0, 3),
        "disk_bytes": disk_bytes,
        "disk_bytes_per_million_tokens": round(disk_bytes / tokens * 1e6) if tokens else None,
        "columns": list(dataset.features),
    }
    write_json(manifest_path, manifest)
    if not c.get("keep_shards", True):
        shutil.rmtree(shard_dir, ignore_errors=True)

    print(format_summary(summary))
    print(f"[collect] {len(dataset)} completions, {tokens} tokens, {manifest['tokens_per_s']} tokens/s "
          f"(generation), {disk_bytes / 1e6:.1f} MB -> {out_dir / 'dataset'}")
    metrics = {"collect/rows": len(dataset), "collect/tokens": tokens, "collect/disk_bytes": disk_bytes}
    if manifest["tokens_per_s"]:
        metrics["collect/tokens_per_s"] = manifest["tokens_per_s"]
    for domain, s in summary.items():
        metrics.update({f"collect/{domain}/{k}": v for k, v in s.items()})
    tracker.log_metrics(metrics)
    tracker.log_artifact(str(manifest_path))
    return {"rows": len(dataset), "tokens": tokens, "tokens_per_s": manifest["tokens_per_s"],
            "dataset": str(out_dir / "dataset"), "manifest": str(manifest_path)}


def summarize(dataset) -> dict[str, dict]:
    """Per-domain counts: prompts, completions, tokens, mean length, share ended by EOS."""
    cols = dataset.select_columns(["prompt_id", "domain", "completion_ids", "finish_reason"])
    per: dict[str, dict] = {}
    for row in cols:
        d = per.setdefault(row["domain"], {"prompts": set(), "completions": 0, "tokens": 0, "eos": 0})
        d["prompts"].add(row["prompt_id"])
        d["completions"] += 1
        d["tokens"] += len(row["completion_ids"])
        d["eos"] += row["finish_reason"] == "eos"
    return {domain: {"prompts": len(d["prompts"]), "completions": d["completions"], "tokens": d["tokens"],
                     "mean_length": round(d["tokens"] / d["completions"], 2),
                     "eos_share": round(d["eos"] / d["completions"], 4)} for domain, d in per.items()}


def format_summary(summary: dict[str, dict]) -> str:
    header = f"{'domain':<16}{'prompts':>9}{'completions':>13}{'tokens':>10}{'mean_len':>10}{'eos_share':>11}"
    lines = [header, "-" * len(header)]
    for domain, s in summary.items():
        lines.append(f"{domain:<16}{s['prompts']:>9}{s['completions']:>13}{s['tokens']:>10}"
                     f"{s['mean_length']:>10.1f}{s['eos_share']:>11.2f}")
    return "\n".join(lines)
