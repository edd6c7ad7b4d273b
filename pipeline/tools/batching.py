"""Calibrate an existing export's draft length per batch size without retraining (distill/batching.py): rewrites its
speculative.json `batching` (atomically), or writes a calibrated copy of the export with tool.out=<dir>.

    python -m pipeline.tools batching [tool.draft=<export> tool.batch_sizes=[1,2,4,8,16] tool.out=<dir>]
"""
from __future__ import annotations

import shutil

import torch

from distill.batching import format_batching, with_batching
from pipeline.atomic import atomic_dir
from pipeline.batch_profile import measure_batch_profile
from pipeline.errors import PipelineError
from pipeline.models import load_model, resolve_device
from pipeline.spec import SpeculativeSpec
from pipeline.timing import synced_clock
from pipeline.tools.common import model_dir


def run(cfg) -> SpeculativeSpec:
    tool = cfg.tool
    sizes, gammas = list(tool.batch_sizes), list(tool.gammas)
    if not sizes or not gammas or min(sizes) < 1 or min(gammas) < 1 or tool.repeats < 1 or tool.margin < 0:
        raise PipelineError(f"tool.batch_sizes={sizes}, tool.gammas={gammas} and tool.repeats={tool.repeats} must be "
                            f"integers >= 1 and tool.margin={tool.margin} >= 0")
    target_dir, draft_dir = model_dir(cfg, "target"), model_dir(cfg, "draft")
    spec = SpeculativeSpec.read(draft_dir)
    if spec is None:
        raise PipelineError(f"{draft_dir} has no speculative.json: pass a draft the distill stage exported")
    device, dtype = resolve_device(cfg.runtime, target_dir, cfg.paths.models)
    target, draft = load_model(target_dir, device, dtype), load_model(draft_dir, device, dtype)
    vocab = torch.tensor(spec.vocab_subset, dtype=torch.long) if spec.vocab_subset else None
    profile = measure_batch_profile(target, draft, sizes, [g + 1 for g in gammas], synced_clock(device), vocab,
                                    repeats=tool.repeats, sampling=spec.sampling)
    spec = with_batching(spec, profile, gammas, tool.margin)
    if not tool.out:
        spec.write(draft_dir)  # atomic: pipeline/atomic.py
    else:
        with atomic_dir(tool.out) as tmp:
            shutil.copytree(draft_dir, tmp, dirs_exist_ok=True)
            spec.write(tmp)
    print(format_batching(spec.batching))
    return spec
