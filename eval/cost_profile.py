"""Measure a cost profile on this machine: the target's forward time per number of tokens fed at two context
lengths, the draft's step, c and the verify ratios (pipeline/cost_profile.py has the schema).

    python -m eval.cost_profile --target-config <config.json|dir|preset> --draft-config <...|preset:draft>
                                [--vocab-subset K] [--dtype auto|bf16|fp32] [--device cpu|cuda]
                                [--threads N] [--out cost_profile.json]
    python -m eval.cost_profile --target <model dir> --draft <model dir>

Step times depend on shapes, dtype and hardware, not on weight values, so `--*-config` builds random weights
(no download) and a profile can be measured for a serving machine before any training. With `--draft <dir>`
holding a speculative.json, its FR-Spec subset sets the head rows unless --vocab-subset is given.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pipeline import cost_profile as cp
from pipeline.errors import OneLineParser, PipelineError
from pipeline.models import load_model, resolve_device
from pipeline.spec import SpeculativeSpec

DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp32": "float32"}


def parse(argv=None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m eval.cost_profile", description=__doc__.splitlines()[0])
    for role in ("target", "draft"):
        group = parser.add_mutually_exclusive_group(required=True)
        group.add_argument(f"--{role}", help=f"HF model directory of the {role} (real weights)")
        group.add_argument(f"--{role}-config", help="config.json, a directory holding one, or a preset name "
                           "(conf/model/; `<preset>:draft` for its draft): random weights of those shapes")
    parser.add_argument("--vocab-subset", type=int, default=0, help="draft head rows (FR-Spec K); 0: full vocabulary")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--tokens-fed", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-gamma", type=int, default=8, help="verify ratios printed for γ = 1..this")
    parser.add_argument("--out", type=Path, default=Path(cp.FILENAME))
    return parser.parse_args(argv)


def load(args, role: str, device: torch.device, dtype: torch.dtype):
    directory = getattr(args, role)
    if directory is None:
        return cp.random_model(getattr(args, f"{role}_config"), dtype, device)
    if not (Path(directory) / "config.json").is_file():
        raise PipelineError(f"--{role} {directory} is not a model directory with a config.json: "
                            f"pass one, or --{role}-config for random weights")
    return load_model(directory, device, dtype)


def draft_vocab(args, draft) -> torch.Tensor | None:
    """The head rows as served: --vocab-subset K (only the count matters for timing), else the draft
    export's FR-Spec ids, else the full vocabulary."""
    if args.vocab_subset:
        if not 0 < args.vocab_subset <= draft.config.vocab_size:
            raise PipelineError(f"--vocab-subset {args.vocab_subset} is outside 1..{draft.config.vocab_size} "
                                "(the draft's vocabulary): pass a smaller K or 0")
        return torch.arange(args.vocab_subset)
    spec = SpeculativeSpec.read(args.draft) if args.draft else None
    return torch.tensor(spec.vocab_subset) if spec and spec.vocab_subset else None


def table(profile: dict, max_gamma: int) -> str:
    m, s, shapes = profile["machine"], profile["settings"], profile["shapes"]
    t, d = shapes["target"], shapes["draft"]
    lines = [f"{m['device']} ({m['device_name']}), {m['dtype']}, threads={m['torch_threads']}, "
             f"torch {m['torch_version']}",
             f"target {t['architecture']} {t['num_hidden_layers']}x{t['hidden_size']}; draft {d['architecture']} "
             f"{d['num_hidden_layers']}x{d['hidden_size']}, head {d['head_rows']} rows",
             "target forward ms, median (p25-p75) and ratio to 1 token:",
             f"{'tokens fed':>10}" + "".join(f"{f'context {n}':>30}" for n in s["contexts"])]
    for k in s["tokens_fed"]:
        cells = [profile["target"][str(n)][str(k)] for n in s["contexts"]]
        lines.append(f"{k:>10}" + "".join(f"{e['ms']:>10.2f} ({e['p25']:.2f}-{e['p75']:.2f}) x{e['ratio']:.2f}"
                                          .rjust(30) for e in cells))
    dr = profile["draft"]
    cost = cp.summary(profile, max_gamma)
    lines += [f"draft step ms (context {dr['context']}): {dr['ms']:.2f} ({dr['p25']:.2f}-{dr['p75']:.2f})",
              f"c = draft step / target 1-token step = {cost['c']:.3f}",
              "verify ratio r_γ (monotone fit): "
              + ", ".join(f"γ={g} {r:.2f}" for g, r in cost["verify_ratio"].items())]
    return "\n".join(lines)


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = resolve_device({"device": args.device or "auto", "dtype": DTYPES[args.dtype]})
    target, draft = load(args, "target", device, dtype), load(args, "draft", device, dtype)
    profile = cp.measure_cost_profile(target, draft, draft_vocab(args, draft), args.tokens_fed, args.contexts,
                                      repeats=args.repeats, warmup=args.warmup)
    cp.write_profile(args.out, profile)
    return profile


def main(argv=None):
    args = parse(argv)
    try:
        profile = run(args)
    except PipelineError as e:
        sys.stderr.write(f"[cost_profile] error: {e}\n")
        sys.exit(2)
    print(table(profile, args.max_gamma))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
