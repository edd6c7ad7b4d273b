"""Collect throughput: generated tokens/s at batch 1 vs the configured batch, same prompts, same run.

    python -m data.bench_collect [--prompts 16] [--max-new-tokens 128] [hydra overrides ...]
    e.g. python -m data.bench_collect collect.batch_size=32 runtime.device=cuda
    python -m data.bench_collect --server [--server-parallel 4] --prompts 64 collect.topk=0 runtime.threads=2

--server: the HF backend at collect.batch_size against collect.backend=server on a llama-server this script
starts on the target's GGUF (pipeline/engines/llamacpp.py; `--server-parallel` slots, as many requests in
flight), the same prompts and sampling settings, the same thread count (runtime.threads, else every core). The
prompts are cut into chunks of collect.batch_size, measured alternately HF then server; the ratio of target
tokens/s (server / HF) gets a 95% bootstrap interval over the chunks.

Runs the collect stage's own HF backend on the configured target (default: the embedded
SmolLM2-135M-Instruct) with the configured sampling settings and top-k labels, then measures the
disk cost of the rows with and without the top-k columns (bytes per million completion tokens).
Prompts: first turns of the prepared train prompts, or of any prompt file (`--prompts-file`, e.g.
Spec-Bench's question.jsonl, whose MT-Bench categories are then used). On a shared CPU pass runtime.threads=1: oversubscribed
OpenMP threads make batch 1 several times slower and the comparison meaningless.
"""
from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent


MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


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


def fail(message: str) -> None:
    sys.stderr.write(f"[bench] error: {message}\n")
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    from pipeline.errors import OneLineParser, PipelineError

    parser = OneLineParser(prog="python -m data.bench_collect", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per measurement (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts-file", help="a prompt JSONL (our schema or Spec-Bench's question.jsonl); "
                        "default: the prepared train prompts")
    parser.add_argument("--domains", default=",".join(MT_BENCH),
                        help="domains to draw prompts from, all when none match (default: Spec-Bench's MT-Bench ones)")
    parser.add_argument("--server", action="store_true",
                        help="the HF backend against llama-server on the target's GGUF, side by side")
    parser.add_argument("--server-parallel", type=int, default=1,
                        help="llama-server slots (-np) and requests in flight (default 1: reproducible rows)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. collect.batch_size=32")
    args = parser.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "server_parallel"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} is not an integer >= 1")
    if args.prompts_file and not Path(args.prompts_file).is_file():
        fail(f"--prompts-file {args.prompts_file} is not a file: pass a prompt JSONL")
    try:
        cfg, settings = load_settings(args.overrides, args.max_new_tokens)
        prompts = bench_prompts(cfg, args.prompts, args.domains.split(","), args.prompts_file)
        if not prompts:
            raise PipelineError("no prompts to measure on: pass --prompts-file <jsonl> or run "
                                "`python -m pipeline stage=prepare`")
        target = load_target(cfg)
    except PipelineError as e:
        fail(str(e))
    print(f"[bench] {target.path.name} on {target.device} ({str(target.dtype).removeprefix('torch.')}), "
          f"{torch.get_num_threads()} threads; {len(prompts)} prompts, max_new_tokens={settings.max_new_tokens}, "
          f"temperature={settings.sampling.temperature}, topk={settings.topk}")
    if args.server:
        try:
            measure_server_vs_hf(cfg, target, settings, prompts, args.server_parallel)
        except PipelineError as e:
            fail(str(e))
        return
    rows = measure_batching(target, settings, prompts)
    report_disk(rows, settings.topk)


def load_settings(overrides: list[str], max_new_tokens: int):
    """The composed config and its collect settings, one sample per prompt at the bench's length."""
    from hydra import compose, initialize_config_dir

    from data.collect_rows import CollectSettings

    from pipeline.errors import PipelineError

    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    except Exception as e:  # Hydra's override / composition errors: one line, as python -m pipeline gives them
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise PipelineError(f"bad configuration: {first.strip()}") from None
    if cfg.runtime.get("threads"):
        torch.set_num_threads(int(cfg.runtime.threads))
    settings = replace(CollectSettings.from_config(cfg.collect, cfg.seed), max_new_tokens=max_new_tokens,
                       samples_per_prompt=1)
    return cfg, settings


def load_target(cfg) -> SimpleNamespace:
    from data.collect import _stop_ids
    from pipeline.models import load_model, load_tokenizer, resolve_device, resolve_model

    device, dtype = resolve_device(cfg.runtime)
    path = resolve_model(cfg.model.target, "target", cfg.paths)
    model, tokenizer = load_model(path, device, dtype), load_tokenizer(path)
    return SimpleNamespace(path=path, device=device, dtype=dtype, model=model, tokenizer=tokenizer,
                           stop_ids=_stop_ids(path, tokenizer))


def measure_batching(target, settings, prompts: list[dict]) -> list[dict]:
    """Tokens/s at batch 1 and at collect.batch_size on the same prompts; the rows of the last run."""
    from data.collect_rows import collect_shard
    from data.collect_hf import HFBackend
    from pipeline.chat import encode_chat, messages_for

    lengths = [len(encode_chat(target.tokenizer, messages_for(p, [], 0))[0]) for p in prompts]
    print(f"[bench] prompt tokens: min {min(lengths)}, median {sorted(lengths)[len(lengths) // 2]}, "
          f"max {max(lengths)}")
    results = {}
    for batch_size in dict.fromkeys([1, settings.batch_size]):
        backend = HFBackend(target.model, target.tokenizer.pad_token_id, target.stop_ids,
                            replace(settings, batch_size=batch_size))
        collect_shard(backend, target.tokenizer, prompts[:1], 1, seed=0)  # warm-up
        start = time.perf_counter()
        rows = collect_shard(backend, target.tokenizer, prompts, 1, seed=0)
        seconds = time.perf_counter() - start
        tokens = sum(len(r["completion_ids"]) for r in rows)
        results[batch_size] = (tokens, seconds, rows)
        sizes = [len(b) for b in backend._batches(lengths)]
        print(f"[bench] batch {backend.batch_size:>3}: {tokens:>6} tokens in {seconds:7.1f}s = "
              f"{tokens / seconds:8.1f} tokens/s" + (f"  (length-sorted batches of {sizes})" if batch_size > 1 else ""))
    (t1, s1, _), (tb, sb, rows) = results[1], results[max(results)]
    print(f"[bench] speed-up from batching: {(tb / sb) / (t1 / s1):.2f}x")
    return rows


def measure_server_vs_hf(cfg, target, settings, prompts: list[dict], parallel: int) -> None:
    """Target tokens/s of the HF backend and of llama-server on the same prompt chunks, alternately; the ratio
    with its bootstrap interval over the chunks."""
    import os

    import numpy as np
    from omegaconf import OmegaConf

    from data.collect_hf import HFBackend
    from data.collect_rows import collect_shard
    from data.collect_server import ServerBackend
    from pipeline.engines import llamacpp
    from pipeline.errors import PipelineError
    from pipeline.models import model_gguf

    gguf = model_gguf(cfg.model.target, "target", cfg.paths)
    if gguf is None:
        raise PipelineError("--server needs the target as a GGUF file (a packaged preset or model.target.path=*.gguf)")
    root = llamacpp.build(cfg.paths.engines, str(cfg.engines.llamacpp.version))
    threads = int(cfg.runtime.threads or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    size = settings.batch_size
    chunks = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    hf = HFBackend(target.model, target.tokenizer.pad_token_id, target.stop_ids, settings)
    measured = {"hf": ([], []), "server": ([], [])}  # tokens, seconds per chunk
    with tempfile.TemporaryDirectory() as tmp, \
            llamacpp.Server(root, gguf, threads=threads, context=int(cfg.engines.llamacpp.context) * parallel,
                            log_path=Path(tmp) / "server.log", parallel=parallel) as server:
        options = {**OmegaConf.to_container(cfg.collect.server, resolve=True), "urls": [server.url], "launch": False,
                   "model": None, "endpoint": "completions", "concurrency": parallel, "logprobs": False}
        served = replace(settings, backend="server", topk=0, server=options)
        backends = {"hf": hf, "server": ServerBackend.connect(served, target.tokenizer, target.stop_ids)}
        print(f"[bench] HF batch {size} vs llama-server {gguf.name} ({parallel} slot(s), {parallel} in flight), "
              f"{threads} threads each; {len(chunks)} chunks of {size} prompts, alternately")
        for backend in backends.values():
            collect_shard(backend, target.tokenizer, prompts[:1], 1, seed=0)  # warm-up
        for c, chunk in enumerate(chunks):
            for name, backend in backends.items():
                start = time.perf_counter()
                rows = collect_shard(backend, target.tokenizer, chunk, 1, seed=c)
                measured[name][1].append(time.perf_counter() - start)
                measured[name][0].append(sum(len(r["completion_ids"]) for r in rows))
    rate = {name: sum(tokens) / sum(seconds) for name, (tokens, seconds) in measured.items()}
    for name, (tokens, seconds) in measured.items():
        print(f"[bench] {name:>6}: {sum(tokens):>6} tokens in {sum(seconds):7.1f}s = {rate[name]:8.1f} tokens/s")

    ci = ratio_ci(*(np.array(x, dtype=float) for x in (*measured["server"], *measured["hf"])))
    interval = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "(one chunk: no interval)"
    print(f"[bench] server / HF target tokens/s: {rate['server'] / rate['hf']:.2f}x, 95% CI {interval}")


def ratio_ci(tok_a, sec_a, tok_b, sec_b, resamples: int = 10_000, seed: int = 0) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of (Σ tok_a / Σ sec_a) / (Σ tok_b / Σ sec_b) over paired chunks: each
    resample draws the same chunks for both backends, so the prompts they share cancel in the ratio."""
    import numpy as np

    if len(tok_a) < 2:
        return None
    draw = np.random.default_rng(seed).integers(0, len(tok_a), (resamples, len(tok_a)))
    ratios = (tok_a[draw].sum(1) / sec_a[draw].sum(1)) / (tok_b[draw].sum(1) / sec_b[draw].sum(1))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def report_disk(rows: list[dict], topk: int) -> None:
    tokens = sum(len(r["completion_ids"]) for r in rows)
    base = disk_bytes(rows, 0)
    print(f"[bench] disk without labels: {base / tokens:6.1f} bytes per completion token (prompt_ids included)")
    if topk:
        labelled = disk_bytes(rows, topk)
        print(f"[bench] disk with topk={topk}: {labelled / tokens:6.1f} bytes per completion token; the labels "
              f"add {(labelled - base) / tokens:.1f} B/token = {(labelled - base) / tokens:.0f} MB per million tokens")


if __name__ == "__main__":
    main()
