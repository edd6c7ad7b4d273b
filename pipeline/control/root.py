"""The groups every stage shares (`paths`, `engines`, `runtime`, `tracking`), declared once as structured configs
(pipeline/settings.py); the deadline's are in pipeline/control/deadline.py."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.settings import group, register, setting


@dataclass(frozen=True)
class Paths:
    artifacts: str = setting("artifacts", "every stage's output lies under this folder")
    prompts: str = setting("${paths.artifacts}/prompts", "the prepare stage's prompts")
    models: str = setting("${paths.artifacts}/models", "converted weights cache")
    cache: str = setting("${paths.artifacts}/cache", "downloaded wheels")
    collect: str = setting("${paths.artifacts}/collect", "the collect stage's rows")
    trained: str = setting("${paths.artifacts}/trained", "the distill stage's output: draft/ and draft_init/ weights "
                           "+ training.json")
    draft: str = setting("${paths.artifacts}/draft", "the calibrated draft export (the calibrate stage's output)")
    draft_init: str = setting("${paths.artifacts}/draft_init", "the undistilled draft, for before/after comparisons")
    eval: str = setting("${paths.artifacts}/eval", "the eval stage's report")
    engines: str = setting("${paths.artifacts}/engines", "serving engines built from pinned source, and the GGUF "
                           "files they serve")


@dataclass(frozen=True)
class LlamaCppEngine:
    """llama.cpp (pipeline/engines/llamacpp.py), built from llama-cpp-python's sdist."""
    version: str = setting("0.3.36", "the llama-cpp-python sdist whose vendor/llama.cpp is built (server, converter, "
                           "quantizer)")
    threads: int | None = setting(None, "threads of llama-server and llama-bench; null = every core")
    context: int = setting(4096, "llama-server's context (prompt + generation) per request")
    draft_quant: str | None = setting(None, "the draft GGUF's quantisation (e.g. Q8_0); null = the target GGUF's own "
                                      "family")
    start_timeout: float = setting(120, "seconds a server may take to load its models before the stage fails")


@dataclass(frozen=True)
class VllmEngine:
    """vLLM's offline engine (eval/engine_vllm.py; CUDA and `pip install vllm`)."""
    gpu_memory_utilization: float = setting(0.85, "GPU memory of all its engines together (plain + one per "
                                            "speculative_config)")
    max_model_len: int = setting(4096, "context per request; bounds each engine's KV cache")
    enforce_eager: bool = setting(False, "true = no CUDA graphs (faster start, slower steps)")


@dataclass(frozen=True)
class Engines:
    """The serving engines the draft is calibrated for and evaluated in (eval.engine)."""
    llamacpp: LlamaCppEngine = group(LlamaCppEngine, "llama.cpp")
    vllm: VllmEngine = group(VllmEngine, "vLLM")


@dataclass(frozen=True)
class Runtime:
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting("auto", "auto (bf16 on CUDA; on a CPU whichever of fp32 and bf16 runs the target's 1-token "
                         "step and 5-token verify faster, timed once per machine, pipeline/modelio/dtype.py) | "
                         "float32 | bfloat16")
    threads: int | None = setting(None, "torch intra-op threads on CPU; null = torch's default")


@dataclass(frozen=True)
class Tracking:
    enabled: bool = setting(True, "an MLflow run per stage")
    uri: str | None = setting(None, "null = a local SQLite store, ${paths.artifacts}/mlflow.db")
    experiment: str = setting("draft-distillation", "the MLflow experiment")


for name, schema in {"paths": Paths, "engines": Engines, "runtime": Runtime, "tracking": Tracking}.items():
    register(name, schema)
