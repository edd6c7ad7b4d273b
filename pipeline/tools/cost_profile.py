"""Measure a cost profile on this machine (pipeline/measure/cost_profile.py), at the points distill times
(calibrate.cost). Step times depend on shapes, dtype and hardware, not on weight values, so
`tool.*_config` builds random weights and a serving machine can be profiled before any training.

    python -m pipeline.tools cost-profile tool.target_config=<config.json|dir|preset> tool.draft_config=<...>
    python -m pipeline.tools cost-profile tool.target=<model dir> tool.draft=<model dir>
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from pipeline.settings import register, setting
from pipeline.measure import cost_profile as cp
from pipeline.errors import PipelineError
from pipeline.modelio.models import load_model, resolve_device
from pipeline.decoding.spec import SpeculativeSpec


@dataclass(frozen=True)
class CostProfileToolSettings:
    """cost-profile: a device's cost profile, at the points distill times.

    The points are calibrate.cost's; device and dtype are runtime.device and runtime.dtype."""
    target: str | None = setting(None, "HF model directory of the target (real weights), or")
    target_config: str | None = setting(None, "config.json, a directory holding one, or a preset name (conf/model/): "
                                        "random weights")
    draft: str | None = setting(None, "HF model directory of the draft, or")
    draft_config: str | None = setting(None, "as target_config; `<preset>:draft` for a preset's draft")
    vocab_subset: int = setting(0, "draft head rows (FR-Spec K); 0 = the draft export's subset, else the full vocabulary")
    tokens_fed: tuple[int, ...] = setting("${calibrate.cost.tokens_fed}", "target forward widths timed")
    contexts: tuple[int, ...] = setting("${calibrate.cost.contexts}", "KV-cache lengths they are timed at")
    repeats: int = setting("${calibrate.cost.repeats}", "timed rounds per point")
    warmup: int = setting("${calibrate.cost.warmup}", "untimed rounds first")
    max_gamma: int = setting(8, "verify ratios printed for gamma = 1..this")
    out: str = setting("cost_profile.json", "where the profile is written (atomically)")


register("tools", CostProfileToolSettings, name="cost-profile", package="tool")

def options(cfg) -> SimpleNamespace:
    """tool.* with exactly one of a directory or a config per role."""
    args = SimpleNamespace(**cfg.tool)
    for role in ("target", "draft"):
        if (getattr(args, role) is None) == (getattr(args, f"{role}_config") is None):
            raise PipelineError(f"give one of tool.{role}=<model dir> and tool.{role}_config=<config.json|preset>")
    for key in ("repeats", "max_gamma"):
        if getattr(args, key) < 1:
            raise PipelineError(f"tool.{key}={getattr(args, key)} is not an integer >= 1")
    return args


def load(args, role: str, device: torch.device, dtype: torch.dtype):
    directory = getattr(args, role)
    if directory is None:
        return cp.random_model(getattr(args, f"{role}_config"), dtype, device)
    if not (Path(directory) / "config.json").is_file():
        raise PipelineError(f"tool.{role}={directory} is not a model directory with a config.json: "
                            f"pass one, or tool.{role}_config for random weights")
    return load_model(directory, device, dtype)


def draft_vocab(args, draft) -> torch.Tensor | None:
    """The head rows as served: tool.vocab_subset K (only the count matters for timing), else the draft
    export's FR-Spec ids, else the full vocabulary."""
    if args.vocab_subset:
        if not 0 < args.vocab_subset <= draft.config.vocab_size:
            raise PipelineError(f"tool.vocab_subset={args.vocab_subset} is outside 1..{draft.config.vocab_size} "
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


def run(cfg) -> dict:
    args = options(cfg)
    device, dtype = resolve_device(cfg.runtime)
    target, draft = load(args, "target", device, dtype), load(args, "draft", device, dtype)
    plan = cp.CostPlan(tuple(args.tokens_fed), tuple(args.contexts), args.repeats, args.warmup)
    profile = cp.measure_cost_profile(target, draft, draft_vocab(args, draft), plan)
    cp.write_profile(args.out, profile)
    print(table(profile, args.max_gamma))
    print(f"wrote {args.out}")
    return profile
