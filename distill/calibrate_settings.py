"""The calibrate stage's settings (`calibrate.*`, distill/calibrate_stage.py), declared once as distill's are
(distill/settings.py): one frozen dataclass per group, registered as Hydra's structured config `calibrate/default`.
The distill stage reads only `KeepBest` of them, so a calibration setting never reruns training (dvc.yaml)."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from pipeline.errors import PipelineError
from pipeline.settings import group, register, setting

DECLARED = "distill/calibrate_settings.py"


@dataclass(frozen=True)
class DraftLengthSettings:
    """`calibrate.draft_length`: the confidence-policy settings compared against fixed γ."""
    thresholds: tuple[float, ...] = setting([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9], "stop thresholds")
    max_lengths: tuple[int, ...] = setting([8, 16], "most drafts per target pass: the longest fixed gamma, and twice that")


@dataclass(frozen=True)
class CostSettings:
    """`calibrate.cost`: the device's cost profile (pipeline/measure/cost_profile.py)."""
    profile: str | None = setting(None, "a cost_profile.json (python -m pipeline.tools cost-profile) to calibrate for "
                                  "that device; null = measure one here")
    tokens_fed: tuple[int, ...] = setting([1, 2, 4, 8, 16, 32], "target forward widths timed (1 = a decoding step, "
                                          "k = a verify of k-1 drafts)")
    contexts: tuple[int, ...] = setting([64, 256], "KV-cache lengths they are timed at")
    repeats: int = setting(5, "timed rounds per point (the median is kept)")
    warmup: int = setting(2, "untimed rounds first: allocator and kernel selection")


@dataclass(frozen=True)
class LlamaCppCalibrationSettings:
    """`calibrate.llamacpp`: the llama.cpp settings compared per domain (distill/engines.py)."""
    n_max: tuple[int, ...] = setting([1, 2, 3, 4, 6, 8], "--spec-draft-n-max values compared")
    p_min: tuple[float, ...] = setting([0.0, 0.3, 0.5, 0.7, 0.8, 0.9], "--spec-draft-p-min values compared: llama.cpp "
                                       "stops before a draft token less likely than this")
    margin: float = setting(0.05, "'off' unless a setting is predicted at least this much faster than plain decoding: "
                            "the prediction error a choice must clear to be worth a second model in memory")
    repeats: int = setting(3, "llama-bench repetitions per forward size")

    def __post_init__(self):
        if not self.n_max or min(self.n_max) < 1 or not all(0.0 <= p < 1.0 for p in self.p_min) or not self.p_min:
            raise PipelineError(f"calibrate.llamacpp: n_max={list(self.n_max)} must be integers >= 1 and "
                                f"p_min={list(self.p_min)} shares in [0, 1): use e.g. n_max=[1,2,4] p_min=[0.0,0.5]")


@dataclass(frozen=True)
class GpuCalibrationSettings:
    """`calibrate.gpu`: how vLLM, SGLang and TensorRT-LLM are planned (distill/engines.py calibrate_gpu_engines)."""
    gammas: tuple[int, ...] = setting([1, 2, 3, 4, 5, 6, 8], "num_speculative_tokens compared per domain")
    margin: float = setting(0.05, "'off' unless k is predicted at least this much faster than plain decoding")
    c: float | None = setting(None, "draft step / target step measured on the serving GPU; null = the memory-bound "
                              "estimate (weights read per step, draft / target)")
    verify_ratio: float = setting(1.0, "a verify of up to max(gammas) drafts, in target steps (batch-1 GPU decoding "
                                  "is memory-bound)")

    def __post_init__(self):
        if not self.gammas or min(self.gammas) < 1 or (self.c is not None and self.c <= 0) or self.verify_ratio < 1:
            raise PipelineError(f"calibrate.gpu: gammas={list(self.gammas)} must be integers >= 1, c={self.c} "
                                f"> 0 or null, verify_ratio={self.verify_ratio} >= 1: use e.g. gammas=[1,2,4] c=null")


@dataclass(frozen=True)
class HfCalibrationSettings:
    """`calibrate.hf`: HF assisted generation's settings compared and how its passes are timed."""
    gammas: tuple[int, ...] = setting([1, 2, 3, 4], "num_assistant_tokens compared per domain (constant schedule)")
    margin: float = setting(0.05, "'off' unless predicted at least this much faster than HF plain generate")
    prompts: int = setting(6, "calibration prompts HF's own passes are timed on (plain and each gamma back to back)")
    max_new_tokens: int = setting(48, "tokens per timed request")

    def __post_init__(self):
        if not self.gammas or min(self.gammas) < 1 or self.prompts < 1 or self.max_new_tokens < 2:
            raise PipelineError(f"calibrate.hf: gammas={list(self.gammas)} must be integers >= 1, prompts="
                                f"{self.prompts} >= 1, max_new_tokens={self.max_new_tokens} >= 2: use e.g. gammas=[1,2,4]")


KEEP_BEST_RULES = ("interval", "mean")  # the trained weights' paired interval above the initial's, or their mean
ENGINES = ("hf", "llamacpp", "vllm", "sglang", "trtllm")  # engines distill can calibrate the export for, beside this project's decoder


@dataclass(frozen=True)
class KeepBest:
    """The `calibrate.*` keys the distill stage reads: whether training's weights are kept, and by what rule."""
    keep_best: bool
    keep_best_rule: str

    def __post_init__(self):
        if self.keep_best_rule not in KEEP_BEST_RULES:
            raise PipelineError(f"calibrate.keep_best_rule={self.keep_best_rule!r}: use one of "
                                f"{', '.join(KEEP_BEST_RULES)}")

    @classmethod
    def from_config(cls, cfg: DictConfig) -> KeepBest:
        group = cfg.get("calibrate")
        if group is None or any(key not in group for key in ("keep_best", "keep_best_rule")):
            raise PipelineError("calibrate.keep_best or calibrate.keep_best_rule is missing from the composed config: "
                                f"see {DECLARED}")
        return cls(group.keep_best, group.keep_best_rule)


@dataclass(frozen=True)
class CalibrationSettings:
    """`calibrate.*`: keep_best (both stages) and the serving settings the calibrate stage gives a draft
    (distill/calibrate_stage.py, distill/serving.py)."""
    keep_best: bool = setting(True, "ship the initial weights unless training raised held-out acceptance (calibration "
                              "part); the distill stage reads it too")
    keep_best_rule: str = setting("interval", "raised = the paired 95% interval over rows of (trained - initial) lies "
                                  "above 0 (a gain the part cannot resolve keeps the draft the user brought); mean = "
                                  "not lower on average")
    draft: str | None = setting(None, "null = calibrate ${paths.trained}'s draft and draft_init; a draft directory (a "
                                "published draft, another run's export) = calibrate that one alone into ${paths.draft}")
    speculate_margin: float = setting(0.05, "a domain speculates only when its best drafting is predicted this much "
                                      "faster than plain decoding, else 'off': the prediction error a choice must clear")
    calibrate_init: bool = setting(True, "${paths.draft_init} gets its own tau, gamma, policy and tree too: a fair "
                                   "'before' in eval, which otherwise credits distillation with what calibration buys")
    request_tokens: int | None = setting("${oc.select:eval.max_new_tokens,null}",
                                         "new tokens per request the calibration is for, by default eval's "
                                         "max_new_tokens (the requests eval times): it reads each held-out "
                                         "completion's first this many positions, since a request's opening tokens "
                                         "accept differently from its later ones (docs/results.md); null = the "
                                         "whole completions")
    tau_ratios: tuple[float, ...] = setting([0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5],
                                            "tau / T grid, then refined")
    tau_refine: int = setting(5, "points (geometric) between the best ratio's neighbours: one more held-out pass")
    gammas: tuple[int, ...] = setting([1, 2, 3, 4, 5, 6, 7, 8], "fixed draft lengths gamma compared")
    draft_length: DraftLengthSettings = group(DraftLengthSettings, "the confidence policy "
                                              "(pipeline/decoding/draft_length.py) at these settings, per domain")
    tree_samples: int = setting(8, "sampled serving: Monte Carlo draws per held-out position for the sibling "
                                "acceptance of token trees (distill/tree_choice.py); 0 = chains only when sampling")
    cost: CostSettings = group(CostSettings, "the device's cost profile: c = draft step / target step and the "
                               "target's verify cost per gamma (Leviathan et al. 2023, Thm 3.8, verify as measured)")
    engines: tuple[str, ...] = setting([], "serving engines to calibrate the export for too (ENGINES): hf times HF "
                                       "assisted generation; llamacpp builds llama.cpp and prices its passes with "
                                       "llama-bench; vllm / sglang / trtllm are planned with calibrate.gpu")
    batch_sizes: tuple[int, ...] | None = setting([], "batch sizes to calibrate gamma for (distill/batch_sizes.py), e.g. "
                                           "[1,2,4,8,16]; [] or null = skip (about a minute on 2 cores)")
    hf: HfCalibrationSettings = group(HfCalibrationSettings, "HF assisted generation (engines=[hf])")
    gpu: GpuCalibrationSettings = group(GpuCalibrationSettings, "vLLM (draft_model), SGLang (STANDALONE), "
                                        "TensorRT-LLM (Draft_Target): a fixed k per pass")
    llamacpp: LlamaCppCalibrationSettings = group(LlamaCppCalibrationSettings, "the llama.cpp drafting settings "
                                                  "compared per domain (distill/engines.py)")

    def __post_init__(self):
        if self.batch_sizes is None:  # null = skip, as an empty list
            object.__setattr__(self, "batch_sizes", ())
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise PipelineError(f"calibrate.batch_sizes={list(self.batch_sizes)} must be integers >= 1: use "
                                "e.g. [1,2,4,8,16], or [] to skip the per-batch-size calibration")
        KeepBest(self.keep_best, self.keep_best_rule)  # checks the rule
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown:
            raise PipelineError(f"calibrate.engines={list(self.engines)} names unknown engines {unknown}: "
                                f"use a list from {', '.join(ENGINES)} (our decoder is always calibrated)")
        tokens = self.request_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise PipelineError(f"calibrate.request_tokens={tokens!r} is not a count >= 1: use e.g. 128, or null for "
                                "the whole held-out completions")
        samples = self.tree_samples
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise PipelineError(f"calibrate.tree_samples={samples!r} is not a count >= 0: use e.g. 8, or 0 "
                                "for chains only when sampling")


register("calibrate", CalibrationSettings)
