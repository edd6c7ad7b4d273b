"""`cost_profile.json`: how long the target's forward takes per number of tokens fed, and the draft's step,
measured on the machine that will serve, so γ and the predicted speedup are tuned for that machine (schema:
docs/architecture.md, "Cost profile").

The time model (Leviathan et al. 2023, Thm 3.8) needs c = draft step / target 1-token step and the verify ratio
r_γ = the target's (γ+1)-token forward / its 1-token forward (1 in the paper's idealisation; well above 1 on CPUs
whose few-row GEMMs are slow). Both depend on hardware, dtype and threads, not on the weights, so a profile can be
measured with random weights of the right shapes (`random_model`) and checked against the models it serves.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from pipeline.atomic import write_json
from pipeline.errors import PipelineError
from pipeline.heads import head_logits, head_rows
from pipeline.decoding.tree import tree_mask
from pipeline.machine import cpu_name
from pipeline.modelio.models import DTYPES, converted_dir
from pipeline.measure.pass_overhead import measure_host_overhead
from pipeline.sampling import Sampling
from pipeline.timing import synced_clock

VERSION = 1
FILENAME = "cost_profile.json"
CANARY_REPEATS = 5
CANARY_BAND = (0.87, 1.15)  # the 1-token step's drift within a profile beyond which it reads as measured under load
SHAPE_KEYS = ("architecture", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size")
REPO = Path(__file__).resolve().parents[2]
REMEASURE = ("measure one with `python -m pipeline.tools cost-profile tool.target=<dir> tool.draft=<dir>` "
             "(or tool.target_config/tool.draft_config)")


class _Timed:
    """A model on a KV cache prefilled to a fixed length; each timed forward is cropped back to it."""

    def __init__(self, model, rows, context: torch.Tensor):
        self.model, self.rows, self.length = model, rows, context.shape[1]
        self.clock = synced_clock(context.device)
        self.cache = DynamicCache(config=model.config)
        model.model(input_ids=context, cache=self.cache, use_cache=True)

    def __call__(self, tokens: torch.Tensor, tree: bool = False) -> float:
        """Seconds for one forward of `tokens` [1, k] and the head at every fed position (a verify pass needs
        the target's distribution at each of its γ+1 positions). tree: the way a token-tree verify runs it, with
        a 4-D mask and explicit positions (pipeline/decoding/tree.py), which takes another attention path."""
        extra = {}
        if tree and tokens.shape[1] > 1:
            k = tokens.shape[1]
            visible = torch.ones(k - 1, k - 1, dtype=torch.bool, device=tokens.device).tril()
            extra = {"attention_mask": tree_mask(self.length, 1, visible, self.model.dtype),
                     "position_ids": torch.arange(self.length, self.length + k, device=tokens.device).view(1, -1)}
        t0 = self.clock()
        hidden = self.model.model(input_ids=tokens, cache=self.cache, use_cache=True, **extra).last_hidden_state
        head_logits(hidden[0], self.rows).argmax(-1)
        seconds = self.clock() - t0
        self.cache.crop(self.length - self.cache.get_seq_length())  # transformers 5: a negative count drops tokens
        return seconds


def _stats(seconds: list[float]) -> dict:
    ms = sorted(1e3 * s for s in seconds)
    p25, _, p75 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else (ms[0],) * 3
    return {"ms": statistics.median(ms), "p25": p25, "p75": p75}


def _sweep(targets: dict, step: _Timed, fed: torch.Tensor, tokens_fed: list[int], repeats: int, warmup: int):
    """`warmup` untimed rounds, then `repeats` timed ones; each k-token forward comes right after a draft step
    and a 1-token forward at the same context, so slow drift of the machine (other jobs, clocks) lands on both
    sides of each ratio; the same k tokens are then fed as a tree verify (4-D mask). Returns ({context: {k:
    [(1-token s, k-token s)]}}, the same for tree verifies, [draft step s])."""
    pairs = {n: {k: [] for k in tokens_fed} for n in targets}
    trees = {n: {k: [] for k in tokens_fed} for n in targets}
    draft_s = []
    for r in range(warmup + repeats):
        for n, timed in targets.items():
            for k in tokens_fed:
                d, one, many, tree = step(fed[:, :1]), timed(fed[:, :1]), timed(fed[:, :k]), timed(fed[:, :k], True)
                if r >= warmup:
                    draft_s.append(d)
                    pairs[n][k].append((one, many))
                    trees[n][k].append((one, tree))
    return pairs, trees, draft_s


def _row(by_k: dict[int, list[tuple[float, float]]]) -> dict:
    """{k: {ms, p25, p75, ratio}} for one context; the 1-token entry pools every paired 1-token forward."""
    ones = [one for pairs in by_k.values() for one, _ in pairs]
    return {str(k): {**_stats([many for _, many in pairs] + (ones if k == 1 else [])),
                     "ratio": 1.0 if k == 1 else statistics.median(many / one for one, many in pairs)}
            for k, pairs in by_k.items()}


@dataclass(frozen=True)
class CostPlan:
    """How a cost profile is timed: the target forwards of each count in `tokens_fed` at each context length in
    `contexts`, `repeats` paired rounds after `warmup` untimed ones, the draft's step at `draft_context`. conf's
    calibrate.cost is the declaration of the first four (no defaults here)."""
    tokens_fed: tuple[int, ...]
    contexts: tuple[int, ...]
    repeats: int
    warmup: int
    draft_context: int = 64
    seed: int = 0


@torch.no_grad()
def measure_cost_profile(target, draft, vocab: torch.Tensor | None, plan: CostPlan,
                         host_sampling: Sampling | None = None) -> dict:
    """Time the target's forward of each count in `plan.tokens_fed` at each context length and the draft's 1-token
    step through its `vocab` head, interleaved and paired as `_sweep` says, the draft in the target's dtype; with
    `host_sampling` the decoder's host work per pass too (pipeline/measure/pass_overhead.py); the 1-token step again before and
    after everything (`canary`: a ratio far from 1 means other load)."""
    tokens_fed, contexts = sorted({int(k) for k in plan.tokens_fed}), sorted({int(n) for n in plan.contexts})
    repeats, warmup, draft_context, seed = int(plan.repeats), int(plan.warmup), int(plan.draft_context), int(plan.seed)
    if 1 not in tokens_fed or not contexts or min(contexts + [draft_context]) < 1 or repeats < 1:
        raise PipelineError("a cost profile needs 1 in tokens_fed, context lengths ≥ 1 and repeats ≥ 1: got "
                            f"tokens_fed={tokens_fed}, contexts={contexts}, draft_context={draft_context}, "
                            f"repeats={repeats}")
    dtype, device = next(target.parameters()).dtype, next(target.parameters()).device
    if next(draft.parameters()).dtype != dtype:
        draft = copy.deepcopy(draft).to(dtype)
    g = torch.Generator().manual_seed(seed)
    n_vocab = min(target.config.vocab_size, draft.config.vocab_size)
    ids = torch.randint(0, n_vocab, (1, max(contexts + [draft_context]) + max(tokens_fed)), generator=g).to(device)
    targets = {n: _Timed(target, head_rows(target), ids[:, :n]) for n in contexts}
    step = _Timed(draft, head_rows(draft, vocab), ids[:, :draft_context])
    canary = targets[contexts[0]]
    for _ in range(CANARY_REPEATS):  # untimed first: a cold first step (allocator, kernel choice) is not load
        canary(ids[:, :1])
    before = [canary(ids[:, :1]) for _ in range(CANARY_REPEATS)]
    pairs, trees, draft_s = _sweep(targets, step, ids[:, -max(tokens_fed):], tokens_fed, repeats, warmup)
    table = {str(n): _row(by_k) for n, by_k in pairs.items()}
    tree_table = {str(n): _row(by_k) for n, by_k in trees.items()}
    rows = len(vocab) if vocab is not None else draft.config.vocab_size
    profile = {"version": VERSION, "machine": machine(device, dtype),
               "shapes": {"target": shapes_of(target), "draft": shapes_of(draft, rows)},
               "settings": {"tokens_fed": tokens_fed, "contexts": contexts, "draft_context": draft_context,
                            "repeats": repeats, "warmup": warmup, "seed": seed},
               "target": table, "tree_target": tree_table, "draft": {"context": draft_context, **_stats(draft_s)}}
    if host_sampling is not None:
        profile["host"] = measure_host_overhead(target, draft, vocab, host_sampling, plan)
    after = [canary(ids[:, :1]) for _ in range(CANARY_REPEATS)]
    start, end = statistics.median(before) * 1e3, statistics.median(after) * 1e3
    profile["canary"] = {"start_ms": round(start, 3), "end_ms": round(end, 3), "ratio": round(end / start, 3)}
    return profile


def canary_warning(profile: dict) -> str | None:
    """A line saying the profile was measured under changing load (the 1-token step timed before and after the
    whole profile differs by more than CANARY_BAND), else None."""
    ratio = (profile.get("canary") or {}).get("ratio")
    if ratio is None or CANARY_BAND[0] <= ratio <= CANARY_BAND[1]:
        return None
    return (f"the cost profile's canary (the target's 1-token step before and after it) moved {ratio:.2f}×: it was "
            "measured under changing load (another job on these cores?); rerun on a quiet machine for trustworthy "
            "choices")


def machine(device: torch.device, dtype: torch.dtype) -> dict:
    """What the times depend on besides the shapes."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"device": device.type, "device_name": name, "dtype": str(dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "transformers_version": transformers.__version__}


def shapes_of(model, head_rows: int | None = None) -> dict:
    """The sizes that decide a model's step time (a model or its config). `head_rows`: the output head's rows
    as served (an FR-Spec subset size), default the full vocabulary."""
    config = getattr(model, "config", model)
    text = config.get_text_config()
    arch = type(model).__name__ if hasattr(model, "config") else (getattr(config, "architectures", None) or [None])[0]
    out = {"architecture": arch, **{k: getattr(text, k, None) for k in SHAPE_KEYS[1:]}}
    out["head_rows"] = int(head_rows) if head_rows else out["vocab_size"]
    return out


def verify_ratio(profile: dict, gamma: int, kind: str = "target") -> float:
    """r_γ = the target's (γ+1)-token forward / its 1-token forward at the shortest context, interpolated linearly
    between measured token counts and extended along the last segment beyond them; kind "tree_target": the same
    forward run as a tree verify. The measured ratios are clamped to ≥ 1 and made non-decreasing by an isotonic
    fit: feeding more tokens is never cheaper, so a dip is noise."""
    from scipy.optimize import isotonic_regression

    table = profile[kind][str(min(profile["settings"]["contexts"]))]
    ks = sorted(int(k) for k in table)
    rs = isotonic_regression([max(1.0, table[str(k)]["ratio"]) for k in ks]).x.tolist()
    x = gamma + 1
    if len(ks) == 1 or x <= 1:
        return 1.0
    i = next((j for j in range(len(ks) - 1) if x <= ks[j + 1]), len(ks) - 2)
    slope = (rs[i + 1] - rs[i]) / (ks[i + 1] - ks[i])
    return max(1.0, rs[i] + slope * (x - ks[i]))


def c(profile: dict) -> float:
    """Draft step / target 1-token step at the shortest context: Leviathan et al. 2023's c (Thm 3.8)."""
    return profile["draft"]["ms"] / _target_ms(profile)


def _target_ms(profile: dict) -> float:  # the 1-token step at the shortest context
    return profile["target"][str(min(profile["settings"]["contexts"]))]["1"]["ms"]


def summary(profile: dict, max_gamma: int) -> dict:
    """The cost block callers of distill's measure_cost_ratio use: c, verify_ratio {γ: r_γ} for γ =
    1..max_gamma, draft_forward_ms, target_forward_ms."""
    trees = {"tree_verify_ratio": {g: round(verify_ratio(profile, g, kind="tree_target"), 3)
                                   for g in range(1, max_gamma + 1)}} if "tree_target" in profile else {}
    host = {"host": {key: profile["host"][key] for key in ("plain", "chain", "tree")}} if "host" in profile else {}
    canary = {"canary_ratio": profile["canary"]["ratio"]} if "canary" in profile else {}
    return {"c": c(profile), "verify_ratio": {g: round(verify_ratio(profile, g), 3) for g in range(1, max_gamma + 1)},
            **trees, **host, **canary,
            "draft_forward_ms": profile["draft"]["ms"], "target_forward_ms": _target_ms(profile)}


def write_profile(path: str | Path, profile: dict) -> Path:
    validate(profile, str(path))
    write_json(path, profile)
    return Path(path)


def read_profile(path: str | Path, target=None, draft=None, vocab_rows: int | None = None) -> dict:
    """Load and validate a profile; with models (or configs) given, refuse one measured for other shapes."""
    try:
        profile = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot read cost profile {path} ({type(e).__name__}): {REMEASURE}") from None
    validate(profile, str(path))
    for role, model, rows in (("target", target, None), ("draft", draft, vocab_rows)):
        if model is not None:
            _check_shapes(profile["shapes"][role], shapes_of(model, rows), role, str(path))
    return profile


def validate(profile, where: str = FILENAME) -> None:
    if not isinstance(profile, dict) or profile.get("version") != VERSION:
        found = profile.get("version") if isinstance(profile, dict) else type(profile).__name__
        raise PipelineError(f"cost profile {where} has version {found!r}, this code reads version {VERSION}: "
                            f"{REMEASURE}")
    try:
        tables = [profile["target"][str(n)] for n in profile["settings"]["contexts"]]
        ok = bool(tables) and all("1" in t and all(e["ms"] > 0 for e in t.values()) for t in tables)
        ok = ok and profile["draft"]["ms"] > 0 and all(k in profile["shapes"][r] for r in ("target", "draft")
                                                       for k in SHAPE_KEYS)
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise PipelineError(f"cost profile {where} is incomplete (needs machine, shapes, settings, positive target "
                            f"times with 1 token fed at every context, and a draft time): {REMEASURE}")


def _check_shapes(theirs: dict, ours: dict, role: str, where: str) -> None:
    for key, value in ours.items():
        if value is not None and theirs.get(key) is not None and theirs[key] != value:
            raise PipelineError(f"cost profile {where} is for a {theirs.get('architecture')} with {key} "
                                f"{theirs[key]}, the {role} has {value}: {REMEASURE}")


def random_model(config_source: str | Path, dtype: torch.dtype | str = torch.float32, device="cpu", seed: int = 0):
    """A causal LM with random weights and the shapes of `config_source` (see `model_config`), in eval mode.
    Step times depend on shapes, dtype and hardware, not on weight values."""
    config = model_config(config_source)
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # transformers raises many types for a config it cannot build
        first = (str(e).splitlines() or [""])[0][:160]
        raise PipelineError(f"cannot build a causal LM from {config_source} ({type(e).__name__}: {first}): "
                            "pass a causal-LM config.json") from None
    return model.to(device).eval()


def model_config(source: str | Path):
    """A transformers config from a config.json file, a directory holding one, or a model preset of this repo
    (a name in conf/model/ or a path to its yaml), optionally suffixed `:draft` for the preset's draft."""
    text = str(source)
    name, role = (text, "target") if os.path.exists(text) else (text.rsplit(":", 1) + ["target"])[:2]
    path = Path(name).expanduser()
    try:
        if path.is_dir() and (path / "config.json").is_file():
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        if path.is_file() and path.suffix == ".json":
            data = json.loads(path.read_text())
            return AutoConfig.for_model(data.pop("model_type"), **data)
    except Exception as e:  # a broken or foreign JSON file
        raise PipelineError(f"cannot read a model config from {source} ({type(e).__name__}): "
                            "pass a Hugging Face config.json with a model_type") from None
    preset = path if path.suffix in (".yaml", ".yml") and path.is_file() else REPO / "conf/model" / f"{name}.yaml"
    if not preset.is_file() or preset.stem.startswith("_"):
        names = sorted(p.stem for p in (REPO / "conf/model").glob("[!_]*.yaml"))
        raise PipelineError(f"{source} is neither a config.json, a directory holding one, nor a model preset: "
                            f"pass one of those (presets: {', '.join(names)}, optionally with :draft)")
    return _preset_config(preset, role)


def _preset_config(preset: Path, role: str):
    """The config of a preset's target or draft; a derived or fresh draft is the target's config resized as
    distill builds it (layers subset, narrowed width, or `fresh` sizes)."""
    from pipeline.modelio.settings import ModelSettings
    from pipeline.settings import schema

    given = OmegaConf.load(preset)
    given.pop("defaults", None)  # the preset's own defaults list names the schema merged here
    spec = OmegaConf.merge(schema(ModelSettings), given)
    if role not in ("target", "draft"):
        raise PipelineError(f"unknown role {role!r} in {preset.stem}:{role}: use {preset.stem} or {preset.stem}:draft")
    draft, init = spec.draft, spec.draft.init
    if role == "target" or init == "pretrained":
        config = _spec_config(spec[role], role, preset.stem)
        layers = draft.keep_layers if role == "draft" else None
    else:
        config = copy.deepcopy(_spec_config(spec.target, "target", preset.stem))
        layers = draft.derive.layers if init == "derive" else None
        sizes = {"hidden_size": draft.derive.hidden_size} if init == "derive" else dict(draft.fresh or {})
        config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for key, value in sizes.items():
            if value:
                setattr(config, key, int(value))
        if init == "fresh":  # as pipeline/modelio/draft_init.py builds a fresh draft
            config.head_dim = config.hidden_size // config.num_attention_heads
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:1] * config.num_hidden_layers
    if layers:
        if getattr(config, "layer_types", None):  # per-layer attention kinds list exactly the kept layers
            config.layer_types = [config.layer_types[int(i)] for i in layers]
        config.num_hidden_layers = len(layers)
    return config


def _spec_config(spec, role: str, preset: str):
    """A preset role's config.json without downloading: its local directory, the hub cache, or the converted
    directory a stage writes under artifacts/models for a packaged GGUF."""
    path, package = spec.get("path"), spec.get("package")
    candidates = [Path(path).expanduser()] if path else []
    if package:
        candidates += [converted_dir(base / "artifacts/models", spec, role) for base in (Path.cwd(), REPO)]
    for directory in candidates:
        if (directory / "config.json").is_file():
            return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    if path and not str(path).endswith(".gguf"):
        try:
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception:  # not in the local hub cache
            pass
    where = path or "packaged GGUF, not converted"
    raise PipelineError(f"preset {preset}'s {role} has no local config.json ({where}): "
                        f"run a stage with model={preset} once to fetch and convert it, or pass its config.json")
