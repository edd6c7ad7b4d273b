"""Collect stage (`python -m pipeline stage=collect`): the target's own generations on the train prompts (same-source
distillation data), sampled with the serving settings in `collect.*`, optionally with white-box labels (a share
answered by the draft instead: data/collect_onpolicy.py). The dataset's columns, the manifest, resume by shard and
the disk cost are the contract in docs/architecture.md ("Collected data").
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from data.collect_onpolicy import draft_identity, label_cost, mark_onpolicy, onpolicy_backend
from data.collect_rows import CollectSettings, collect_shard, features, format_summary, quiet_datasets, summarize
from data.collect_server import server_record, summed_counts
from data.collect_text import read_documents, text_rows, text_shards
from pipeline.atomic import atomic_dir, write_json
from pipeline.modelio.chat import stop_token_ids
from pipeline.control.deadline import would_overrun
from pipeline.errors import PipelineError
from pipeline.sampling import derive_seed

FORMAT_VERSION = 1


def _save_shard(final: Path, rows: list[dict], settings: CollectSettings, meta: dict) -> None:
    from datasets import Dataset

    with atomic_dir(final) as tmp, quiet_datasets():
        if rows:  # a shard whose every request was skipped (collect.backend=server) is its meta.json alone
            columns = features(settings.label_topk, settings.stores_hidden, "origin" in rows[0])
            Dataset.from_list(rows, features=columns).save_to_disk(str(tmp / "data"))
        write_json(tmp / "meta.json", meta)


# ----------------------------------------------------------------------------- the job

@dataclass(frozen=True)
class Shard:
    """Up to shard_size prompts of one domain: the unit of resume and of process splitting."""
    position: int          # in the whole plan: picks the process (position % N) and the MLflow step
    domain: str
    index: int             # within its domain: names the shard and seeds its RNG
    prompts: list[dict]

    @property
    def name(self) -> str:
        """Domain, index and a hash of the shard's own prompts: a shard is reused exactly when its prompts are
        the same, so a larger collect.max_prompts_per_domain keeps every shard already done."""
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in self.domain)
        prompts = hashlib.sha256(json.dumps(self.prompts, sort_keys=True).encode()).hexdigest()[:8]
        return f"{safe}-{hashlib.sha256(self.domain.encode()).hexdigest()[:6]}-{self.index:05d}-{prompts}"


@dataclass
class CollectJob:
    """One collect run: what to generate, with which target, where the shards go, which process this is."""
    cfg: DictConfig
    settings: CollectSettings
    prompts: dict[str, list[dict]]   # per domain, in collect order
    target_path: Path
    tokenizer: Any
    identity: dict                   # the target's hashes and stop_token_ids (see _target_identity)
    device: Any                      # torch.device
    dtype: Any                       # torch.dtype
    fingerprint: str
    plan: list[Shard]
    state: Any                       # accelerate.PartialState: process index and count
    started: float                   # time.time() at the start of the run
    text_plan: list[tuple[str, list[dict]]]  # collect.text's shards: (name, rows to label)

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.paths.collect)

    @property
    def shard_dir(self) -> Path:
        return self.out_dir / "shards" / self.fingerprint

    def finished(self, shard: Shard | str) -> bool:
        return (self.shard_dir / getattr(shard, "name", shard) / "meta.json").exists()


# ----------------------------------------------------------------------------- the stage

def check_settings(cfg: DictConfig) -> None:
    """`collect.*` checked as run() builds them, before any stage runs (targets and prompts: where they load), and
    every file of collect.text read, so a malformed row fails the run before anything is written."""
    read_documents(CollectSettings.from_config(cfg.collect, cfg.seed).text)


def run(cfg: DictConfig, tracker) -> dict:
    started = time.time()
    settings = CollectSettings.from_config(cfg.collect, cfg.seed)
    prompts = _load_prompts(cfg, settings)
    job = _open_job(cfg, settings, prompts, started)
    _announce(job)
    _generate_missing_shards(job, tracker)
    job.state.wait_for_everyone()
    if not job.state.is_main_process:
        return {}
    dataset, shard_metas = _merge_shards(job)
    manifest = _write_dataset_and_manifest(job, dataset, shard_metas)
    if not settings.keep_shards:
        shutil.rmtree(job.shard_dir, ignore_errors=True)
    return _report(job, tracker, manifest)


def _load_prompts(cfg: DictConfig, settings: CollectSettings) -> dict[str, list[dict]]:
    """Train prompts per domain, in the configured domain order (or file order when domains=null)."""
    from pipeline.control.prompts import by_domain, load_split

    rows = load_split(cfg.paths.prompts, "train", settings.domains)  # refuses unknown or empty domains
    return mark_onpolicy(by_domain(rows, settings.max_prompts_per_domain, settings.domains or ()),
                         settings.onpolicy.share, cfg)


def _open_job(cfg: DictConfig, settings: CollectSettings, prompts: dict[str, list[dict]],
              started: float) -> CollectJob:
    """Join the process group, identify the target and fingerprint the run; loads no weights."""
    from accelerate import PartialState

    from pipeline.modelio.models import load_tokenizer, resolve_device, resolve_model

    device, dtype = resolve_device({**(cfg.get("runtime") or {}), "dtype": "float32"})  # the device is enough here
    # Under `accelerate launch` (torch.distributed env vars) this joins the process group; CPU
    # processes need cpu=True to get the gloo backend. A plain run is one process.
    state = PartialState(cpu=device.type == "cpu")
    if settings.backend == "vllm" and state.num_processes > 1:
        raise PipelineError("collect.backend=vllm batches and spreads over GPUs itself: run it in one process "
                            "(set collect.vllm.tensor_parallel_size) or use collect.backend=hf under accelerate")
    target_path = resolve_model(cfg.model.target, "target", cfg.paths)
    if settings.backend != "server":  # a server backend uses only the target's tokenizer and hashes here
        with state.main_process_first():  # runtime.dtype=auto times the target once; the other processes read that
            device, dtype = resolve_device(cfg.get("runtime"), target_path, cfg.paths.models)
    tokenizer = load_tokenizer(target_path)
    identity = _target_identity(target_path, tokenizer)
    if settings.onpolicy.share:
        identity["onpolicy_draft"] = draft_identity(cfg, settings.onpolicy.draft)
    fingerprint = _fingerprint(identity, settings, "served" if settings.backend == "server"
                               else str(dtype).removeprefix("torch."))
    documents = read_documents(settings.text, cfg.paths.prompts if settings.labels_prepared_text else None,
                               tuple(prompts))
    text = text_rows(documents, settings.text, tokenizer, identity["stop_token_ids"])
    return CollectJob(cfg, settings, prompts, target_path, tokenizer, identity, device, dtype, fingerprint,
                      _plan(prompts, settings.shard_size), state, started, text_shards(text, settings.shard_size))


def _target_identity(path: Path, tokenizer) -> dict:
    """What makes the data this target's: architecture, weight / tokenizer / template hashes, and the stop ids (the
    chat's with the checkpoint's generation_config EOS ids, read without loading the weights)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from pipeline.modelio.models import model_identity
    from pipeline.modelio.packaged import sha256_of

    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    tokenizer_file = path / "tokenizer.json"
    generation = GenerationConfig.from_pretrained(str(path)) if (path / "generation_config.json").exists() else None
    return {"model": model_identity(path),
            "weights_sha256": {p.name: sha256_of(p) for p in weights},
            "tokenizer_sha256": sha256_of(tokenizer_file) if tokenizer_file.exists() else None,
            "chat_template_sha256": None if tokenizer.chat_template is None else
            hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
            "chat_template": tokenizer.chat_template,
            "stop_token_ids": stop_token_ids(tokenizer, SimpleNamespace(generation_config=generation))}


def _fingerprint(identity: dict, settings: CollectSettings, dtype: str) -> str:
    """Names the shard directory: any change to how rows are generated starts a fresh one (the prompts hash into each
    shard's own name)."""
    target = identity | {"model": {k: v for k, v in identity["model"].items() if k != "path"}}  # moving a dir is fine
    payload = {"format": FORMAT_VERSION, "target": target, "settings": settings.generation_key(), "dtype": dtype}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _plan(prompts: dict[str, list[dict]], shard_size: int) -> list[Shard]:
    """Shards interleaved across domains, so a time budget that stops the run early cuts every domain alike."""
    chunks = [(domain, start // shard_size, rows[start:start + shard_size])
              for domain, rows in prompts.items() for start in range(0, len(rows), shard_size)]
    order = {domain: i for i, domain in enumerate(prompts)}
    chunks.sort(key=lambda chunk: (chunk[1], order[chunk[0]]))
    return [Shard(position, domain, index, shard_prompts)
            for position, (domain, index, shard_prompts) in enumerate(chunks)]


def _announce(job: CollectJob) -> None:
    if not job.state.is_main_process:
        return
    done = sum(map(job.finished, job.plan))
    print(f"[collect] {sum(map(len, job.prompts.values()))} prompts in {len(job.prompts)} domain(s), "
          f"{len(job.plan)} shards ({done} already done) under {job.shard_dir}; "
          f"{job.state.num_processes} process(es)")
    if job.text_plan:
        rows = sum(len(rows) for _, rows in job.text_plan)
        tokens = sum(len(row["completion_ids"]) for _, rows in job.text_plan for row in rows)
        sources = [*(["the prepared text"] if job.settings.labels_prepared_text else []), *job.settings.text.paths]
        print(f"[collect] text to label: {rows} rows, {tokens} tokens from {sources} in "
              f"{len(job.text_plan)} shards ({sum(job.finished(name) for name, _ in job.text_plan)} already done)")
    stale = sorted(p.name for p in job.shard_dir.parent.glob("*") if p.name != job.fingerprint)
    if stale:
        print(f"[collect] ignoring shards of other targets/settings (delete to free disk): {stale}")


# ----------------------------------------------------------------------------- generation

def _generate_missing_shards(job: CollectJob, tracker) -> None:
    """This process's unfinished shards, text and generated, under one budget (collect.max_minutes, counted from the
    stage's start: labelling text is collect's work too) until the next would end past it (a stopped run resumes
    from the next shard); loads the target (or starts its server) only when there is work."""
    from tqdm.auto import tqdm

    state = job.state
    mine = [shard for shard in job.plan if shard.position % state.num_processes == state.process_index
            and not job.finished(shard)]
    text = [(name, rows) for position, (name, rows) in enumerate(job.text_plan)
            if position % state.num_processes == state.process_index and not job.finished(name)]
    if not mine and not text:
        return
    # Written by a process whose budget stopped it, so the merge knows its missing shards are meant.
    stop_marker = job.shard_dir / f"budget-stopped.{state.process_index}"
    turns = sum(len(prompt["turns"]) for shard in mine for prompt in shard.prompts)
    first_round = max(1, len(job.prompts) // state.num_processes)  # a shard per domain (plan order interleaves them)
    with contextlib.ExitStack() as stack:  # holds a llama-server started for the run (collect.server.launch)
        backend = _make_backend(job, stack)
        onpolicy = onpolicy_backend(job.cfg, job.settings, backend.model, job.tokenizer, job.identity["stop_token_ids"],
                                    job.dtype) if job.settings.onpolicy.share else None
        bar = stack.enter_context(tqdm(total=turns * job.settings.samples_per_prompt, desc="collect", unit="compl",
                                       dynamic_ncols=True, disable=not state.is_local_main_process))
        if hasattr(backend, "show_rates"):  # the server backend shows tokens/s per server
            backend.show_rates = bar.set_postfix_str
        stop_marker.unlink(missing_ok=True)
        queues, spent = {"generated": list(mine), "text": list(text)}, {"generated": 0.0, "text": 0.0}
        for done in itertools.count():
            kind = _next_kind(queues, spent, done < first_round)
            if kind is None:
                return
            # the next shard would end past collect.max_minutes at this run's mean shard time; the first round (a shard
            # per domain) runs, inside the budget where the run is sized to the machine (deadline.sized)
            if would_overrun(job.started, done, job.settings.max_minutes, first_round):
                job.shard_dir.mkdir(parents=True, exist_ok=True)
                stop_marker.write_text(f"{done} shards in {time.time() - job.started:.0f}s\n")
                print(f"[collect] collect.max_minutes={job.settings.max_minutes} would be passed by the next shard: "
                      f"stopping after {done} shards; rerun stage=collect (with a larger budget) to continue")
                return
            item, started = queues[kind].pop(0), time.time()
            if kind == "text":
                _label_text(job, backend, *item)
                bar.set_postfix_str(f"labelled text shard {item[0][:24]}")
            else:
                tokens_per_s = _generate_shard(job, backend, item, bar.update, onpolicy)
                if not hasattr(backend, "show_rates"):
                    bar.set_postfix(domain=item.domain, tok_s=f"{tokens_per_s:.1f}")
                tracker.log_metrics({"collect/shard_tokens_per_s": tokens_per_s}, step=item.position)
            spent[kind] += time.time() - started


def _next_kind(queues: dict[str, list], spent: dict[str, float], first_round: bool) -> str | None:
    """Which source's shard comes next: the generated first round (a shard per domain: the plan interleaves them), then
    the source that has had less time so far. Equal time, not equal shards: a text label costs a prefill, a generated
    one a decode (17.6x fewer tokens per CPU-second, docs/results.md), so on a slow machine a budget that stops the loop
    still leaves the text its half of the time and every domain the target's own rows."""
    waiting = [kind for kind in ("generated", "text") if queues[kind]]
    if not waiting:
        return None
    if first_round and queues["generated"]:
        return "generated"
    return min(waiting, key=lambda kind: spent[kind])


def _make_backend(job: CollectJob, stack: contextlib.ExitStack):
    from pipeline.modelio.models import load_model

    settings = job.settings
    stop_ids = job.identity["stop_token_ids"]
    if settings.backend == "server":
        from data.collect_server import ServerBackend, launch_server

        if settings.server.launch:  # one llama-server on the target's GGUF for this run, stopped with `stack`
            settings = launch_server(job.cfg, settings, job.out_dir / "llama-server.log", stack)
        return ServerBackend.connect(settings, job.tokenizer, stop_ids)
    if settings.backend == "vllm":
        from data.collect_vllm import VLLMBackend

        return VLLMBackend(job.target_path, settings, stop_ids, job.dtype, dict(settings.vllm))
    device = job.device
    if device.type == "cuda" and job.state.num_processes > 1:
        device = job.state.device  # one GPU per accelerate process
    model = load_model(job.target_path, device, job.dtype)
    if settings.topk > model.config.vocab_size:
        raise PipelineError(f"collect.topk={settings.topk} exceeds the target's vocabulary "
                            f"({model.config.vocab_size}): lower collect.topk")
    from data.collect_hf import HFBackend

    return HFBackend(model, job.tokenizer.pad_token_id, stop_ids, settings)


def _generate_shard(job: CollectJob, backend, shard: Shard, progress, onpolicy=None) -> float:
    """Generate one shard and write it atomically; returns its generation speed in tokens/s."""
    start = time.perf_counter()
    rows, spent = collect_shard(backend, job.tokenizer, shard.prompts, job.settings.samples_per_prompt,
                                derive_seed(job.settings.seed, shard.domain, shard.index), progress, onpolicy)
    seconds = time.perf_counter() - start
    tokens = sum(len(row["completion_ids"]) for row in rows)
    meta = {"domain": shard.domain, "index": shard.index, "rows": len(rows), "tokens": tokens,
            "generate_s": seconds, "batch_size": getattr(backend, "batch_size", None),
            "process_index": job.state.process_index, "label_cost": spent}
    if hasattr(backend, "take_stats"):  # the server backend: skipped requests, where the ids came from, which server
        meta.update(backend.take_stats(), server=backend.describe())
    _save_shard(job.shard_dir / shard.name, rows, job.settings, meta)
    return tokens / seconds


def _label_text(job: CollectJob, backend, name: str, rows: list[dict]) -> None:
    """One of collect.text's shards labelled by the target in one forward pass per batch, written atomically with the
    process CPU and wall seconds it cost (the manifest's label cost of origin "text")."""
    from data.collect_hf import label_text_shard

    settings = job.settings
    cpu, wall = time.process_time(), time.perf_counter()
    labelled = label_text_shard(backend.model, job.tokenizer.pad_token_id, rows, settings.topk,
                                settings.stores_hidden, settings.batch_size, job.tokenizer)
    spent = {"text": {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}}
    tokens = sum(len(row["completion_ids"]) for row in rows)
    meta = {"domain": None, "index": None, "rows": len(rows), "tokens": tokens, "generate_s": 0.0,
            "label_s": spent["text"]["wall_s"], "process_index": job.state.process_index, "label_cost": spent}
    _save_shard(job.shard_dir / name, labelled, settings, meta)


# ----------------------------------------------------------------------------- merge, manifest, summary

def _merge_shards(job: CollectJob):
    """The finished shards concatenated in plan order, plus their meta.json records. Unfinished ones are an
    error unless the time budget stopped the run (the manifest then says how far it got)."""
    from datasets import concatenate_datasets, load_from_disk

    parts, metas = [], []
    stopped_by_budget = any(job.shard_dir.glob("budget-stopped.*"))
    for shard in job.plan:
        shard_path = job.shard_dir / shard.name
        if not job.finished(shard) and stopped_by_budget:
            continue
        if not job.finished(shard):
            raise PipelineError(f"shard {shard_path} is missing after generation: rerun stage=collect to finish it")
        metas.append(json.loads((shard_path / "meta.json").read_text()))
        if metas[-1]["rows"]:
            parts.append(load_from_disk(str(shard_path / "data")))
    for name, _ in job.text_plan:
        if not job.finished(name) and stopped_by_budget:
            continue
        if not job.finished(name):
            raise PipelineError(f"text shard {job.shard_dir / name} is missing after labelling: rerun stage=collect "
                                "to finish it")
        metas.append(json.loads((job.shard_dir / name / "meta.json").read_text()))
        parts.append(load_from_disk(str(job.shard_dir / name / "data")))
    if job.text_plan:  # the target's rows say so where a collect without on-policy rows left the column out
        parts = [part if "origin" in part.column_names else part.add_column("origin", ["target"] * len(part))
                 for part in parts]
    if not parts:
        raise PipelineError(f"every request of the collect was skipped ({summed_counts(metas, 'skipped')}): give "
                            "the servers more context (docs/architecture.md, collect from servers) or pass shorter "
                            "prompts")
    return concatenate_datasets(parts), metas


def _write_dataset_and_manifest(job: CollectJob, dataset, shard_metas: list[dict]) -> dict:
    """Replace the dataset, then write the manifest that marks it complete; both atomically."""
    manifest_path = job.out_dir / "manifest.json"
    with atomic_dir(job.out_dir / "dataset") as tmp, quiet_datasets():
        dataset.save_to_disk(str(tmp))
        # The old manifest must not outlive the dataset it describes: the new one is written last.
        manifest_path.unlink(missing_ok=True)
    disk_bytes = sum(f.stat().st_size for f in (job.out_dir / "dataset").rglob("*") if f.is_file())
    manifest = _manifest(job, dataset, shard_metas, disk_bytes)
    write_json(manifest_path, manifest)
    return manifest


def _manifest(job: CollectJob, dataset, shard_metas: list[dict], disk_bytes: int) -> dict:
    identity, settings = job.identity, job.settings
    summary = summarize(dataset)
    tokens = sum(domain["tokens"] for domain in summary.values())
    generate_s = sum(meta["generate_s"] for meta in shard_metas)  # whichever run or process made each shard
    generated = tokens - sum(meta["tokens"] for meta in shard_metas if meta.get("label_s") is not None)  # not text's
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": job.fingerprint,
        "target": identity["model"] | {"name": job.cfg.model.target.get("name"),
                                       "weights_sha256": identity["weights_sha256"]},
        **{key: identity[key] for key in ("tokenizer_sha256", "chat_template_sha256", "chat_template",
                                          "stop_token_ids")},
        "sampling": settings.sampling.to_dict(),
        "max_new_tokens": settings.max_new_tokens,
        "samples_per_prompt": settings.samples_per_prompt,
        "seed": settings.seed,
        "topk": settings.label_topk,
        "hidden_states": settings.stores_hidden,
        "labels": settings.labels_source,
        "backend": settings.backend,
        "dtype": str(job.dtype).removeprefix("torch.") if settings.backend != "server" else None,
        "num_processes": job.state.num_processes,
        "shard_size": settings.shard_size, "shards": len(job.plan),
        "budget": {"max_minutes": settings.max_minutes, "shards_done": len(shard_metas),
                   "stopped_early": len(shard_metas) < len(job.plan) + len(job.text_plan)},
        "domains": summary,
        "rows": len(dataset),
        "total_tokens": tokens,
        "generate_s": round(generate_s, 3),
        "tokens_per_s": round(generated / generate_s, 2) if generate_s else None,
        "wall_s": round(time.time() - job.started, 3),
        "label_cost": label_cost(dataset, shard_metas),
        **({"onpolicy": {"share": settings.onpolicy.share, "draft": settings.onpolicy.draft,
                         "draft_identity": identity["onpolicy_draft"]}} if settings.onpolicy.share else {}),
        **({"text": {"paths": list(settings.text.paths), "prepared": settings.labels_prepared_text,
                     "domain": settings.text.domain,
                     "max_tokens": settings.text.max_tokens, "chunk_tokens": settings.text.chunk_tokens,
                     "shards": len(job.text_plan)}} if job.text_plan else {}),
        "disk_bytes": disk_bytes,
        "disk_bytes_per_million_tokens": round(disk_bytes / tokens * 1e6) if tokens else None,
        "columns": list(dataset.features),
        **(server_record(shard_metas) if settings.backend == "server" else {}),
    }


def _report(job: CollectJob, tracker, manifest: dict) -> dict:
    """Print the per-domain table, log the metrics and the manifest to MLflow; the stage's result."""
    dataset_dir, manifest_path = job.out_dir / "dataset", job.out_dir / "manifest.json"
    rows, tokens, disk_bytes = manifest["rows"], manifest["total_tokens"], manifest["disk_bytes"]
    print(format_summary(manifest["domains"]))
    print(f"[collect] {rows} completions, {tokens} tokens, {manifest['tokens_per_s']} tokens/s "
          f"(generation), {disk_bytes / 1e6:.1f} MB -> {dataset_dir}")
    budget = manifest["budget"]
    if budget["stopped_early"]:
        print(f"[collect] the {budget['max_minutes']}-minute budget stopped the run after {budget['shards_done']} of "
              f"{manifest['shards']} shards (each domain cut alike); rerun stage=collect to continue")
    metrics = {"collect/rows": rows, "collect/tokens": tokens, "collect/disk_bytes": disk_bytes}
    if manifest["tokens_per_s"]:
        metrics["collect/tokens_per_s"] = manifest["tokens_per_s"]
    for domain, counts in manifest["domains"].items():
        metrics.update({f"collect/{domain}/{key}": value for key, value in counts.items()})
    tracker.log_metrics(metrics)
    tracker.log_artifact(str(manifest_path))
    return {"rows": rows, "tokens": tokens, "tokens_per_s": manifest["tokens_per_s"],
            "dataset": str(dataset_dir), "manifest": str(manifest_path)}
