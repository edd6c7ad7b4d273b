"""The distill stage's settings (`distill.*`): one frozen dataclass per group of conf/distill/default.yaml (whose
comments say what each key does) and of conf/calibrate/default.yaml (the calibrate stage's group, the `calibration`
field), built by `DistillSettings.from_config(cfg, stage)`, which refuses a missing or an
unknown key, and checked before anything loads (as eval/settings.py); what needs files or models is checked where they
load. `trainer` goes to `transformers.TrainingArguments` by name (which validates it), so it stays a read-only
mapping of which only the keys the stage reads must be there (`TRAINER_READ`). The checkpoint fingerprint
(distill/stage.py) hashes the composed config's groups, not these values.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from types import MappingProxyType, UnionType
from typing import Any, Mapping, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, OmegaConf

from distill.losses import check_loss
from pipeline.errors import PipelineError
from pipeline.control.settings import check_keys

TEACHERS = ("online", "topk")
# The `trainer` keys the stage reads itself (distill/training.py); every other one goes to TrainingArguments as is,
# but for OUR_TRAINER_KEYS, which are not TrainingArguments names (the stage takes them out).
OUR_TRAINER_KEYS = ("max_epochs", "lr_probe", "stop_patience")
# The `distill` groups the calibrate stage reads: the held-out rows (split, heldout), their truncation (objective) and
# the serving sampling; trainer and checkpoint decide only training (dvc.yaml lists exactly these for calibrate).
CALIBRATE_READS = ("objective", "split", "heldout", "serving")
TRAINER_READ = ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "learning_rate",
                *OUR_TRAINER_KEYS)


def _tuple(group, where: str, *keys: str) -> None:
    """The lists `keys` of `group` (at `where`) as tuples; frozen: normalising is the one thing that may set a field."""
    for key in keys:
        value = getattr(group, key)
        if not isinstance(value, (list, tuple)):
            raise PipelineError(f"{where}.{key}={value!r} is not a list: use e.g. {where}.{key}=[1,2]")
        object.__setattr__(group, key, tuple(value))


SERVING = "serving"  # loss_temperature: the serving temperature the draft is tuned for (distill.serving)


def _positive(value) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def loss_temperature(objective: "ObjectiveSettings", serving_temperature: float) -> float:
    """The loss temperature as a number: `serving` is the serving T, and 1 (the models' own distributions) for
    greedy serving, whose acceptance (argmax agreement) has no temperature to match."""
    if objective.loss_temperature != SERVING:
        return float(objective.loss_temperature)
    return float(serving_temperature) if serving_temperature > 0 else 1.0


@dataclass(frozen=True)
class ObjectiveSettings:
    """`distill.objective`: what the draft learns (distill/losses.py); the DistillConfig knobs of that name."""
    loss: str                          # one of distill.losses.LOSSES
    beta: float                        # JSD(β) interpolation (loss=jsd)
    loss_temperature: float | str      # softmax temperature of both models inside the loss; "serving" = the serving T
    teacher: str                       # topk (cached labels) | online (a target forward per batch)
    topk: int                          # k of the labels when the stage computes them
    topk_tail: str                     # bucket | renormalize
    lmbda: float                       # on-policy share of batches (GKD's λ)
    temperature: float                 # sampling temperature of on-policy and seq-KD generation
    seq_kd: bool                       # off-policy batches are the target's own continuations
    hidden_weight: float               # weight of the final-hidden-state recovery loss; 0 = logits only
    freeze_shared: bool                # freeze the embeddings and the (tied) head
    max_prompt_length: int             # prompt tokens kept (the last ones)
    max_completion_length: int         # completion tokens trained on (the first ones)
    max_new_tokens: int | None         # on-policy / seq-KD continuation length; null = the collect's

    def __post_init__(self):
        check_loss(self.loss, self.beta, self.topk_tail, self.teacher)
        if self.teacher not in TEACHERS:
            raise PipelineError(f"unknown distill.objective.teacher={self.teacher!r}: use online or topk")
        if not 0.0 <= float(self.lmbda) <= 1.0:
            raise PipelineError(f"distill.objective.lmbda={self.lmbda} is not a share in [0, 1]: use e.g. 0 or 0.5")
        if float(self.lmbda) > 0 and self.loss == "ce":
            raise PipelineError("on-policy batches (distill.objective.lmbda > 0) are labelled by the target's "
                                "distribution, which loss=ce does not use: pick loss=fkl|rkl|jsd|tvd or set lmbda=0")
        if not float(self.hidden_weight) >= 0.0:
            raise PipelineError(f"distill.objective.hidden_weight={self.hidden_weight} is negative: use 0 (off) or a "
                                "weight > 0 such as 1.0")
        if self.loss_temperature != SERVING and not _positive(self.loss_temperature):
            raise PipelineError(f"distill.objective.loss_temperature={self.loss_temperature!r} is neither "
                                f"a temperature > 0 nor {SERVING!r}: use e.g. 1.0 or serving")


@dataclass(frozen=True)
class SplitSettings:
    """`distill.split`: the held-out prompts and the train share."""
    heldout_fraction: float            # share of each domain's prompts held out
    heldout_max_prompts_per_domain: int | None  # at most this many held out per domain
    train_fraction: float              # share of the train prompts trained on (< 1: a learning-curve point)
    calibration_share: float           # share of the held-out prompts that choose keep_best, τ and γ

    def __post_init__(self):
        if not 0.0 < float(self.heldout_fraction) < 1.0:
            raise PipelineError(f"distill.split.heldout_fraction={self.heldout_fraction} must be in (0, 1): "
                                "use e.g. 0.15")
        if not 0.0 < float(self.calibration_share) < 1.0:
            raise PipelineError(f"distill.split.calibration_share={self.calibration_share} must be in (0, 1): "
                                "use e.g. 0.5")
        if self.train_fraction is not None and not 0.0 < float(self.train_fraction) <= 1.0:
            raise PipelineError(f"distill.split.train_fraction={self.train_fraction} must be in (0, 1]: "
                                "use e.g. 0.25 (a learning-curve point) or 1")


@dataclass(frozen=True)
class CheckpointSettings:
    """`distill.checkpoint`: the checkpoint cadence, resume and the time budget."""
    save_steps: int                    # TrainingArguments.save_steps
    save_total_limit: int              # TrainingArguments.save_total_limit
    logging_steps: int                 # TrainingArguments.logging_steps
    resume: bool                       # continue from the last checkpoint of the same fingerprint
    keep: bool                         # keep the checkpoints once the draft is exported
    max_train_minutes: float | None    # stop (and checkpoint) after this long; null = off


@dataclass(frozen=True)
class HeldoutSettings:
    """`distill.heldout`: the acceptance simulator on the held-out rows (distill/simulator.py)."""
    support: int                       # target tokens kept per position for Σ min(p, q)
    batch_size: int                    # rows per target forward (also of the teacher-label pass)
    eval_steps: int                    # held-out acceptance every N steps
    gamma: int                         # γ of the reported mean accepted length


@dataclass(frozen=True)
class DraftLengthSettings:
    """`calibrate.draft_length`: the confidence-policy settings compared against fixed γ."""
    thresholds: tuple[float, ...]      # stop thresholds
    max_lengths: tuple[int, ...]       # most drafts per target pass

    def __post_init__(self):
        _tuple(self, "calibrate.draft_length", "thresholds", "max_lengths")


@dataclass(frozen=True)
class CostSettings:
    """`calibrate.cost`: the device's cost profile (pipeline/measure/cost_profile.py)."""
    profile: str | None                # a cost_profile.json to calibrate for; null = measure one here
    tokens_fed: tuple[int, ...]        # target forward widths timed
    contexts: tuple[int, ...]          # KV-cache lengths they are timed at
    repeats: int                       # timed rounds
    warmup: int                        # untimed rounds first

    def __post_init__(self):
        _tuple(self, "calibrate.cost", "tokens_fed", "contexts")


@dataclass(frozen=True)
class LlamaCppCalibrationSettings:
    """`calibrate.llamacpp`: the llama.cpp settings compared per domain (distill/engines.py)."""
    n_max: tuple[int, ...]             # --spec-draft-n-max values compared
    p_min: tuple[float, ...]           # --spec-draft-p-min values compared
    margin: float                      # "off" unless the best is predicted above 1 + margin
    repeats: int                       # llama-bench repetitions per measured forward

    def __post_init__(self):
        _tuple(self, "calibrate.llamacpp", "n_max", "p_min")
        if not self.n_max or min(self.n_max) < 1 or not all(0.0 <= p < 1.0 for p in self.p_min) or not self.p_min:
            raise PipelineError(f"calibrate.llamacpp: n_max={list(self.n_max)} must be integers >= 1 and "
                                f"p_min={list(self.p_min)} shares in [0, 1): use e.g. n_max=[1,2,4] p_min=[0.0,0.5]")


@dataclass(frozen=True)
class GpuCalibrationSettings:
    """`calibrate.gpu`: how vLLM, SGLang and TensorRT-LLM are planned (distill/engines.py calibrate_gpu_engines)."""
    gammas: tuple[int, ...]            # num_speculative_tokens values compared
    margin: float                      # "off" unless the best is predicted above 1 + margin
    c: float | None                    # draft step / target step measured on the serving GPU; null = weights ratio
    verify_ratio: float                # a verify pass of up to max(gammas) drafts, in target steps

    def __post_init__(self):
        _tuple(self, "calibrate.gpu", "gammas")
        if not self.gammas or min(self.gammas) < 1 or (self.c is not None and self.c <= 0) or self.verify_ratio < 1:
            raise PipelineError(f"calibrate.gpu: gammas={list(self.gammas)} must be integers >= 1, c={self.c} "
                                f"> 0 or null, verify_ratio={self.verify_ratio} >= 1: use e.g. gammas=[1,2,4] c=null")


@dataclass(frozen=True)
class HfCalibrationSettings:
    """`calibrate.hf`: HF assisted generation's settings compared and how its passes are timed."""
    gammas: tuple[int, ...]            # num_assistant_tokens values compared (constant schedule)
    margin: float                      # "off" unless the best is predicted above 1 + margin
    prompts: int                       # calibration prompts HF's passes are timed on
    max_new_tokens: int                # tokens per timed request

    def __post_init__(self):
        _tuple(self, "calibrate.hf", "gammas")
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
                                "restore them in conf/calibrate/default.yaml")
        return cls(group.keep_best, group.keep_best_rule)


@dataclass(frozen=True)
class CalibrationSettings:
    """`calibrate.*`: keep_best (both stages) and the serving settings the calibrate stage gives a draft
    (distill/calibrate_stage.py, distill/serving.py)."""
    keep_best: bool                    # export the initial draft unless training raised held-out acceptance
    keep_best_rule: str                # what "raised" means: KEEP_BEST_RULES (distill/simulator.py keep_best)
    draft: str | None                  # calibrate this draft directory alone; null = ${paths.trained}'s two
    speculate_margin: float            # a domain speculates only when predicted above 1 + this; else plain decoding
    calibrate_init: bool               # calibrate ${paths.draft_init} too
    tau_ratios: tuple[float, ...]      # τ / T grid, then refined
    tau_refine: int                    # refinement steps of τ
    gammas: tuple[int, ...]            # fixed draft lengths compared
    draft_length: DraftLengthSettings
    tree_samples: int                  # sampled serving: Monte Carlo draws per position for trees; 0 = chains only
    cost: CostSettings
    engines: tuple[str, ...]           # serving engines to calibrate the export for too (ENGINES)
    batch_sizes: tuple[int, ...]       # batch sizes the draft length is calibrated for (distill/batch_sizes.py); () = skip
    hf: HfCalibrationSettings          # HF assisted generation (engines=[hf])
    gpu: GpuCalibrationSettings        # vLLM, SGLang, TensorRT-LLM (engines=[vllm] / [sglang] / [trtllm])
    llamacpp: LlamaCppCalibrationSettings

    def __post_init__(self):
        if self.batch_sizes is None:  # null = skip, as an empty list
            object.__setattr__(self, "batch_sizes", ())
        _tuple(self, "calibrate", "tau_ratios", "gammas", "engines", "batch_sizes")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise PipelineError(f"calibrate.batch_sizes={list(self.batch_sizes)} must be integers >= 1: use "
                                "e.g. [1,2,4,8,16], or [] to skip the per-batch-size calibration")
        if self.keep_best_rule not in KEEP_BEST_RULES:
            raise PipelineError(f"calibrate.keep_best_rule={self.keep_best_rule!r}: use one of "
                                f"{', '.join(KEEP_BEST_RULES)}")
        unknown = sorted(set(self.engines) - set(ENGINES))
        if unknown:
            raise PipelineError(f"calibrate.engines={list(self.engines)} names unknown engines {unknown}: "
                                f"use a list from {', '.join(ENGINES)} (our decoder is always calibrated)")
        samples = self.tree_samples
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise PipelineError(f"calibrate.tree_samples={samples!r} is not a count >= 0: use e.g. 8, or 0 "
                                "for chains only when sampling")


@dataclass(frozen=True)
class ServingSettings:
    """`distill.serving`: the serving sampling the draft is tuned for; null = the collect manifest's."""
    temperature: float | None
    top_k: int | None
    top_p: float | None


@dataclass(frozen=True)
class DistillSettings:
    """`distill.*` of the composed config, checked and normalised (see the module docstring)."""
    objective: ObjectiveSettings       # what the draft learns (fingerprinted: decides the weights)
    trainer: Mapping[str, Any] | None  # TrainingArguments by name, and OUR_TRAINER_KEYS (fingerprinted); read-only;
                                       #   None in the calibrate stage, which trains nothing (CALIBRATE_READS)
    split: SplitSettings               # held-out prompts and the train share (fingerprinted)
    checkpoint: CheckpointSettings | None  # checkpoint cadence, resume, time budget; None in the calibrate stage
    heldout: HeldoutSettings           # the held-out acceptance simulator
    serving: ServingSettings           # the serving sampling tuned for
    calibration: CalibrationSettings | KeepBest  # `calibrate.*` (the distill stage: keep_best's two keys)

    @classmethod
    def from_config(cls, cfg: DictConfig, stage: str) -> DistillSettings:
        """The settings of `cfg.distill` and `cfg.calibrate` (interpolations resolved): every key of
        conf/distill/default.yaml and conf/calibrate/default.yaml, no other (`trainer` aside: any TrainingArguments
        name). Calibrate's group is the `calibration` field; for the distill stage only the two keys it reads
        (`KeepBest`), so a calibration setting never reruns training, and for the calibrate stage only the distill
        groups it reads (CALIBRATE_READS), so a trainer setting never reruns calibration (dvc.yaml)."""
        if stage == "distill":
            return _build(cls, _group(cfg, "distill"), "distill", built={"calibration": KeepBest.from_config(cfg)})
        calibration = _build(CalibrationSettings, _group(cfg, "calibrate"), "calibrate", "conf/calibrate/default.yaml")
        distill = _group(cfg, "distill", CALIBRATE_READS)
        return _build(cls, distill, "distill", built={"calibration": calibration, "trainer": None, "checkpoint": None})

    def __post_init__(self):
        if self.trainer is None:  # the calibrate stage's settings
            return
        if not isinstance(self.trainer, Mapping):
            raise PipelineError(f"distill.trainer={self.trainer!r} is not a group of settings: restore it from "
                                "conf/distill/default.yaml")
        object.__setattr__(self, "trainer", MappingProxyType(dict(self.trainer)))  # read-only, a copy of conf's
        missing = [key for key in TRAINER_READ if key not in self.trainer]
        if missing:
            raise PipelineError(f"distill setting(s) {', '.join(f'distill.trainer.{key}' for key in missing)} missing "
                                "from the composed config: restore them in conf/distill/default.yaml")
        if not self.trainer["max_steps"] and not self.trainer["max_epochs"]:
            raise PipelineError("distill.trainer.max_steps and distill.trainer.max_epochs are both null: "
                                "set at least one")
        _check_trainer_numbers(self.trainer)
        _check_lr_probe(self.trainer["lr_probe"])
        patience = self.trainer["stop_patience"]
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
            raise PipelineError(f"distill.trainer.stop_patience={patience!r} is not a count >= 1: use e.g. 2, or null to "
                                "train to the budget")

    def to_dict(self) -> dict:
        """The settings as plain containers, the shape of conf/distill/default.yaml."""
        return _plain(self)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# trainer keys TrainingArguments takes without a range check (a negative rate trains backwards, in silence):
# (key, accepted, what to use); null passes where the stage gives null a meaning
TRAINER_RANGES = (
    ("learning_rate", lambda v: _number(v) and v > 0, "a step size > 0, e.g. 3e-3"),
    ("per_device_train_batch_size", _count, "a count >= 1, e.g. 8"),
    ("gradient_accumulation_steps", _count, "a count >= 1, e.g. 1"),
    ("max_steps", lambda v: v is None or _count(v), "a count >= 1, or null to train max_epochs passes"),
    ("max_epochs", lambda v: v is None or (_number(v) and v > 0), "a number of passes > 0, or null"),
    ("warmup_steps", lambda v: _number(v) and v >= 0, "steps >= 0 (a share of the steps when < 1)"),
    ("weight_decay", lambda v: _number(v) and v >= 0, "a decay >= 0, e.g. 0.0"),
    ("max_grad_norm", lambda v: _number(v) and v > 0, "a norm > 0, e.g. 1.0"),
)


def _check_trainer_numbers(trainer: Mapping) -> None:
    for key, accepted, hint in TRAINER_RANGES:
        if key in trainer and not accepted(trainer[key]):
            raise PipelineError(f"distill.trainer.{key}={trainer[key]!r} is out of range: use {hint}")


def _check_lr_probe(probe) -> None:
    """`distill.trainer.lr_probe`: null, or {factors: shares of learning_rate in (0, 1], steps: >= 1}."""
    if probe is None:
        return
    factors = probe.get("factors") if isinstance(probe, Mapping) else None
    steps = probe.get("steps") if isinstance(probe, Mapping) else None
    if (not isinstance(probe, Mapping) or set(probe) != {"factors", "steps"} or not isinstance(factors, (list, tuple))
            or not factors or not all(isinstance(f, (int, float)) and 0 < f <= 1 for f in factors)
            or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise PipelineError(f"distill.trainer.lr_probe={probe!r} must be null or {{factors: shares of learning_rate in "
                            "(0, 1], steps: >= 1}: use e.g. distill.trainer.lr_probe.factors=[1.0,0.1,0.01]")


def _group(cfg: DictConfig, name: str, keys: tuple[str, ...] | None = None):
    """The group `name` as plain containers; with `keys`, only those of its sub-groups (reading no other)."""
    if name not in cfg:
        raise PipelineError(f"the composed config has no `{name}` group: restore conf/{name}/default.yaml and its line "
                            "in conf/config.yaml's defaults")
    if keys is None:
        return OmegaConf.to_container(cfg[name], resolve=True)
    group = cfg[name]  # a key it lacks is left out, for _build's check_keys to name
    return {key: OmegaConf.to_container(group[key], resolve=True) if isinstance(group[key], DictConfig) else group[key]
            for key in keys if key in group}


def _build(cls, values, where: str, source: str = "conf/distill/default.yaml", built: dict | None = None):
    """`cls` from the mapping `values` at `where` (e.g. calibrate.cost), declared in `source`: every field's key, no
    other, but the fields `built` gives; a dataclass-typed field from its own sub-mapping."""
    if not isinstance(values, dict):
        raise PipelineError(f"{where}={values!r} is not a group of settings: restore it from {source}")
    built = built or {}
    names = [f.name for f in fields(cls) if f.name not in built]
    check_keys(values, names, where, source)
    types = {name: _settings_type(hint) for name, hint in get_type_hints(cls).items()}
    return cls(**built, **{name: _build(types[name], values[name], f"{where}.{name}", source)
                           if is_dataclass(types[name]) else values[name] for name in names})


def _settings_type(hint):
    """`X | None` -> X, so an optional group of settings is built as its dataclass where it is given."""
    args = [arg for arg in get_args(hint) if arg is not type(None)]
    return args[0] if get_origin(hint) in (Union, UnionType) and len(args) == 1 else hint


def _plain(value):
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def check_settings(cfg: DictConfig) -> None:
    """`distill.*` and `calibrate.*` checked as the stages build them first, before any row or model loads
    (pipeline/__main__.py runs it before any stage): the distill or the calibrate stage alone checks what it reads;
    a run of several stages checks both."""
    stage = cfg.get("stage")
    for reader in (stage,) if stage in ("distill", "calibrate") else ("distill", "calibrate"):
        DistillSettings.from_config(cfg, reader)
