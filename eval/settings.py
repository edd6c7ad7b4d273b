"""The eval stage's settings (`eval.*`): one frozen field per key of conf/eval/default.yaml, checked and normalised
in `__post_init__` (TRL's `XConfig` pattern) before any model loads; what needs files or models is checked where the
drafts load (eval/drafts.py). Normalising is idempotent, so `dataclasses.replace` works.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from omegaconf import DictConfig, OmegaConf

from pipeline.decoding import POLICIES, DraftLength, DraftPlan, GuardSettings, parse_tree
from pipeline.errors import PipelineError
from pipeline.control.settings import check_keys
from pipeline.sampling import Sampling

ENGINES = ("ours", "hf", "llamacpp", "vllm")  # eval/baselines.py hf_engine_methods, eval/engine_llamacpp.py, eval/engine_vllm.py
HF_METHODS = ("hf_generate", "hf_assisted", "hf_assisted_fixed", "hf_assisted_calibrated")  # eval/baselines.py
DRAFTINGS = ("calibrated", "uncalibrated", "chain", "off", *POLICIES)  # eval.drafting's names (conf/eval/default.yaml)
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
    draft: str | None                    # the draft evaluated: null = ${paths.draft} (or a fallback), a directory, derive
    draft_init: str | None               # the undistilled draft for before/after: null = ${paths.draft_init}, a dir, none
    prompts_file: str | None             # a prompt-schema or Spec-Bench JSONL; null = the prepare stage's eval split;
                                         #   heldout = the train prompts the draft's calibration reported on
    domains: tuple[str, ...] | None      # keep only these domains; null = all
    max_prompts_per_domain: int | None   # prompts per domain (file order); null = all
    max_new_tokens: int                  # tokens generated per request (one user turn)
    max_minutes: float | None            # no prompt starts that would end past this many minutes; null = no limit
    min_requests_for_ci: int             # a domain's intervals need this many requests; below, point estimates only
    temperature: float                   # the serving temperature of target and draft; 0 = greedy
    top_k: int                           # serving top-k; 0 = off
    top_p: float                         # serving top-p; 1 = off
    drafting: str | int | tuple | dict   # what every draft drafts (one of DRAFTINGS, a γ, branching factors, a policy)
    compare_draft_lengths: tuple[str, ...]  # policies also run side by side (speculative_<policy>); () = none
    draft_temperature: float | None      # the draft's τ; null = calibrated when sampling, else the target's temperature
    use_vocab_subset: bool               # restrict the draft head to speculative.json's vocab_subset (FR-Spec)
    baselines: tuple[str, ...]           # HF peers timed beside ours (of HF_METHODS); () = none
    baselines_draft: str                 # the loaded draft HF assisted generation uses (speculative, speculative_init, ...)
    extra_drafts: dict[str, str]         # {name: model dir | pretrained}: more drafts, methods speculative_<name>
    gammas: tuple[int, ...]              # the γ sweep's draft lengths; () = no sweep
    trees: tuple[tuple[int, ...], ...]   # the tree sweep's branching factors; () = no sweep
    batch_sizes: tuple[int, ...]         # the batch-size sweep's batch sizes; () = no sweep
    sweep_prompts_per_domain: int        # prompts per domain (all their turns) the sweeps run on
    fidelity_prompts_per_domain: int | None  # when sampling: prompts per domain of the greedy fidelity run; 0/null = off
    fp32_recheck: bool                   # rerun reduced-precision greedy mismatches with fp32 model copies
    control_band: tuple[float, float]    # [low, high] tokens/s ratio of the control pair outside which a request is disturbed
    warmup_tokens: int                   # untimed warm-up tokens per method before measuring
    stall: dict                          # the stall rule: {factor (null = off), retimes, agree} (eval/harness.py)
    engine: str                          # where the methods run: one of ENGINES
    guard: dict                          # the online guard: {enabled, compare, GuardSettings' knobs}

    @classmethod
    def from_config(cls, eval_cfg: DictConfig) -> EvalSettings:
        """The settings of `cfg.eval` (interpolations resolved); every key of conf/eval/default.yaml, no other."""
        values = OmegaConf.to_container(eval_cfg, resolve=True)
        check_keys(values, [f.name for f in fields(cls)], "eval", "conf/eval/default.yaml")
        return cls(**values)

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
            _bad("stall", self.stall, "is not {factor, retimes, agree}", "give every key of conf/eval/default.yaml's eval.stall")
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
            _bad("guard", self.guard, f"lacks {missing}", "give every key of conf/eval/default.yaml's eval.guard")
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
