"""`runtime.dtype=auto` on a CPU: decided by timing the target on this machine, not by its feature flags. Which dtype
is cheaper differs between CPUs and between kinds of work on one CPU: on a CPU without native bf16 matmuls a bf16
decoding step can win while a bf16 verify pass, a batched generation step or a prefill loses (docs/results.md, "The
first run on any machine"). So every kind of forward a run spends its time on is timed, the two dtypes interleaved
round by round (a busy moment slows both alike), and bf16 must win clearly over them all to be chosen: a near-tie goes
to fp32, the exact one, every time, where a single close comparison flipped between two probes of one machine. The
choice is cached per machine, instruction set, thread count, torch version and model.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import torch

from pipeline.atomic import write_json
from pipeline.machine import cpu_name
from pipeline.timing import synced_clock

CACHE = "dtype_choice.json"
PROBE_VERSION = 2  # the cache key carries it: an older probe's choice (two workloads, no margin) is timed again
CANDIDATES = ("float32", "bfloat16")
VERIFY_FED = 5  # the verify pass timed: a few drafted tokens, what speculation pays the target for
# The work a run spends its time on, as (batch, tokens fed, cached context) forwards: the decoder's step and verify pass
# (eval), a batched generation step at collect's default batch of 16, and a 128-token prefill (labelling text,
# held-out passes, the training forwards).
WORKLOADS = {"step_ms": (1, 1, 64), "verify5_ms": (1, VERIFY_FED, 64), "batch16_ms": (16, 1, 16),
             "prefill_ms": (1, 128, 0)}  # the batch's context is short: filling 16 rows' caches in emulated bf16 took 17 s
# bf16 is chosen only when its geometric-mean time over WORKLOADS is at least this much below fp32's: repeated probes
# of one machine scatter by about this much (docs/results.md), and fp32 needs no recheck of near-ties.
BF16_MARGIN = 0.1


@torch.inference_mode()
def _forward_inputs(model, batch: int, fed: int, context: int):
    """Input ids and a KV cache holding `context` tokens, for one timed forward of `fed` tokens per row."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (batch, context + fed),
                        generator=torch.Generator().manual_seed(0)).to(model.device)
    cache = DynamicCache(config=model.config)
    if context:
        model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    return ids[:, context:], cache


@torch.inference_mode()
def _forward(model, fed_ids, cache) -> None:
    """The timed forward, its cache rolled back after it (the next one sees the same context)."""
    model(input_ids=fed_ids, cache=cache, use_cache=True, logits_to_keep=fed_ids.shape[1])
    cache.crop(-fed_ids.shape[1])


def time_forward(model, context: int = 64, fed: int = 1, repeats: int = 6, batch: int = 1) -> float:
    """Median seconds of one forward of `fed` tokens per row after `context` cached ones (the head included)."""
    fed_ids, cache = _forward_inputs(model, batch, fed, context)
    clock, seconds = synced_clock(model.device), []
    for _ in range(repeats + 1):
        start = clock()
        _forward(model, fed_ids, cache)
        seconds.append(clock() - start)
    return statistics.median(seconds[1:])  # the first is a warm-up


def measure(model_path: Path, repeats: int = 3) -> dict:
    """{dtype: {workload: median ms}} for the model at `model_path` on this CPU, the dtypes interleaved: each round
    times every workload once in each dtype, alternating which goes first."""
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    models = {"float32": fp32, "bfloat16": AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.bfloat16).eval()}
    clock = synced_clock(fp32.device)
    inputs = {(d, w): _forward_inputs(models[d], *shape) for d in CANDIDATES for w, shape in WORKLOADS.items()}
    seconds = {key: [] for key in inputs}
    for round_ in range(repeats + 1):
        order = CANDIDATES if round_ % 2 else CANDIDATES[::-1]
        for workload in WORKLOADS:
            for d in order:
                start = clock()
                _forward(models[d], *inputs[(d, workload)])
                seconds[(d, workload)].append(clock() - start)
    return {d: {w: 1e3 * statistics.median(seconds[(d, w)][1:]) for w in WORKLOADS} for d in CANDIDATES}


def choose(timings: dict) -> str:
    """bf16 where its geometric-mean time over the workloads is BF16_MARGIN below fp32's, else fp32."""
    ratio = math.exp(statistics.fmean(math.log(timings["bfloat16"][w] / timings["float32"][w]) for w in WORKLOADS))
    return "bfloat16" if ratio <= 1 - BF16_MARGIN else "float32"


def machine_key(model_path: Path) -> str:
    """What a dtype choice holds for: the model, the CPU, the kernels torch and oneDNN may use, threads, torch."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "all"
    return (f"{model_path.resolve()}|{cpu_name()}|aten={torch.backends.cpu.get_cpu_capability()}|onednn={isa}|"
            f"threads={torch.get_num_threads()}|torch={torch.__version__}|probe={PROBE_VERSION}")


def cpu_timings(model_path: str | Path, cache_dir: str | Path | None = None) -> dict:
    """{"dtype": the cheaper one, dtype: {workload: ms}} for this model on this CPU (timed once, cached)."""
    model_path = Path(model_path)
    cache = Path(cache_dir or model_path) / CACHE
    key = machine_key(model_path)
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in known:
        timings = measure(model_path)
        known[key] = {"dtype": choose(timings), **timings}
        write_json(cache, known)
        shown = "; ".join(f"{d} " + " / ".join(f"{t[w]:.0f}" for w in WORKLOADS) for d, t in timings.items())
        print(f"[runtime] dtype=auto: {known[key]['dtype']} on this CPU (forward ms, 1-token / 5-token / batch-16 "
              f"step / 128-token prefill: {shown}; bf16 needs {BF16_MARGIN:.0%} less over all four; cached in {cache})")
    return known[key]
