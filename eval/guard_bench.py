"""What the online guard costs when it changes nothing, on the decoder, side by side in one run.

    python -m eval.guard_bench --target artifacts/models/<target> --draft artifacts/draft [--gamma 1] [--n-prompts 6]

Greedy, fixed γ, the same prompts decoded with and without a guard that keeps every pass as it is (its prior says
every draft is accepted and it may not draft more than γ; no timing passes), interleaved after a warm-up: the two
produce the same tokens, so the ratio of their times is the guard's bookkeeping. Prints that ratio with its paired
95% bootstrap interval over requests, and the bookkeeping per pass timed alone (budget() + update(), the clock
included) against the mean pass. Asserts nothing about wall-clock.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from eval.bench import DEFAULT_PROMPTS, first_turns, load_pair
from eval.metrics import bootstrap_ci
from pipeline.chat import encode_chat, stop_token_ids
from pipeline.decoding import DraftLength, DraftPlan, Guard, GuardSettings, speculative_generate
from pipeline.decoding.draft_length import Policy
from pipeline.errors import OneLineParser, one_line_errors, require_positive
from pipeline.timing import synced_clock


def idle_guard(gamma: int, measure_every: int = 0) -> Guard:
    """A guard that keeps every pass at γ: free drafts and verification (so drafting always pays), at most γ
    drafts. Its bookkeeping is a guard's whatever the prices: one product and one comparison per length."""
    return Guard({"c": 0.0}, (0.99,) * gamma, GuardSettings(longest=gamma, measure_every=measure_every))


def bookkeeping_seconds(gamma: int, passes: int = 20000) -> dict[str, float]:
    """Seconds per pass of budget() + update() alone, without and with the pass timing."""
    out = {}
    for name, every in (("decisions", 0), ("decisions + timing", 10 ** 9)):
        policy = idle_guard(gamma, every).wrap(Policy(gamma))
        start = time.perf_counter()
        for _ in range(passes):
            policy.update(policy.budget(), gamma)
        out[name] = (time.perf_counter() - start) / passes
    return out


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    target, draft, tokenizer = load_pair(args, device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    stop = stop_token_ids(tokenizer, target)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in first_turns(args.prompts, args.n_prompts)]
    guards = {"unguarded": None, "guarded": idle_guard(args.gamma)}
    clock, drafting = synced_clock(device), DraftLength("fixed", args.gamma)
    rows = {name: [] for name in guards}  # per request: (seconds, passes, tokens)
    for name, guard in guards.items():  # warm-up
        speculative_generate(target, draft, prompts[0][:, :8], plan=DraftPlan(drafting, guard=guard), max_new_tokens=8)
    for repeat in range(args.repeats):
        for i, ids in enumerate(prompts):
            order = list(guards) if (repeat + i) % 2 == 0 else list(reversed(guards))
            for name in order:
                start = clock()
                out = speculative_generate(target, draft, ids, plan=DraftPlan(drafting, guard=guards[name]),
                                           max_new_tokens=args.max_new_tokens, eos_token_id=stop)
                rows[name].append((clock() - start, out.stats.target_passes, out.tokens.tolist()))
    same = all(a[2] == b[2] for a, b in zip(rows["unguarded"], rows["guarded"]))
    guarded, unguarded = (np.array([r[0] for r in rows[name]]) for name in ("guarded", "unguarded"))

    def ratio(g, u, axis=-1):  # Σ guarded time / Σ unguarded time over the same requests
        return np.sum(g, axis=axis) / np.sum(u, axis=axis)

    pass_s = float(guarded.sum()) / sum(r[1] for r in rows["guarded"])
    book = bookkeeping_seconds(args.gamma)
    return {"gamma": args.gamma, "requests": len(guarded), "same_tokens": same, "mean_pass_ms": 1000 * pass_s,
            "time_ratio": float(ratio(guarded, unguarded)), "time_ratio_ci95": bootstrap_ci((guarded, unguarded), ratio),
            "bookkeeping_us": {k: 1e6 * v for k, v in book.items()},
            "bookkeeping_share_of_pass": {k: v / pass_s for k, v in book.items()}}


def report(r: dict) -> str:
    lo, hi = r["time_ratio_ci95"] or (float("nan"), float("nan"))
    lines = [f"fixed γ = {r['gamma']}, greedy, {r['requests']} requests, same tokens with and without: {r['same_tokens']}",
             f"time guarded / unguarded = {r['time_ratio']:.4f} [{lo:.4f}, {hi:.4f}] (95% paired bootstrap)",
             f"mean pass {r['mean_pass_ms']:.1f} ms; the guard's bookkeeping alone per pass:"]
    lines += [f"  {k:<20}{r['bookkeeping_us'][k]:8.2f} µs = {r['bookkeeping_share_of_pass'][k]:.4%} of a pass"
              for k in r["bookkeeping_us"]]
    return "\n".join(lines)


def main(argv=None):
    parser = OneLineParser(prog="python -m eval.guard_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HF model directory of the target")
    parser.add_argument("--draft", required=True, help="HF model directory of the draft")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--n-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = parser.parse_args(argv)
    args.draft_layers = 2  # load_pair's fallback when there is no draft; --draft is required here
    with one_line_errors("guard_bench"):
        require_positive(args, "n_prompts", "max_new_tokens", "gamma", "repeats")
        print(report(run(args)))


if __name__ == "__main__":
    main()
