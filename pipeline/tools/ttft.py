"""Time to first token: speculative streams against plain streams on the same prompts, side by side in one run.

    python -m eval.bench_ttft --target artifacts/models/<target> --draft artifacts/draft [--n-prompts 24]

Each prompt (a first user turn of the prompt JSONL, chat template applied) is streamed by plain decoding and by
speculative decoding (the draft's calibrated drafting for its domain, or --gamma), order alternating, --repeats
times after a warm-up; each stream is closed after its first chunk. Prints the mean TTFT of each, their ratio
(speculative / plain) with a paired bootstrap 95% CI over prompts, per domain and overall, and whether every
first token matched (greedy: it must, the first pass is the same plain prefill). Asserts nothing about wall-clock.
"""
import argparse
from pathlib import Path

import numpy as np
import torch

from eval.bench import DEFAULT_PROMPTS
from eval.bench_batch import draft_vocab
from eval.metrics import _speedup_stat, bootstrap_ci
from pipeline.chat import encode_chat
from pipeline.decoding import autoregressive_stream, speculative_stream
from pipeline.errors import PipelineError, one_line_errors
from pipeline.models import load_model, load_tokenizer
from pipeline.prompts import load_prompts
from pipeline.spec import SpeculativeSpec


def first_chunk(stream) -> tuple[list[int], float]:
    chunks = iter(stream)
    chunk = next(chunks)
    stream.close()
    return chunk, stream.stats.ttft


def measure(target, draft, prompts: list[dict], spec, vocab, args) -> dict:
    """{domain: [(plain ttft, speculative ttft) per prompt, averaged over repeats]} and whether tokens matched."""
    times: dict[int, list[list[float]]] = {i: [[], []] for i in range(len(prompts))}
    matched = True
    for repeat in range(args.repeats):
        for i, p in enumerate(prompts):
            drafting = args.gamma or (spec and spec.drafting_for(p["domain"])) or 2  # γ = 2 where calibrated off
            runs = {
                0: lambda: autoregressive_stream(target, p["ids"], max_new_tokens=8),
                1: lambda: speculative_stream(target, draft, p["ids"], drafting=drafting, draft_vocab=vocab,
                                              max_new_tokens=8),
            }
            firsts = {}
            for k in ((0, 1) if (repeat + i) % 2 == 0 else (1, 0)):
                firsts[k], ttft = first_chunk(runs[k]())
                times[i][k].append(ttft)
            matched &= firsts[0] == firsts[1]
    by_domain: dict[str, list] = {}
    for i, p in enumerate(prompts):
        by_domain.setdefault(p["domain"], []).append((np.mean(times[i][0]), np.mean(times[i][1])))
    return {"by_domain": by_domain, "matched": matched}


def report(measured: dict, args) -> str:
    lines = [f"greedy, {args.n_prompts} prompts, repeats={args.repeats}, torch threads={torch.get_num_threads()}",
             f"{'domain':<14} {'n':>3} {'plain TTFT ms':>14} {'spec TTFT ms':>13} {'spec / plain [95% CI]':>26}"]
    groups = {**measured["by_domain"], "overall": [row for rows in measured["by_domain"].values() for row in rows]}
    for name, rows in groups.items():
        plain, spec = (np.array(col, dtype=float) for col in zip(*rows))
        ones = np.ones(len(rows))
        samples = (spec, ones, plain, ones)  # (Σ spec / n) / (Σ plain / n)
        ci = bootstrap_ci(samples, _speedup_stat)
        interval = "[n<2]" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"
        lines.append(f"{name:<14} {len(rows):>3} {1000 * plain.mean():>14.1f} {1000 * spec.mean():>13.1f} "
                     f"{float(_speedup_stat(*samples)):>9.3f} {interval:>16}")
    lines.append(f"first tokens identical: {measured['matched']}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m eval.bench_ttft", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--n-prompts", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gamma", type=int, default=0, help="a fixed γ (0: the draft's calibrated drafting)")
    args = parser.parse_args(argv)
    with one_line_errors("bench_ttft"):
        if args.n_prompts < 2 or args.repeats < 1:
            raise PipelineError("--n-prompts must be >= 2 and --repeats >= 1")
        target, draft = load_model(args.target), load_model(args.draft)
        tokenizer = load_tokenizer(args.target)
        rows = load_prompts(args.prompts)
        rows = rows[::max(1, len(rows) // args.n_prompts)][:args.n_prompts]
        prompts = [{"domain": r["domain"], "ids": encode_chat(tokenizer, [{"role": "user", "content": r["turns"][0]}])}
                   for r in rows]
        spec, vocab = SpeculativeSpec.read(Path(args.draft)), draft_vocab(Path(args.draft))
        first_chunk(autoregressive_stream(target, prompts[0]["ids"], max_new_tokens=2))  # warm-up
        first_chunk(speculative_stream(target, draft, prompts[0]["ids"], drafting=2, draft_vocab=vocab))
        measured = measure(target, draft, prompts, spec, vocab, args)
    print(report(measured, args))


if __name__ == "__main__":
    main()
