"""`runtime.dtype=auto` on a CPU: decided by timing the target on this machine, not by its feature flags. What
speculation pays for is a decoding step and a verify pass of a few tokens, and which dtype makes those cheaper
differs between CPUs (docs/results.md has the measurements), so both are timed on the target and the cheaper step +
5-token verify wins; the choice is cached per machine, thread count, torch version and model.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from pipeline.atomic import write_json
from pipeline.machine import cpu_name
from pipeline.timing import synced_clock

CACHE = "dtype_choice.json"
CANDIDATES = ("float32", "bfloat16")
VERIFY_FED = 5  # the verify pass timed: a few drafted tokens, what speculation pays the target for


@torch.inference_mode()
def time_forward(model, context: int = 64, fed: int = 1, repeats: int = 6) -> float:
    """Median seconds of one forward of `fed` tokens after `context` cached ones (the decoder's head included)."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (1, context + fed), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    seconds, clock = [], synced_clock(model.device)
    for i in range(repeats + 1):
        start = clock()
        model(input_ids=ids[:, context:], cache=cache, use_cache=True, logits_to_keep=fed)
        if i:  # the first is a warm-up
            seconds.append(clock() - start)
        cache.crop(-fed)
    return statistics.median(seconds)


def measure(model_path: Path) -> dict:
    """{dtype: {"step_ms", "verify5_ms"}} for the model at `model_path` on this CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    timings = {}
    for name in CANDIDATES:
        model = model.to(getattr(torch, name))
        timings[name] = {"step_ms": 1e3 * time_forward(model, fed=1),
                         "verify5_ms": 1e3 * time_forward(model, fed=VERIFY_FED)}
    return timings


def cpu_timings(model_path: str | Path, cache_dir: str | Path | None = None) -> dict:
    """{"dtype": the cheaper one, dtype: {"step_ms", "verify5_ms"}} for this model on this CPU (timed once, cached)."""
    model_path = Path(model_path)
    cache = Path(cache_dir or model_path) / CACHE
    key = f"{model_path.resolve()}|{cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in known:
        timings = measure(model_path)
        choice = min(timings, key=lambda d: timings[d]["step_ms"] + timings[d]["verify5_ms"])
        known[key] = {"dtype": choice, **timings}
        write_json(cache, known)
        shown = ", ".join(f"{d} {t['step_ms']:.0f} / {t['verify5_ms']:.0f} ms" for d, t in timings.items())
        print(f"[runtime] dtype=auto: {choice} on this CPU (1-token / 5-token forward: {shown}; cached in {cache})")
    return known[key]
