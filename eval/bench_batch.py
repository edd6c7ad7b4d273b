"""Batched speculative decoding against batched plain decoding at several batch sizes, side by side in one run.

    python -m eval.bench_batch --target artifacts/models/<target> --draft artifacts/draft [--batch-sizes 1 2 4 8]

Greedy, on the first user turns of a prompt JSONL (chat template applied; prompts of different lengths). For each
batch size B the prompts are cut into batches of B rows and each batch is decoded by both methods back to back,
order alternating, over --repeats rounds, after a warm-up. Prints per B the tokens/s of each method, the speedup
(speculative tokens/s over plain, pooled over the batches) with its paired bootstrap 95% CI over the batches, the
acceptance, and whether the rows' outputs were identical (they must be: greedy batched speculation is lossless
per row). Asserts nothing about wall-clock. The break-even batch is the smallest B whose speedup CI lies below 1.

Beside it, the prediction: the cost of one target forward (1 and γ + 1 new tokens per row) and one draft forward
at each B, timed on their own after a cached context, priced by the one cost model (pipeline/decoding/cost.py:
(1 + A) / (γ·c(B) + r(B)), A = accepted drafts per pass measured at the smallest B): where speculation stops
paying as the target stops being memory-bound.
"""
import sys
from pathlib import Path

import numpy as np
import torch

from eval.bench import DEFAULT_PROMPTS, first_turns
from eval.metrics import _speedup_stat, bootstrap_ci
from pipeline.chat import encode_chat, stop_token_ids
from pipeline.decoding import autoregressive_generate_batch, predicted_speedup, speculative_generate_batch
from pipeline.errors import OneLineParser, PipelineError
from pipeline.heads import head_logits, head_rows
from pipeline.models import load_model, load_tokenizer
from pipeline.timing import synced_clock

CONTEXT = 96  # cached tokens per row before the timed forward (a chat prompt and some answer)


def draft_vocab(draft_dir: Path) -> torch.Tensor | None:
    """The FR-Spec head subset of an exported draft (speculative.json `vocab_subset`), as eval uses it."""
    from pipeline.spec import SpeculativeSpec

    spec = SpeculativeSpec.read(draft_dir)
    return torch.tensor(spec.vocab_subset, dtype=torch.long) if spec is not None and spec.vocab_subset else None


def batches_of(prompts: list, size: int) -> list[list]:
    return [prompts[i:i + size] for i in range(0, len(prompts) - size + 1, size)]


def measure(target, draft, prompts: list, args, clock) -> dict:
    """{B: {plain, speculative: [(tokens, seconds) per timed batch], accepted, drafted, identical}}."""
    out = {}
    for size in args.batch_sizes:
        runs = {"plain": [], "speculative": []}
        accepted = drafted = passes = 0
        identical = True
        methods = {
            "plain": lambda rows: autoregressive_generate_batch(target, rows, max_new_tokens=args.max_new_tokens,
                                                                eos_token_id=args.stop),
            "speculative": lambda rows: speculative_generate_batch(target, draft, rows, gamma=args.gamma,
                                                                   max_new_tokens=args.max_new_tokens,
                                                                   draft_vocab=args.vocab, eos_token_id=args.stop),
        }
        for repeat in range(args.repeats):
            for k, rows in enumerate(batches_of(prompts, size)):
                outputs = {}
                for name in (list(methods) if (repeat + k) % 2 == 0 else list(reversed(methods))):
                    start = clock()
                    result = methods[name](rows)
                    seconds = clock() - start
                    runs[name].append((sum(len(t) for t in result.tokens), seconds))
                    outputs[name] = [t.tolist() for t in result.tokens]
                    if name == "speculative":
                        accepted += sum(s.n_accepted for s in result.stats)
                        drafted += sum(s.n_drafted for s in result.stats)
                        passes += sum(d > 0 for s in result.stats for d in s.drafted)
                identical &= outputs["plain"] == outputs["speculative"]
        out[size] = {**runs, "acceptance": accepted / drafted if drafted else 0.0, "identical": identical,
                     "accepted": accepted, "drafting_passes": passes}
    return out


@torch.inference_mode()
def forward_ms(model, batch: int, tokens: int, clock, repeats: int = 9, vocab=None) -> float:
    """Median ms of one forward of `tokens` new tokens per row after CONTEXT cached ones, at this batch size
    (through the decoder's own path: the base model, then the head on the new positions only)."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (batch, CONTEXT + tokens))
    head, times = head_rows(model, vocab), []
    for _ in range(repeats + 1):  # the first is a warm-up: the kernels of a new shape are chosen there
        cache = DynamicCache(config=model.config)
        model.model(input_ids=ids[:, :CONTEXT], cache=cache, use_cache=True)
        start = clock()
        hidden = model.model(input_ids=ids[:, CONTEXT:], cache=cache, use_cache=True).last_hidden_state
        head_logits(hidden[:, -tokens:], head)
        times.append(clock() - start)
    return 1000 * float(np.median(times[1:]))


def predict(target, draft, measured: dict, args, clock) -> dict:
    """{B: {c, r, predicted}} from forward costs at each B and the accepted drafts per pass at the smallest B."""
    first = measured[min(measured)]
    accepted = first["accepted"] / first["drafting_passes"] if first["drafting_passes"] else 0.0
    out = {}
    for size in measured:
        step = forward_ms(target, size, 1, clock)
        c = forward_ms(draft, size, 1, clock, vocab=args.vocab) / step
        r = forward_ms(target, size, args.gamma + 1, clock) / step
        out[size] = {"target_step_ms": step, "c": c, "r": r, "accepted_per_pass": accepted,
                     "predicted": predicted_speedup(accepted, args.gamma, c, r)}
    return out


def summarize(measured: dict) -> dict:
    rows = {}
    for size, m in measured.items():
        (tok_s, sec_s), (tok_p, sec_p) = (np.array(m[k], dtype=float).T for k in ("speculative", "plain"))
        samples = (tok_s, sec_s, tok_p, sec_p)
        rows[size] = {"plain_tok_s": tok_p.sum() / sec_p.sum(), "spec_tok_s": tok_s.sum() / sec_s.sum(),
                      "speedup": float(_speedup_stat(*samples)), "ci95": bootstrap_ci(samples, _speedup_stat),
                      "n_batches": len(tok_s), "acceptance": m["acceptance"], "identical": m["identical"]}
    losing = [size for size, r in rows.items() if r["ci95"] and r["ci95"][1] < 1.0]
    below = [size for size, r in rows.items() if r["speedup"] < 1.0]
    return {"by_batch": rows, "break_even_batch": min(losing) if losing else None,
            "first_below_one": min(below) if below else None}


def report(summary: dict, args) -> str:
    subset = "full vocabulary" if args.vocab is None else f"FR-Spec subset of {len(args.vocab):,} tokens"
    lines = [f"greedy, gamma={args.gamma}, max_new_tokens={args.max_new_tokens}, {args.n_prompts} prompts, "
             f"repeats={args.repeats}, torch threads={torch.get_num_threads()}, draft head: {subset}",
             f"{'B':>3} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup [95% CI]':>26} {'n':>3} {'accept':>7} "
             f"{'identical':>9} {'c(B)':>6} {'r(B)':>6} {'predicted':>9}"]
    predicted = summary["predicted"]
    for size, r in summary["by_batch"].items():
        ci = "[n<2]" if r["ci95"] is None else f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
        p = predicted[size]
        lines.append(f"{size:>3} {r['plain_tok_s']:>12.1f} {r['spec_tok_s']:>11.1f} {r['speedup']:>8.3f}× {ci:>16} "
                     f"{r['n_batches']:>3} {r['acceptance']:>7.3f} {str(r['identical']):>9} {p['c']:>6.3f} "
                     f"{p['r']:>6.2f} {p['predicted']:>8.3f}×")
    below = [size for size, p in predicted.items() if p["predicted"] < 1.0]
    lines.append(f"measured: first B with speedup < 1: {summary['first_below_one']}; smallest B whose CI is below 1: "
                 f"{summary['break_even_batch']}; predicted first B below 1: {min(below) if below else None}")
    return "\n".join(lines)


def check_args(args) -> None:
    for name in ("target", "draft"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            raise PipelineError(f"--{name} {getattr(args, name)} is not an HF model directory (no config.json): "
                                "pass a directory the pipeline exported or converted")
    for name in ("n_prompts", "max_new_tokens", "gamma", "repeats"):
        if getattr(args, name) < 1:
            raise PipelineError(f"--{name.replace('_', '-')} {getattr(args, name)} is not an integer >= 1")
    if not args.batch_sizes or min(args.batch_sizes) < 1 or max(args.batch_sizes) > args.n_prompts:
        raise PipelineError(f"--batch-sizes {args.batch_sizes} must be integers in [1, --n-prompts {args.n_prompts}]")


def main(argv=None):
    parser = OneLineParser(prog="python -m eval.bench_batch", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF model directory of the target")
    parser.add_argument("--draft", required=True, help="HF model directory of the draft")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                        help="prompt JSONL (our schema or Spec-Bench's)")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--no-vocab-subset", dest="vocab_subset", action="store_false",
                        help="draft over the full vocabulary instead of the draft's FR-Spec subset")
    args = parser.parse_args(argv)
    try:
        check_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        target, draft = load_model(args.target), load_model(args.draft)
        tokenizer = load_tokenizer(args.target)
        args.vocab = draft_vocab(Path(args.draft)) if args.vocab_subset else None
        args.stop = stop_token_ids(tokenizer, target)
        prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}])[0]
                   for text in first_turns(args.prompts, args.n_prompts)]
        speculative_generate_batch(target, draft, prompts[:2], gamma=args.gamma, max_new_tokens=4)  # warm-up
        autoregressive_generate_batch(target, prompts[:2], max_new_tokens=4)
        measured = measure(target, draft, prompts, args, synced_clock("cpu"))
        summary = summarize(measured) | {"predicted": predict(target, draft, measured, args, synced_clock("cpu"))}
    except PipelineError as e:
        sys.stderr.write(f"[bench_batch] error: {e}\n")
        sys.exit(2)
    print(report(summary, args))


if __name__ == "__main__":
    main()
