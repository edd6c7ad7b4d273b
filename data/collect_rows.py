"""What the collect stage generates, row by row: its settings (`collect.*`, validated), a completion, the
dataset's columns (the output contract in data/collect.py), one shard's rows, and the per-domain summary."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig

from pipeline.chat import encode_chat, messages_for
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling, derive_seed

BACKENDS = ("hf", "vllm")
_FIX = "fix the override or conf/collect/default.yaml"


# ----------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class CollectSettings:
    """What the collect stage generates and how: the target's serving `sampling`, the generation length
    and count, the white-box label width (`topk`, 0 = none) and the run layout. Validates itself.

    The stage builds it from `collect.*` (`from_config`); the defaults only serve direct construction
    (tests, data/bench_collect.py) and are the neutral values, not conf/collect/default.yaml's."""
    sampling: Sampling
    max_new_tokens: int
    samples_per_prompt: int = 1
    topk: int = 0
    batch_size: int = 1
    shard_size: int = 1
    backend: str = "hf"
    seed: int = 0
    keep_shards: bool = True

    def __post_init__(self):
        checks = [
            (self.max_new_tokens < 1, f"collect.max_new_tokens={self.max_new_tokens} must be ≥ 1: {_FIX}"),
            (self.samples_per_prompt < 1,
             f"collect.samples_per_prompt={self.samples_per_prompt} must be ≥ 1: {_FIX}"),
            (self.topk < 0, f"collect.topk={self.topk} must be ≥ 0 (0 = no white-box labels): {_FIX}"),
            (self.batch_size < 1, f"collect.batch_size={self.batch_size} must be ≥ 1: {_FIX}"),
            (self.shard_size < 1, f"collect.shard_size={self.shard_size} must be ≥ 1: {_FIX}"),
            (self.sampling.greedy and self.samples_per_prompt > 1,
             "collect.temperature=0 (greedy) makes every sample identical: use samples_per_prompt=1 "
             "or a temperature > 0"),
            (self.backend not in BACKENDS, f"unknown collect.backend={self.backend!r}: use hf or vllm")]
        for bad, message in checks:
            if bad:
                raise PipelineError(message)

    @classmethod
    def from_config(cls, collect_cfg: DictConfig, default_seed: int) -> "CollectSettings":
        """The settings in `cfg.collect`, checked before anything is loaded or written."""
        def read(key, kind):
            return _config_number(collect_cfg, key, kind)

        temperature, top_k, top_p = read("temperature", float), read("top_k", int), read("top_p", float)
        try:
            sampling = Sampling(temperature, top_k, top_p)
        except PipelineError as e:  # the core names the field; the user needs the collect.* key
            raise PipelineError(f"collect.{e} ({_FIX})") from None
        seed = int(default_seed) if collect_cfg.get("seed") is None else read("seed", int)
        return cls(sampling, read("max_new_tokens", int), read("samples_per_prompt", int), read("topk", int),
                   read("batch_size", int), read("shard_size", int), str(collect_cfg.get("backend")), seed,
                   bool(collect_cfg.get("keep_shards", True)))

    def generation_key(self) -> dict:
        """The settings that decide the rows, for the shard fingerprint. batch_size stays out so that a
        resume may change it (e.g. after an out-of-memory); keep_shards only decides the cleanup."""
        return {"sampling": self.sampling.to_dict(), "max_new_tokens": self.max_new_tokens,
                "samples_per_prompt": self.samples_per_prompt, "topk": self.topk, "shard_size": self.shard_size,
                "backend": self.backend, "seed": self.seed}


def _config_number(collect_cfg: DictConfig, key: str, kind: type):
    """collect.<key> as an int or float, or a one-line error naming the key."""
    value = collect_cfg.get(key)
    fractional = kind is int and isinstance(value, float) and not value.is_integer()
    try:
        if isinstance(value, bool) or fractional:
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        noun = "an integer" if kind is int else "a number"
        raise PipelineError(f"collect.{key}={value!r} must be {noun}: {_FIX}") from None


# ----------------------------------------------------------------------------- rows

@dataclass
class Completion:
    ids: list[int]
    finish_reason: str                     # "eos" | "length"
    topk_ids: np.ndarray | None = None     # [len(ids), k] int32
    topk_logprobs: np.ndarray | None = None  # [len(ids), k] float16


def features(topk: int):
    from datasets import Features, List, Value

    columns = {"id": Value("string"), "prompt_id": Value("string"), "domain": Value("string"),
               "turn": Value("int32"), "sample": Value("int32"),
               "prompt_ids": List(Value("int32")), "completion_ids": List(Value("int32")),
               "text": Value("string"), "finish_reason": Value("string")}
    if topk:
        columns["topk_ids"] = List(List(Value("int32")))
        columns["topk_logprobs"] = List(List(Value("float16")))
    return Features(columns)


def collect_shard(backend, tokenizer, prompts: list[dict], samples_per_prompt: int, seed: int,
                  progress=None) -> list[dict]:
    """Rows for one shard: every turn of every prompt, samples_per_prompt completions each.

    Turn t+1 of a prompt is conditioned on sample 0's answer to turn t. Each turn is one
    `backend.generate` call seeded from (shard seed, turn).
    """
    answers: dict[str, list[str]] = {prompt["id"]: [] for prompt in prompts}
    rows = []
    for turn in range(max(len(prompt["turns"]) for prompt in prompts)):
        active = [prompt for prompt in prompts if len(prompt["turns"]) > turn]
        contexts = [encode_chat(tokenizer, messages_for(prompt, answers[prompt["id"]], turn))[0].tolist()
                    for prompt in active]
        requests = [(prompt, context, sample) for prompt, context in zip(active, contexts)
                    for sample in range(samples_per_prompt)]
        completions = backend.generate([context for _, context, _ in requests], derive_seed(seed, turn), progress)
        for (prompt, context, sample), completion in zip(requests, completions):
            row = _row(tokenizer, prompt, turn, sample, context, completion)
            if sample == 0:
                answers[prompt["id"]].append(row["text"])
            rows.append(row)
    position = {prompt["id"]: i for i, prompt in enumerate(prompts)}
    rows.sort(key=lambda row: (position[row["prompt_id"]], row["turn"], row["sample"]))
    return rows


def _row(tokenizer, prompt: dict, turn: int, sample: int, context: list[int], completion: Completion) -> dict:
    row = {"id": f"{prompt['id']}/t{turn}/s{sample}", "prompt_id": prompt["id"], "domain": prompt["domain"],
           "turn": turn, "sample": sample, "prompt_ids": context, "completion_ids": completion.ids,
           "text": tokenizer.decode(completion.ids, skip_special_tokens=True),
           "finish_reason": completion.finish_reason}
    if completion.topk_ids is not None:
        row["topk_ids"], row["topk_logprobs"] = completion.topk_ids, completion.topk_logprobs
    return row


@contextlib.contextmanager
def quiet_datasets():
    """No "Saving the dataset" bar per shard: the stage has its own progress bar."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def summarize(dataset) -> dict[str, dict]:
    """Per-domain counts: prompts, completions, tokens, mean length, share ended by EOS."""
    columns = dataset.select_columns(["prompt_id", "domain", "completion_ids", "finish_reason"])
    per_domain: dict[str, dict] = {}
    for row in columns:
        counts = per_domain.setdefault(row["domain"], {"prompts": set(), "completions": 0, "tokens": 0, "eos": 0})
        counts["prompts"].add(row["prompt_id"])
        counts["completions"] += 1
        counts["tokens"] += len(row["completion_ids"])
        counts["eos"] += row["finish_reason"] == "eos"
    return {domain: {"prompts": len(counts["prompts"]), "completions": counts["completions"],
                     "tokens": counts["tokens"], "mean_length": round(counts["tokens"] / counts["completions"], 2),
                     "eos_share": round(counts["eos"] / counts["completions"], 4)}
            for domain, counts in per_domain.items()}


def format_summary(summary: dict[str, dict]) -> str:
    header = f"{'domain':<16}{'prompts':>9}{'completions':>13}{'tokens':>10}{'mean_len':>10}{'eos_share':>11}"
    lines = [header, "-" * len(header)]
    for domain, counts in summary.items():
        lines.append(f"{domain:<16}{counts['prompts']:>9}{counts['completions']:>13}{counts['tokens']:>10}"
                     f"{counts['mean_length']:>10.1f}{counts['eos_share']:>11.2f}")
    return "\n".join(lines)
