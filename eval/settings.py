"""The eval stage's settings (`eval.*`), declared once: each field's default, type and help, registered as the
structured config `eval/default`; checked and normalised in `__post_init__` (TRL's `XConfig` pattern) before any model
loads; what needs files or models is checked where the drafts load (eval/drafts.py). Output: ${paths.eval}/
{metrics.json, report.md, requests.jsonl, *.png}. Normalising is idempotent, so `dataclasses.replace` works.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.decoding import POLICIES, DraftLength, DraftPlan, GuardSettings, parse_tree
from pipeline.errors import PipelineError
from pipeline.settings import build, register, setting
from pipeline.sampling import Sampling

ENGINES = ("ours", "hf", "llamacpp", "vllm")  # eval/baselines.py hf_engine_methods, eval/engine_llamacpp.py, eval/engine_vllm.py
HF_METHODS = ("hf_generate", "hf_assisted", "hf_assisted_fixed", "hf_assisted_calibrated")  # eval/baselines.py
DRAFTINGS = ("calibrated", "uncalibrated", "chain", "off", *POLICIES)  # eval.drafting's names
RESERVED = ("init", "fixed", "confidence", "heuristic", "unguarded")  # speculative_<these> name other methods: no extra draft's name


# The numeric settings' rules: key (stall.<knob>: inside eval.stall) -> (integer?, least, exclusive?, nullable?, e.g.)
NUMBERS = {"max_new_tokens": (True, 1, False, False, 64), "sweep_prompts_per_domain": (True, 1, False, False, 1),
           "warmup_tokens": (True, 1, False, False, 8), "max_prompts_per_domain": (True, 1, False, True, 8),
           "fidelity_prompts_per_domain": (True, 0, False, True, 1), "min_requests_for_ci": (True, 2, False, False, 8),
           "draft_temperature": (False, 0, False, True, 0.6), "max_minutes": (False, 0, True, True, 4),
           "stall.factor": (False, 1, True, True, 3), "stall.retimes": (True, 0, False, False, 2),
           "stall.agree": (False, 1, True, False, 1.25)}


def _bad(key: str, value, problem: str, fix: str):
    raise PipelineError(f"eval.{key}={value!r} {problem}: {fix}")


def _check_number(key: str, value) -> None:
    integer, least, exclusive, nullable, example = NUMBERS[key]
    if value is None and nullable:
        return
    if (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
            or value < least or (exclusive and value == least)):
        _bad(key, value, f"is not {'an integer' if integer else 'a number'} {'>' if exclusive else '>='} {least}",
             f"use e.g. eval.{key}={example}" + (", or null" if nullable else ""))


def _names(key: str, value, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """true = all of `known`, false/null = none, a list = those (each one of `known`)."""
    if isinstance(value, bool) or value is None:
        return known if value else ()
    if not isinstance(value, (list, tuple)) or not set(value) <= set(known):
        _bad(key, value, f"names an unknown {what}", f"use true, false or a list from {', '.join(known)}")
    return tuple(value)


@dataclass(frozen=True)
class EvalSettings:
    """`eval.*` of the composed config, checked and normalised (see the module docstring)."""
    draft: str | None = setting(None, "null = ${paths.draft} (the export; falls back to a derived draft, or the "
                                "preset's pretrained draft, when missing); a model directory; or `derive`")
    draft_init: str | None = setting(None, "the undistilled draft for before/after: null = ${paths.draft_init} when it "
                                     "exists; a dir; a .gguf (engine=llamacpp, e.g. a published draft); or `none`")
    prompts_file: str | None = setting(None, "a JSONL in the prompt schema or Spec-Bench's question.jsonl; null = the "
                                       "prepare stage's eval split; heldout = the train prompts of the draft's "
                                       "reporting part (measured where the calibration predicted, not trained on)")
    domains: Any = setting(None, "keep only these domains, e.g. [code, math] or code; null = all")
    max_prompts_per_domain: int | None = setting(None, "null = all: max_minutes, not a count, decides how many run, so "
                                                 "a faster machine buys narrower intervals; domains are interleaved")
    max_new_tokens: int = setting(64, "tokens generated per request (one user turn): every method's first pass is the "
                                  "same plain prefill, which pulls a short request's speedup toward 1; 64 leaves "
                                  "dozens of verify passes, so it measures decoding rather than prefill")
    max_minutes: float | None = setting(5, "no prompt starts that would end past this (at the mean prompt time so far; "
                                        "each domain's first always runs); null = no limit; stage=all lowers it")
    min_requests_for_ci: int = setting(8, "a domain's intervals need this many requests, else its point estimate with "
                                       "'no CI': a bootstrap over n requests has at most C(2n-1, n) distinct resamples "
                                       "(10 at n=3, 6,435 at n=8), so below ~8 its '95%' covers far less")
    temperature: float = setting("${collect.temperature}", "serving temperature of target and draft; 0 = greedy")
    top_k: int = setting("${collect.top_k}", "serving top-k; 0 = off")
    top_p: float = setting("${collect.top_p}", "serving top-p; 1 = off")
    drafting: Any = setting("calibrated", "what every draft drafts, per domain by SpeculativeSpec.plan: calibrated = "
                            "speculative.json's recipe (a chain of 4 without one) | uncalibrated = a chain of 4 at the "
                            "target's temperature, no guard | chain = the calibrated chain, no trees | off | an int "
                            "gamma | fixed | confidence | heuristic | {policy, max, threshold} | branching factors "
                            "such as [3,2,1]")
    compare_draft_lengths: Any = setting(False, "also run each policy (true: fixed, confidence, heuristic; or a list) "
                                         "side by side, chains only: methods speculative_<policy>")
    draft_temperature: float | None = setting(None, "the draft's tau; null = calibrated when sampling, else the "
                                              "target's temperature")
    use_vocab_subset: bool = setting(True, "restrict the draft head to speculative.json's vocab_subset (FR-Spec)")
    baselines: Any = setting(False, "also time HF peers (HF_METHODS): true = all, or a list; off by default: it "
                             "triples eval time on a CPU (experiment=compare-hf)")
    baselines_draft: str = setting("speculative", "the draft HF assisted uses: speculative | speculative_init | "
                                   "speculative_<name> of extra_drafts")
    extra_drafts: dict[str, str] = setting({}, "{name: model dir | pretrained}: more drafts, methods "
                                           "speculative_<name>, each with its own calibration")
    gammas: tuple[int, ...] = setting([], "the gamma sweep's lengths; [] = off (calibrate already prices every gamma; "
                                      "experiment=compare-drafting runs one)")
    trees: Any = setting([], "the tree sweep's branching factors, e.g. [[1,1,1],[3,2,1]]; [] = off")
    batch_sizes: tuple[int, ...] = setting([], "batched speculation against batched plain decoding at each B on the "
                                           "sweep prompts' first turns, beside the prediction; [] = off")
    sweep_prompts_per_domain: int = setting(1, "prompts per domain (all their turns) the sweeps run on")
    fidelity_prompts_per_domain: int | None = setting(1, "when sampling: greedy spec-vs-AR token match on this many "
                                                      "prompts; 0 = off")
    fp32_recheck: bool = setting(True, "greedy mismatches in bf16/fp16: rerun those requests with fp32 copies")
    control_band: tuple[float, ...] = setting([0.8, 1.25], "pre-registered, never tuned on results: a request whose "
                                              "control pair (own plain vs HF generate, the same computation) differ in "
                                              "tokens/s beyond this ratio was disturbed; symmetric in log space")
    warmup_tokens: int = setting(8, "untimed warm-up generation per method before measuring")
    stall: dict[str, Any] = setting({"factor": 3.0, "retimes": 2, "agree": 1.25}, "pre-registered (eval/harness.py): "
                                    "a request is a suspect when a method's seconds per token exceed `factor` x its "
                                    "own median over the run (null = off); re-timed up to `retimes` times, the first "
                                    "clean re-time, or one within `agree` of the first, replaces it; still stalled: "
                                    "kept out of every figure, the unfiltered overall beside it")
    engine: str = setting("ours", "ours (this project's decoder, the exactness reference) | hf | llamacpp "
                          "(llama-server from engines.llamacpp) | vllm (speculative.json engines.vllm)")
    guard: dict[str, Any] = setting(
        {"enabled": True, "compare": False, "window": 16, "prior_passes": 4, "probe_every": 8, "margin": 0.0,
         "longest": 8, "measure_every": 32}, "the online guard (pipeline/decoding/guard.py, GuardSettings' knobs): per "
        "pass it prices every draft length with the running acceptance and drafts fewer, or none, while the plan is "
        "predicted to lose; lossless. compare = also run speculative_unguarded")

    @classmethod
    def from_config(cls, eval_cfg: DictConfig) -> EvalSettings:
        """The settings of `cfg.eval` (interpolations resolved)."""
        return build(cls, OmegaConf.to_container(eval_cfg, resolve=True), "eval", "eval/settings.py")

    def __post_init__(self):
        try:
            self.sampling  # noqa: B018  (validates the serving distribution)
        except PipelineError as e:  # the core names the field; prefix it with where it is set
            raise PipelineError(f"eval.{e}") from None
        self._check_counts()
        self._check_control_band()
        self._check_stall()
        self._check_drafting()
        self._check_methods()
        self._check_guard()

    @property
    def sampling(self) -> Sampling:
        """The serving distribution every method samples from."""
        return Sampling(self.temperature, self.top_k, self.top_p)

    def _normalise(self, key: str, value) -> None:
        object.__setattr__(self, key, value)  # frozen: validation is the one place that may set a field

    def _check_counts(self) -> None:
        for key, example in (("gammas", "[1,2,4,6,8]"), ("batch_sizes", "[1,2,4,8]")):
            values = list(getattr(self, key) or [])
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                _bad(key, values, "holds a value < 1",
                     f"list integers >= 1, e.g. eval.{key}={example}, or [] for no sweep")
            self._normalise(key, tuple(values))
        for key in NUMBERS:
            if not key.startswith("stall."):
                _check_number(key, getattr(self, key))

    def _check_control_band(self) -> None:
        band = self.control_band
        if (not isinstance(band, (list, tuple)) or len(band) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in band)
                or not 0 < band[0] < 1 < band[1]):
            _bad("control_band", band, "is not a band [low, high] with 0 < low < 1 < high",
                 "use e.g. eval.control_band=[0.8,1.25] (fix it before the run)")
        self._normalise("control_band", (float(band[0]), float(band[1])))

    def _check_stall(self) -> None:
        rule = dict(self.stall or {})
        if set(rule) != {"factor", "retimes", "agree"}:
            _bad("stall", self.stall, "is not {factor, retimes, agree}", "give every key of eval.stall (eval/settings.py)")
        for knob in ("factor", "retimes", "agree"):
            _check_number(f"stall.{knob}", rule[knob])
        self._normalise("stall", rule)

    def _check_drafting(self) -> None:
        self._normalise("compare_draft_lengths", _names("compare_draft_lengths", self.compare_draft_lengths,
                                                        POLICIES, "policy"))
        self._check_drafting_value()
        trees = list(self.trees or [])
        if any(not isinstance(tree, (list, tuple)) or not all(isinstance(b, int) for b in tree) for tree in trees):
            _bad("trees", trees, "holds something other than branching factors",
                 "use e.g. eval.trees=[[1,1,1],[2,1],[3,2,1]]")
        self._normalise("trees", tuple(tuple(tree) for tree in trees))
        for tree in self.trees:
            parse_tree(tree)

    def _check_drafting_value(self) -> None:
        """eval.drafting: a name of DRAFTINGS, an int γ >= 1, branching factors (a tuple after this) or a policy
        {policy, max, threshold}; anything else one line."""
        value = self.drafting
        fix = (f"use one of {', '.join(DRAFTINGS)}, a γ such as eval.drafting=4, branching factors such as "
               "eval.drafting=[3,2,1], or {policy: confidence, max: 16, threshold: 0.4}")
        try:
            if isinstance(value, (list, tuple)):
                DraftPlan(tuple(value))  # a zero factor or too many nodes: one line
                self._normalise("drafting", tuple(value))
            elif isinstance(value, dict):
                DraftLength.from_dict(value)
            elif isinstance(value, bool) or not (value in DRAFTINGS or isinstance(value, int)):
                _bad("drafting", value, "is not a drafting", fix)
            elif isinstance(value, int):
                DraftPlan(value)
        except PipelineError as e:
            if str(e).startswith("eval.drafting"):
                raise
            _bad("drafting", value, f"is invalid ({e})", fix)

    def _check_methods(self) -> None:
        if self.engine not in ENGINES:
            _bad("engine", self.engine, "is not an engine eval runs in",
                 f"use one of {', '.join(ENGINES)} (vllm needs CUDA and `pip install vllm`)")
        if self.engine == "hf":  # HF assisted generation runs chains of the calibrated policy, nothing else
            for key, off in (("trees", "[]"), ("batch_sizes", "[]"), ("compare_draft_lengths", "false"),
                             ("baselines", "false")):
                if getattr(self, key):
                    _bad(key, getattr(self, key), "runs in this project's decoder, not in HF generate",
                         f"set eval.{key}={off} with eval.engine=hf")
        self._normalise("extra_drafts", dict(self.extra_drafts or {}))
        for name in self.extra_drafts:
            if name in RESERVED or not str(name).isidentifier():
                raise PipelineError(f"eval.extra_drafts.{name}: a draft name must be an identifier other than "
                                    f"{', '.join(RESERVED)} (it names the method speculative_<name>)")
        loadable = ("speculative", "speculative_init", *(f"speculative_{name}" for name in self.extra_drafts))
        if self.baselines_draft not in loadable:
            _bad("baselines_draft", self.baselines_draft, "is not a draft eval loads", f"use one of {', '.join(loadable)}")
        self._normalise("baselines", _names("baselines", self.baselines, HF_METHODS, "baseline"))
        if isinstance(self.domains, str):
            self._normalise("domains", (self.domains,))
        elif self.domains is not None:
            self._normalise("domains", tuple(self.domains))

    @property
    def guard_settings(self) -> GuardSettings | None:
        """The guard's knobs when eval.guard.enabled, else None (speculation as planned, never switched down)."""
        knobs = {k: v for k, v in self.guard.items() if k not in ("enabled", "compare")}
        return GuardSettings(**knobs) if self.guard["enabled"] else None

    def _check_guard(self) -> None:
        values = dict(self.guard or {})
        missing = sorted({"enabled", "compare", *(f.name for f in fields(GuardSettings))} - set(values))
        if missing:
            _bad("guard", self.guard, f"lacks {missing}", "give every key of eval.guard (eval/settings.py)")
        for key in ("enabled", "compare"):
            if not isinstance(values.get(key), bool):
                _bad(f"guard.{key}", values.get(key), "is not true or false", f"set eval.guard.{key}: true or false")
        try:
            GuardSettings.from_dict({k: v for k, v in values.items() if k not in ("enabled", "compare")})
        except PipelineError as e:  # the core names the knob; prefix it with where it is set
            raise PipelineError(f"eval.{e}") from None
        self._normalise("guard", values)


def check_settings(cfg: DictConfig) -> None:
    """`eval.*` checked before any stage runs (pipeline/__main__.py)."""
    EvalSettings.from_config(cfg.eval)


register("eval", EvalSettings)
