"""Benchmark the project's decoders against HF `generate` on one machine, in one run.

    python -m eval.bench --target artifacts/models/<target> [--draft <dir>] [--gamma 4] [--max-new-tokens 64]

Prints, greedy and on the same prompts with interleaved repeats after a warm-up: own autoregressive vs HF
`generate` tokens/s; own speculative vs HF assisted generation at the same fixed γ; mean accepted length;
c = mean draft forward / mean target forward time; and where the speculative loop's time goes.
Prints ratios, asserts nothing about wall-clock. Without --draft, the draft is the target's first
--draft-layers layers sharing its embeddings, final norm and head.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eval.speculative import autoregressive_generate, speculative_generate
from pipeline.models import derive_draft

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "spec-bench" / "question.jsonl"
FALLBACK_PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.",
                    "Give three tips for learning to cook.", "What causes the seasons on Earth?"]


def load_prompts(path: Path | None, n: int) -> list[str]:
    if path is not None and path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        # Spread over the file: Spec-Bench groups its 13 categories in blocks.
        step = max(1, len(rows) // n)
        return [rows[i]["turns"][0] for i in range(0, len(rows), step)][:n]
    return FALLBACK_PROMPTS[:n]


def encode(tokenizer, prompt: str, device) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(target, ids, max_new_tokens, eos, assistant=None):
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=eos,
                              pad_token_id=eos[0], assistant_model=assistant)
    return out[0, ids.shape[1]:].cpu()


def set_fixed_gamma(draft, gamma: int) -> None:
    """HF assisted generation reads these from the assistant's generation_config (candidate_generator.py):
    a constant schedule, and threshold 0 disables the confidence early stop, so γ is fixed like ours."""
    draft.generation_config.num_assistant_tokens = gamma
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads) if args.threads else None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.draft:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(device).eval()
    else:
        draft = derive_draft(target, list(range(args.draft_layers)))
    set_fixed_gamma(draft, args.gamma)
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    prompts = [encode(tokenizer, p, device) for p in load_prompts(args.prompts, args.n_prompts)]
    n = args.max_new_tokens

    methods = {
        "own_ar": lambda ids: autoregressive_generate(target, ids, n, temperature=0, eos_token_id=eos),
        "hf_generate": lambda ids: hf_generate(target, ids, n, eos),
        "own_speculative": lambda ids: speculative_generate(target, draft, ids, n, gamma=args.gamma,
                                                            temperature=0, eos_token_id=eos),
        "hf_assisted": lambda ids: hf_generate(target, ids, n, eos, assistant=draft),
    }
    for fn in methods.values():  # warm-up: allocator, kernels and lazy imports out of the timed runs
        fn(prompts[0][:, :8])
    times = {m: 0.0 for m in methods}
    tokens = {m: 0 for m in methods}
    outputs, spec_stats, ar_stats = {}, [], []
    for repeat in range(args.repeats):
        for i, ids in enumerate(prompts):
            # Interleaved, order alternating, so drift in machine load hits all methods alike.
            order = list(methods) if (repeat + i) % 2 == 0 else list(reversed(methods))
            for name in order:
                fn = methods[name]
                _sync(device)
                t0 = time.perf_counter()
                result = fn(ids)
                _sync(device)
                times[name] += time.perf_counter() - t0
                ids_out = result if isinstance(result, torch.Tensor) else result.tokens
                tokens[name] += len(ids_out)
                outputs.setdefault((name, i), ids_out.tolist())
                if name == "own_speculative":
                    spec_stats.append(result.stats)
                elif name == "own_ar":
                    ar_stats.append(result.stats)
    tok_s = {m: tokens[m] / times[m] for m in methods}
    greedy_match = {m: statistics.mean(outputs[(m, i)] == outputs[("own_ar", i)] for i in range(len(prompts)))
                    for m in methods}

    draft_times = [t for s in spec_stats for t in s.draft_times]
    verify_times = [t for s in spec_stats for t in s.target_times]
    ar_times = [t for s in ar_stats for t in s.target_times]
    parts = {"draft forwards": sum(draft_times), "target verify": sum(verify_times),
             "sampling/accept": sum(s.sampling_time for s in spec_stats),
             "cache ops": sum(s.cache_time for s in spec_stats),
             "prefill": sum(s.prefill_time for s in spec_stats)}
    total = sum(s.total_time for s in spec_stats)
    parts["other python"] = total - sum(parts.values())
    return {
        "device": str(device), "dtype": args.dtype, "gamma": args.gamma, "max_new_tokens": n,
        "n_prompts": len(prompts), "repeats": args.repeats, "tokens_per_s": tok_s, "greedy_match": greedy_match,
        "ar_vs_hf_generate": tok_s["own_ar"] / tok_s["hf_generate"],
        "speculative_vs_hf_assisted": tok_s["own_speculative"] / tok_s["hf_assisted"],
        "speculative_speedup_vs_own_ar": tok_s["own_speculative"] / tok_s["own_ar"],
        "mean_accepted_length": sum(s.n_generated for s in spec_stats) / sum(s.target_passes for s in spec_stats),
        "acceptance_rate": sum(s.n_accepted for s in spec_stats) / max(1, sum(s.n_drafted for s in spec_stats)),
        # Same names as eval/metrics.py: c against a single-token target step (Leviathan et al. 2023,
        # Thm 3.8), c_verify against the γ+1-token verify pass the speculative loop actually runs.
        "c": statistics.mean(draft_times) / statistics.mean(ar_times),
        "c_verify": statistics.mean(draft_times) / statistics.mean(verify_times),
        "loop_profile_share": {k: v / total for k, v in parts.items()},
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF model directory of the target")
    parser.add_argument("--draft", help="HF model directory of the draft (default: target's first layers)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=SPEC_BENCH, help="JSONL with a 'turns' list per row")
    parser.add_argument("--n-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    result = run(args)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
