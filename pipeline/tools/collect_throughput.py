"""Collect throughput: target tokens/s of the collect stage's HF backend at batch 1 against collect.batch_size
(tool.server=true: against llama-server on the target's GGUF, `tool.server_parallel` slots), on the same prompt
chunks in eval's rotating order, the ratio with a paired 95% bootstrap interval over the chunks, then the disk cost
of the rows with and without the top-k columns.

    python -m pipeline.tools collect-throughput [tool.prompts=16 tool.max_new_tokens=128] [hydra overrides]

On a shared CPU pass runtime.threads=1: oversubscribed OpenMP threads make batch 1 several times slower.
"""
from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from eval.intervals import paired_ratio
from pipeline.errors import PipelineError
from pipeline.timing import synced_clock
from pipeline.tools.common import measure

def bench_prompts(cfg, n: int, domains: list[str], prompts_file: str | None = None) -> list[dict]:
    """First turns of `n` prompts of the given domains (all when none match), spread evenly over them."""
    from pipeline.prompts import load_prompts, load_split

    source = load_prompts(prompts_file) if prompts_file else load_split(cfg.paths.prompts, "train")
    rows = [dict(r, turns=r["turns"][:1]) for r in source]
    rows = [r for r in rows if r["domain"] in domains] or rows
    return rows[::max(1, len(rows) // n)][:n]


def disk_bytes(rows: list[dict], topk: int) -> int:
    from datasets import Dataset

    from data.collect_rows import features, quiet_datasets

    keep = list(features(topk))
    with tempfile.TemporaryDirectory() as tmp, quiet_datasets():
        Dataset.from_list([{k: r[k] for k in keep} for r in rows], features=features(topk)).save_to_disk(tmp)
        return sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())


def run(cfg) -> dict:
    tool = cfg.tool
    for key in ("prompts", "max_new_tokens", "server_parallel"):
        if tool[key] < 1:
            raise PipelineError(f"tool.{key}={tool[key]} is not an integer >= 1")
    if tool.prompts_file and not Path(tool.prompts_file).is_file():
        raise PipelineError(f"tool.prompts_file={tool.prompts_file} is not a file: pass a prompt JSONL")
    settings = collect_settings(cfg, tool.max_new_tokens)
    if settings.batch_size == 1 and not tool.server:
        raise PipelineError("collect.batch_size=1: batching is compared with batch 1, set a larger collect.batch_size")
    prompts = bench_prompts(cfg, tool.prompts, list(tool.domains), tool.prompts_file)
    if not prompts:
        raise PipelineError("no prompts to measure on: pass tool.prompts_file=<jsonl> or run "
                            "`python -m pipeline stage=prepare`")
    target = load_target(cfg)
    print(f"[collect-throughput] {target.path.name} on {target.device} ({str(target.dtype).removeprefix('torch.')}), "
          f"{torch.get_num_threads()} threads; {len(prompts)} prompts, max_new_tokens={settings.max_new_tokens}, "
          f"temperature={settings.sampling.temperature}, topk={settings.topk}")
    if tool.server:
        return measure_server_vs_hf(cfg, target, settings, prompts, tool.server_parallel)
    result, rows = measure_batching(target, settings, prompts)
    report_disk(rows, settings.topk)
    return result


def collect_settings(cfg, max_new_tokens: int):
    """The composed config's collect settings, one sample per prompt at the tool's length."""
    from data.collect_rows import CollectSettings

    return replace(CollectSettings.from_config(cfg.collect, cfg.seed), max_new_tokens=max_new_tokens,
                   samples_per_prompt=1)


def load_target(cfg) -> SimpleNamespace:
    from data.collect import _stop_ids
    from pipeline.models import load_model, load_tokenizer, resolve_device, resolve_model

    device, dtype = resolve_device(cfg.runtime)
    path = resolve_model(cfg.model.target, "target", cfg.paths)
    model, tokenizer = load_model(path, device, dtype), load_tokenizer(path)
    return SimpleNamespace(path=path, device=device, dtype=dtype, model=model, tokenizer=tokenizer,
                           stop_ids=_stop_ids(path, tokenizer))


def backend_method(backend, tokenizer):
    """A collect backend as eval's harness calls a method: fn(prompts, domain, n, seed) -> (tokens, rows)."""
    from data.collect_rows import collect_shard

    def fn(chunk, _domain, n, seed):  # a backend's length is its settings': the harness's 1-token warm-up is one prompt
        rows = collect_shard(backend, tokenizer, chunk if n > 1 else chunk[:1], 1, seed=seed)
        return [t for r in rows for t in r["completion_ids"]], rows
    return fn


def compare(methods: dict, prompts: list[dict], size: int, n: int, device) -> tuple[dict, list[dict]]:
    """Target tokens/s of the two methods on the same chunks of `size` prompts and the ratio second / first with its
    paired bootstrap interval over the chunks; the rows of the second's runs."""
    chunks = [{"ids": prompts[i:i + size], "domain": "all", "seed": c}
              for c, i in enumerate(range(0, len(prompts), size))]
    records = measure(methods, chunks, n, synced_clock(device), warmup_tokens=1)
    (first, tok_a, sec_a), (second, tok_b, sec_b) = (
        (name, np.array([len(r["tokens"]) for r in recs], float), np.array([r["time_s"] for r in recs]))
        for name, recs in records.items())
    result = {name: {"tokens": int(tok.sum()), "seconds": float(sec.sum()), "tokens_per_s": float(tok.sum() / sec.sum())}
              for name, tok, sec in ((first, tok_a, sec_a), (second, tok_b, sec_b))}
    ratio, ci = paired_ratio((tok_b, sec_b, tok_a, sec_a))
    result |= {"ratio": ratio, "ratio_ci95": ci, "chunks": len(chunks)}
    for name in (first, second):
        r = result[name]
        print(f"[collect-throughput] {name:>8}: {r['tokens']:>6} tokens in {r['seconds']:7.1f}s = "
              f"{r['tokens_per_s']:8.1f} tokens/s")
    ci = result["ratio_ci95"]
    interval = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "(one chunk: no interval)"
    print(f"[collect-throughput] {second} / {first} target tokens/s: {result['ratio']:.2f}x, 95% CI {interval}")
    return result, [row for r in records[second] for row in r["stats"]]


def measure_batching(target, settings, prompts: list[dict]) -> tuple[dict, list[dict]]:
    """Tokens/s at batch 1 and at collect.batch_size on the same chunks of collect.batch_size prompts."""
    from data.collect_hf import HFBackend

    methods = {f"batch {size}": backend_method(HFBackend(target.model, target.tokenizer.pad_token_id, target.stop_ids,
                                                         replace(settings, batch_size=size)), target.tokenizer)
               for size in (1, settings.batch_size)}
    return compare(methods, prompts, settings.batch_size, settings.max_new_tokens, target.device)


def measure_server_vs_hf(cfg, target, settings, prompts: list[dict], parallel: int) -> dict:
    """Target tokens/s of the HF backend and of llama-server on the same prompt chunks."""
    import os

    from omegaconf import OmegaConf

    from data.collect_hf import HFBackend
    from data.collect_server import ServerBackend
    from pipeline.engines import llamacpp
    from pipeline.models import model_gguf

    gguf = model_gguf(cfg.model.target, "target", cfg.paths)
    if gguf is None:
        raise PipelineError("tool.server=true needs the target as a GGUF file (a packaged preset or "
                            "model.target.path=*.gguf)")
    root = llamacpp.build(cfg.paths.engines, str(cfg.engines.llamacpp.version))
    threads = int(cfg.runtime.threads or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    hf = HFBackend(target.model, target.tokenizer.pad_token_id, target.stop_ids, settings)
    with tempfile.TemporaryDirectory() as tmp, \
            llamacpp.Server(root, gguf, threads=threads, context=int(cfg.engines.llamacpp.context) * parallel,
                            log_path=Path(tmp) / "server.log", parallel=parallel) as server:
        options = {**OmegaConf.to_container(cfg.collect.server, resolve=True), "urls": [server.url], "launch": False,
                   "model": None, "endpoint": "completions", "concurrency": parallel, "logprobs": False}
        served = replace(settings, backend="server", topk=0, server=options)
        server_backend = ServerBackend.connect(served, target.tokenizer, target.stop_ids)
        print(f"[collect-throughput] HF batch {settings.batch_size} vs llama-server {gguf.name} ({parallel} slot(s)), "
              f"{threads} threads each")
        methods = {"hf": backend_method(hf, target.tokenizer), "server": backend_method(server_backend, target.tokenizer)}
        return compare(methods, prompts, settings.batch_size, settings.max_new_tokens, target.device)[0]


def report_disk(rows: list[dict], topk: int) -> None:
    tokens = sum(len(r["completion_ids"]) for r in rows)
    base = disk_bytes(rows, 0)
    print(f"[collect-throughput] disk without labels: {base / tokens:6.1f} bytes per completion token (prompt_ids included)")
    if topk:
        labelled = disk_bytes(rows, topk)
        print(f"[collect-throughput] disk with topk={topk}: {labelled / tokens:6.1f} bytes per completion token; the labels "
              f"add {(labelled - base) / tokens:.1f} B/token = {(labelled - base) / tokens:.0f} MB per million tokens")

