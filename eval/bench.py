"""Benchmark the project's decoders against HF `generate` on one machine, in one run.

    python -m eval.bench --target artifacts/models/<target> [--draft <dir>] [--prompts <jsonl>] [--gamma 4]

Prints, greedy and on the same prompts with interleaved repeats after a warm-up: own autoregressive vs HF
`generate` tokens/s; own speculative vs HF assisted generation at the same fixed γ; mean accepted length;
c = mean draft forward / mean target forward time; and where the speculative loop's time goes.
Prints ratios, asserts nothing about wall-clock. Prompts are the first user turns of a prompt JSONL (the
prepare stage's held-out split by default, or Spec-Bench's question.jsonl), spread over the file. Without
--draft, the draft is the target's first --draft-layers layers sharing its embeddings, final norm and head.
"""
import statistics
from pathlib import Path

import torch

from pipeline.engines.hf import assistant_configs, hf_generate
from pipeline.chat import encode_chat, stop_token_ids
from pipeline.decoding import GREEDY, DraftPlan, autoregressive_generate, speculative_generate
from pipeline.errors import OneLineParser, PipelineError, one_line_errors, require_positive
from pipeline.models import derive_draft, load_model, load_tokenizer
from pipeline.prompts import load_prompts
from pipeline.timing import synced_clock

DEFAULT_PROMPTS = Path("artifacts/prompts/eval.jsonl")  # written by `python -m pipeline stage=prepare`


def first_turns(path: Path, n: int) -> list[str]:
    """The first user turn of n prompts spread over the file (Spec-Bench groups its categories in blocks)."""
    if not path.is_file():
        raise PipelineError(f"no prompt file at {path}: run `python -m pipeline stage=prepare` or pass --prompts "
                            "<jsonl>")
    rows = load_prompts(path)
    step = max(1, len(rows) // n)
    return [row["turns"][0] for row in rows[::step]][:n]


def load_pair(args, device: torch.device, dtype: torch.dtype):
    """(target, draft, tokenizer)."""
    target = load_model(args.target, device, dtype)
    tokenizer = load_tokenizer(args.target)
    if args.draft:
        return target, load_model(args.draft, device, dtype), tokenizer
    return target, derive_draft(target, list(range(args.draft_layers))), tokenizer


def make_methods(target, draft, gamma: int, n: int, stop: list[int]) -> dict:
    """{name: fn(input_ids) -> (token ids, DecodeStats | None)}, all greedy."""
    fixed_gamma = assistant_configs(draft, gamma)["fixed"]

    def own(out):
        return out.tokens.tolist(), out.stats

    return {
        "own_ar": lambda ids: own(autoregressive_generate(target, ids, max_new_tokens=n, eos_token_id=stop)),
        "hf_generate": lambda ids: hf_generate(target, ids, n, GREEDY, stop),
        "own_speculative": lambda ids: own(speculative_generate(target, draft, ids, plan=DraftPlan(gamma),
                                                                max_new_tokens=n, eos_token_id=stop)),
        "hf_assisted": lambda ids: hf_generate(target, ids, n, GREEDY, stop, draft, fixed_gamma),
    }


def time_methods(methods: dict, prompts: list[torch.Tensor], repeats: int, clock) -> dict:
    """Seconds, tokens, first outputs and DecodeStats per method over interleaved repeats."""
    runs = {name: {"time": 0.0, "tokens": 0, "outputs": {}, "stats": []} for name in methods}
    for repeat in range(repeats):
        for i, ids in enumerate(prompts):
            # Interleaved, order alternating, so drift in machine load hits all methods alike.
            order = list(methods) if (repeat + i) % 2 == 0 else list(reversed(methods))
            for name in order:
                start = clock()
                tokens, stats = methods[name](ids)
                run = runs[name]
                run["time"] += clock() - start
                run["tokens"] += len(tokens)
                run["outputs"].setdefault(i, tokens)
                if stats is not None:
                    run["stats"].append(stats)
    return runs


def loop_profile(spec_stats: list) -> dict:
    """Share of the speculative loop's time per part."""
    parts = {"draft forwards": sum(t for s in spec_stats for t in s.draft_times),
             "target verify": sum(t for s in spec_stats for t in s.target_times),
             "sampling/accept": sum(s.sampling_time for s in spec_stats),
             "cache ops": sum(s.cache_time for s in spec_stats),
             "prefill": sum(s.prefill_time for s in spec_stats)}
    total = sum(s.total_time for s in spec_stats)
    parts["other python"] = total - sum(parts.values())
    return {part: seconds / total for part, seconds in parts.items()}


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    texts = first_turns(args.prompts, args.n_prompts)
    target, draft, tokenizer = load_pair(args, device, dtype)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}]).to(device) for text in texts]
    methods = make_methods(target, draft, args.gamma, args.max_new_tokens, stop_token_ids(tokenizer, target))
    for fn in methods.values():  # warm-up: allocator, kernels and lazy imports out of the timed runs
        fn(prompts[0][:, :8])
    runs = time_methods(methods, prompts, args.repeats, synced_clock(device))

    tok_s = {name: r["tokens"] / r["time"] for name, r in runs.items()}
    reference = runs["own_ar"]["outputs"]
    greedy_match = {name: statistics.mean(r["outputs"][i] == reference[i] for i in range(len(prompts)))
                    for name, r in runs.items()}
    spec_stats, ar_stats = runs["own_speculative"]["stats"], runs["own_ar"]["stats"]
    draft_s = statistics.mean(t for s in spec_stats for t in s.draft_times)
    verify_s = statistics.mean(t for s in spec_stats for t in s.target_times)
    ar_step_s = statistics.mean(t for s in ar_stats for t in s.target_times)
    return {
        "device": str(device), "dtype": args.dtype, "gamma": args.gamma, "max_new_tokens": args.max_new_tokens,
        "n_prompts": len(prompts), "repeats": args.repeats, "tokens_per_s": tok_s, "greedy_match": greedy_match,
        "ar_vs_hf_generate": tok_s["own_ar"] / tok_s["hf_generate"],
        "speculative_vs_hf_assisted": tok_s["own_speculative"] / tok_s["hf_assisted"],
        "speculative_speedup_vs_own_ar": tok_s["own_speculative"] / tok_s["own_ar"],
        "mean_accepted_length": sum(s.n_generated for s in spec_stats) / sum(s.target_passes for s in spec_stats),
        "acceptance_rate": sum(s.n_accepted for s in spec_stats) / max(1, sum(s.n_drafted for s in spec_stats)),
        # Same names as eval/metrics.py: c against a single-token target step (Leviathan et al. 2023,
        # Thm 3.8), c_verify against the γ+1-token verify pass the speculative loop actually runs.
        "c": draft_s / ar_step_s, "c_verify": draft_s / verify_s,
        "loop_profile_share": loop_profile(spec_stats),
    }


def report(r: dict) -> str:
    t = r["tokens_per_s"]
    lines = [f"device={r['device']} dtype={r['dtype']} gamma={r['gamma']} max_new_tokens={r['max_new_tokens']} "
             f"prompts={r['n_prompts']} x repeats={r['repeats']} (greedy)",
             f"{'method':<16}{'tok/s':>9}{'greedy==own_ar':>16}"]
    lines += [f"{m:<16}{t[m]:>9.2f}{r['greedy_match'][m]:>16.2f}" for m in t]
    lines += [f"own AR / HF generate         = {r['ar_vs_hf_generate']:.3f}",
              f"own spec / HF assisted       = {r['speculative_vs_hf_assisted']:.3f}",
              f"own spec / own AR (speedup)  = {r['speculative_speedup_vs_own_ar']:.3f}",
              f"mean accepted length         = {r['mean_accepted_length']:.3f}",
              f"acceptance rate              = {r['acceptance_rate']:.3f}",
              f"c (draft fwd / 1-token target fwd)     = {r['c']:.3f}",
              f"c_verify (draft fwd / verify fwd)      = {r['c_verify']:.3f}",
              "speculative loop time:"]
    lines += [f"  {k:<16}{v:>7.1%}" for k, v in r["loop_profile_share"].items()]
    return "\n".join(lines)


def check_args(args) -> None:
    """Bad input as one-line PipelineErrors before any model is loaded (and before anything is written)."""
    for name in ("target", "draft"):
        path = getattr(args, name)
        if path is not None and not (Path(path) / "config.json").is_file():
            raise PipelineError(f"--{name} {path} is not an HF model directory (no config.json): pass a directory "
                                "the pipeline exported or converted, e.g. artifacts/models/<target>")
    require_positive(args, "draft_layers", "n_prompts", "max_new_tokens", "gamma", "repeats")
    if args.threads < 0:
        raise PipelineError(f"--threads {args.threads} is negative: pass 0 (torch's default) or a thread count")
    if args.device is not None and args.device.split(":")[0] not in ("cpu", "cuda"):
        raise PipelineError(f"--device {args.device} is not cpu or cuda")
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise PipelineError(f"--device {args.device}: no CUDA device here; use --device cpu")
    if args.json is not None and args.json.is_dir():
        raise PipelineError(f"--json {args.json} is a directory: pass a file path")


def main(argv=None):
    from pipeline.atomic import write_json

    parser = OneLineParser(prog="python -m eval.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF model directory of the target")
    parser.add_argument("--draft", help="HF model directory of the draft (default: target's first layers)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                        help=f"prompt JSONL, our schema or Spec-Bench's (default: {DEFAULT_PROMPTS})")
    parser.add_argument("--n-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file (atomically)")
    args = parser.parse_args(argv)
    with one_line_errors("bench"):
        check_args(args)
        result = run(args)
    print(report(result))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
