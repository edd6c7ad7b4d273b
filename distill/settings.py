"""The distill stage's settings (`distill.*`), declared once: one frozen dataclass per group, each field with its
default, type and help (pipeline/settings.py), registered as Hydra's structured config `distill/default`; calibrate's
groups are in distill/calibrate_settings.py. `DistillSettings.from_config(cfg, stage)` builds the checked instance
for either stage before anything loads (as eval/settings.py); what needs files or models is checked where they load.
`trainer` goes to `transformers.TrainingArguments` by name (which validates it further) as a read-only mapping. The
checkpoint fingerprint (distill/stage.py) hashes the composed config's groups, not these values.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from distill.calibrate_settings import DECLARED as CALIBRATE_DECLARED, CalibrationSettings, KeepBest
from distill.losses import check_loss
from pipeline.errors import PipelineError
from pipeline.settings import build, check_keys, group, register, setting

TEACHERS = ("online", "topk")
# The `trainer` keys the stage reads itself (distill/training.py); every other one goes to TrainingArguments as is,
# but for OUR_TRAINER_KEYS, which are not TrainingArguments names (the stage takes them out).
OUR_TRAINER_KEYS = ("max_epochs", "lr_probe", "stop_patience")
# The `distill` groups the calibrate stage reads: the held-out rows (split, heldout), their truncation (objective) and
# the serving sampling; trainer and checkpoint decide only training (dvc.yaml lists exactly these for calibrate).
CALIBRATE_READS = ("objective", "split", "heldout", "serving")
DECLARED = "distill/settings.py"
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
    """`distill.objective`: what the draft learns (distill/losses.py); p = target, q = draft."""
    loss: str = setting("fkl", "fkl | rkl | jsd | tvd | lk_alpha | lk_lambda | ce | top1. fkl: of fkl, ce and tvd it "
                        "gains the most acceptance per step in a short CPU run (docs/results.md); tvd (= 1 - acceptance) "
                        "has weak gradients early on, which the LK losses (arXiv 2602.23881) are built to avoid; top1 = "
                        "-log q(target argmax), what greedy serving accepts")
    beta: float = setting(0.5, "JSD(beta) interpolation, loss=jsd only (GKD, Agarwal et al. 2024); 0.5 = symmetric JS")
    loss_temperature: Any = setting(1.0, "softmax temperature of both models inside the loss (not ce); 1 = the models' "
                                    "own distributions, where the cached top-k labels are exact; serving = the "
                                    "serving temperature (1 when greedy), the distribution acceptance is measured at")
    teacher: str = setting("topk", "topk: collect's cached top-k labels (computed here once if absent) | online: a "
                           "target forward per batch (exact, one target forward per step)")
    topk: int = setting(32, "k when the labels are computed here; collect.topk's default")
    topk_tail: str = setting("bucket", "bucket: the tail is one 'other' class (exact on k+1 classes at T=1, reverse KL "
                             "stays finite) | renormalize: the top-k renormalised")
    lmbda: float = setting(0.0, "on-policy share: batches the draft continues itself, labelled by the target (GKD's "
                           "lambda); 0 = off-policy only")
    temperature: float = setting(1.0, "sampling temperature of on-policy and seq-KD generation")
    seq_kd: bool = setting(False, "the other batches are continuations the target generates (Kim & Rush 2016); false: "
                           "the collected rows already are the target's own continuations")
    hidden_weight: float = setting(0.0, "weight of a recovery loss on the head's input, ||h_q - h_p||^2 / ||h_p||^2 "
                                   "per position against collect.hidden_states (as EAGLE, Li et al. 2024); 0 = logits only")
    freeze_shared: bool = setting(False, "freeze the embeddings and (tied) head; training them gains acceptance at equal "
                                  "steps (docs/results.md)")
    max_prompt_length: int = setting(384, "prompt tokens kept (the last ones: the context nearest the completion)")
    max_completion_length: int = setting(256, "completion tokens trained on (the first ones); above collect's "
                                         "max_new_tokens, so the default run trains on whole completions")
    max_new_tokens: int | None = setting(None, "length of on-policy and seq-KD continuations; null = collect's "
                                         "max_new_tokens")

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
    heldout_fraction: float = setting(0.15, "share of each domain's prompts held out (at least one where a domain has "
                                      "two or more)")
    heldout_max_prompts_per_domain: int | None = setting(40, "at most this many held out per domain (null = no cap): "
                                                         "enough positions for the acceptance estimates")
    train_fraction: float = setting(1.0, "share of the train prompts trained on, nested (a smaller share's prompts are "
                                    "among a larger one's); < 1 = a learning-curve point (experiment=curve)")
    calibration_share: float = setting(0.5, "of the held-out prompts, those keep_best, tau and gamma are chosen on; the "
                                       "rest (the reporting part) gives speculative.json's numbers, free of that choice")

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
    save_steps: int = setting(50, "a checkpoint every N steps: a crash loses at most N steps")
    save_total_limit: int = setting(1, "checkpoints kept: a resume needs only the last")
    logging_steps: int = setting(10, "training loss logged every N steps")
    resume: bool = setting(True, "continue from the last checkpoint of the same fingerprint")
    keep: bool = setting(False, "keep the checkpoints once the draft is exported; false frees the disk")
    max_train_minutes: float | None = setting(4.5, "stop (and checkpoint) after this long: the default run's budget; "
                                              "null = off")


@dataclass(frozen=True)
class HeldoutSettings:
    """`distill.heldout`: the acceptance simulator on the held-out rows (distill/simulator.py)."""
    support: int = setting(128, "target tokens kept per position for sum min(p, q) (the tail bound is printed)")
    batch_size: int = setting(8, "rows per target forward on the held-out rows and the teacher-label pass")
    eval_steps: int = setting(50, "held-out acceptance every N steps (the learning curve, one pass over the reporting "
                              "part), logged to MLflow")
    gamma: int = setting(4, "gamma of the reported mean accepted length; eval.drafting=uncalibrated uses it too")


@dataclass(frozen=True)
class ServingSettings:
    """`distill.serving`: the serving sampling the draft is tuned for; null = the collect manifest's."""
    temperature: float | None = setting(None, "null = the collect manifest's: the sampling the rows were generated with")
    top_k: int | None = setting(None, "null = the collect manifest's")
    top_p: float | None = setting(None, "null = the collect manifest's")


@dataclass(frozen=True)
class LrProbeSettings:
    """`distill.trainer.lr_probe`: the step size fitted to the draft brought."""
    factors: tuple[float, ...] = setting([1.0, 0.1, 0.01], "shares of learning_rate tried, largest first, `steps` steps "
                                         "each from the initial weights, judged by held-out acceptance (keep_best's "
                                         "measure); training goes on at the first that beats the initial weights, or "
                                         "not at all. A stub takes the full rate, a pretrained draft 10-100x less, a "
                                         "draft equal to its target none (docs/results.md)")
    steps: int = setting(10, "steps per share tried")


@dataclass(frozen=True)
class TrainerSettings:
    """`distill.trainer`: transformers.TrainingArguments by name (the stage adds the output dir, seeds, device and the
    columns its collator needs), but max_epochs, lr_probe and stop_patience (OUR_TRAINER_KEYS), which are ours."""
    max_steps: int | None = setting(400, "optimizer steps (the default run's; checkpoint.max_train_minutes caps the "
                                    "time) ...")
    max_epochs: float | None = setting(6, "... or this many passes over the train rows if fewer: more passes over the "
                                       "default collect's rows no longer raise held-out acceptance")
    learning_rate: float = setting(3.0e-3, "the largest step size tried: the best of the rates compared on short runs "
                                   "for the default 2-layer draft; lr_probe lowers it for a better draft")
    lr_probe: LrProbeSettings | None = group(LrProbeSettings, "null = train at learning_rate")
    stop_patience: int | None = setting(2, "stop after this many held-out evaluations in a row (heldout.eval_steps "
                                        "apart) below the best so far, initial weights included, and keep the best "
                                        "weights; null = train to the budget")
    weight_decay: float = setting(0.0, "none (TrainingArguments' default)")
    warmup_steps: float = setting(15, "steps, or a share of the steps when < 1: a few percent of max_steps")
    lr_scheduler_type: str = setting("cosine", "decays to 0 at the step budget, known before training starts")
    max_grad_norm: float = setting(1.0, "gradient clipping (TrainingArguments' default)")
    per_device_train_batch_size: int = setting(8, "rows per step (TrainingArguments' default)")
    gradient_accumulation_steps: int = setting(1, "1 = one batch per optimizer step")
    train_sampling_strategy: str = setting("group_by_length", "similar lengths per batch: less padding")
    dataloader_num_workers: int = setting(0, "rows are collated in the main process: workers would compete for the "
                                          "same cores")
    bf16: Any = setting("auto", "bf16 autocast over fp32 master weights; auto = when serving in bf16 (runtime.dtype)")
    extra: dict[str, Any] = setting({}, "any other TrainingArguments by name, e.g. {optim: adafactor}")


@dataclass(frozen=True)
class DistillGroup:
    """`distill.*`: the groups objective, trainer and split decide the trained weights (the checkpoint directory is
    named by their hash, with the data and the draft, so a resume only continues the same training); the others watch
    or follow training and may change between a crash and its resume."""
    objective: ObjectiveSettings = group(ObjectiveSettings, "what the draft learns (fingerprinted)")
    trainer: TrainerSettings = group(TrainerSettings, "TrainingArguments and ours (fingerprinted)")
    split: SplitSettings = group(SplitSettings, "held-out prompts per domain, by hash of the prompt id (fingerprinted)")
    checkpoint: CheckpointSettings = group(CheckpointSettings, "${paths.artifacts}/distill_ckpt/<fingerprint>/: "
                                           "cadence, resume, the time budget")
    heldout: HeldoutSettings = group(HeldoutSettings, "the acceptance simulator on held-out rows (distill/simulator.py)")
    serving: ServingSettings = group(ServingSettings, "the serving sampling the draft is tuned for")


@dataclass(frozen=True)
class DistillSettings(DistillGroup):
    """`distill.*` of the composed config, checked and normalised, with `calibration`, calibrate's settings (see the
    module docstring); `trainer` a read-only mapping of TrainingArguments names and ours, None with `checkpoint` in
    the calibrate stage, which trains nothing (CALIBRATE_READS)."""
    calibration: CalibrationSettings | KeepBest | None = None

    @classmethod
    def from_config(cls, cfg: DictConfig, stage: str) -> DistillSettings:
        """The settings of `cfg.distill` and `cfg.calibrate` (interpolations resolved). Calibrate's group is the
        `calibration` field; for the distill stage only the two keys it reads (`KeepBest`), so a calibration setting
        never reruns training, and for the calibrate stage only the distill groups it reads (CALIBRATE_READS), so a
        trainer setting never reruns calibration (dvc.yaml)."""
        if stage == "distill":
            values = _group(cfg, "distill")
            trainer = trainer_arguments(values.get("trainer"))
            keep = KeepBest.from_config(cfg)
            return build(cls, values, "distill", DECLARED, built={"calibration": keep, "trainer": trainer})
        calibration = build(CalibrationSettings, _group(cfg, "calibrate"), "calibrate", CALIBRATE_DECLARED)
        distill = _group(cfg, "distill", CALIBRATE_READS)
        return build(cls, distill, "distill", DECLARED,
                     built={"calibration": calibration, "trainer": None, "checkpoint": None})

    def __post_init__(self):
        if self.trainer is None:  # the calibrate stage's settings
            return
        object.__setattr__(self, "trainer", MappingProxyType(dict(self.trainer)))  # read-only, a copy of conf's
        if not self.trainer["max_steps"] and not self.trainer["max_epochs"]:
            raise PipelineError("distill.trainer.max_steps and distill.trainer.max_epochs are both null: "
                                "set at least one")
        _check_trainer_numbers(self.trainer)
        _check_lr_probe(self.trainer["lr_probe"])
        patience = self.trainer["stop_patience"]
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
            raise PipelineError(f"distill.trainer.stop_patience={patience!r} is not a count >= 1: use e.g. 2, or null to "
                                "train to the budget")


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
        raise PipelineError(f"the composed config has no `{name}` group: restore its line in conf/config.yaml's defaults")
    if keys is None:
        return OmegaConf.to_container(cfg[name], resolve=True)
    group = cfg[name]  # a key it lacks is left out, for build's check_keys to name
    return {key: OmegaConf.to_container(group[key], resolve=True) if isinstance(group[key], DictConfig) else group[key]
            for key in keys if key in group}


def trainer_arguments(values) -> dict:
    """`distill.trainer` as one mapping: TrainingArguments names, its `extra` ones among them, and OUR_TRAINER_KEYS."""
    if not isinstance(values, dict):
        raise PipelineError(f"distill.trainer={values!r} is not a group of settings: see {DECLARED}")
    check_keys(values, [f.name for f in fields(TrainerSettings)], "distill.trainer", DECLARED)
    extra = values.get("extra") or {}
    return {**{key: value for key, value in values.items() if key != "extra"}, **extra}


def check_settings(cfg: DictConfig) -> None:
    """`distill.*` and `calibrate.*` checked as the stages build them first, before any row or model loads
    (pipeline/__main__.py runs it before any stage): the distill or the calibrate stage alone checks what it reads;
    a run of several stages checks both."""
    stage = cfg.get("stage")
    for reader in (stage,) if stage in ("distill", "calibrate") else ("distill", "calibrate"):
        DistillSettings.from_config(cfg, reader)


register("distill", DistillGroup)
