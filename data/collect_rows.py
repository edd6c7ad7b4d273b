"""What the collect stage generates, row by row: its settings (`collect.*`, validated), a completion, the
dataset's columns (the output contract in data/collect.py), one shard's rows, and the per-domain summary."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
from omegaconf import DictConfig, OmegaConf

from data.collect_text import TextSettings
from pipeline.modelio.chat import encode_chat, messages_for
from pipeline.errors import PipelineError
from pipeline.settings import build, group, refuse, register, setting
from pipeline.sampling import Sampling, derive_seed

BACKENDS = ("hf", "vllm", "server")
DECLARED = "data/collect_rows.py"
_FIX = f"fix the override (the settings: {DECLARED})"


# ----------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class OnPolicySettings:
    """`collect.onpolicy.*` ; checked whatever the backend."""
    share: float = setting(0.0, "of each domain's train prompts (never held-out ones), answered by the draft at the "
                           "serving sampling and labelled by the target in one forward over prompt + completion: a "
                           "target row's labels for a prefill's cost. 0 = off; needs backend=hf and topk > 0")
    draft: str | None = setting(None, "a draft model directory; null = model.draft, the draft distill starts from")

    def __post_init__(self):
        if not 0.0 <= self.share <= 1.0:
            raise PipelineError(f"collect.onpolicy.share={self.share} must be in [0, 1] (0 = off): {_FIX}")


ENDPOINTS = ("completions", "chat")
ENGINES = ("auto", "llamacpp", "vllm", "sglang", "openai")


@dataclass(frozen=True)
class ServerSettings:
    """`collect.server.*`: the OpenAI-compatible servers of collect.backend=server . Checked when the settings are built, whatever the backend."""
    urls: tuple[str, ...] = setting([], "base URLs, e.g. [http://10.0.0.5:8080]; requests spread over all")
    launch: bool = setting(False, "true (urls empty): start one llama-server on 127.0.0.1 on the target's GGUF for the "
                           "run (engines.llamacpp), one slot per request in flight")
    model: str | None = setting(None, "the served model's name as GET /v1/models lists it; null = the one it serves")
    endpoint: str = setting("completions", "completions (prompt sent as our chat-templated token ids: identical "
                            "prompt_ids by construction) | chat (the server's template, checked against ours)")
    engine: str = setting("auto", "auto (from /v1/models owned_by) | llamacpp | vllm | sglang | openai (standard fields "
                          "only): decides the engine-specific fields (token ids back, stop ids, top_k)")
    concurrency: int = setting(1, "requests in flight per server; match its parallel slots (llama-server -np)")
    timeout: float = setting(600, "seconds per request before it counts as a failed try")
    retries: int = setting(4, "extra tries per request on a refused connection, a timeout, 429 or 5xx ...")
    backoff: float = setting(1.0, "... after backoff x 2^try seconds; a server failing them all is dropped")
    logprobs: bool = setting(False, "true: the rows' labels are the server's log-probs, only where it returns the raw "
                             "T=1 distribution (llama-server; vLLM with --logprobs-mode raw_logprobs); false: "
                             "distill's label pass computes them")

    def __post_init__(self):
        urls = list(self.urls)
        object.__setattr__(self, "urls", tuple(u.rstrip("/") for u in urls))  # frozen: normalised once, here
        refuse([
            (any(not u.startswith(("http://", "https://")) for u in urls),
             f"collect.server.urls={urls} must be http(s):// base URLs: {_FIX}"),
            (len(set(self.urls)) < len(urls),
             f"collect.server.urls={urls} lists a server twice: use collect.server.concurrency for more requests in "
             "flight"),
            (self.endpoint not in ENDPOINTS, f"unknown collect.server.endpoint={self.endpoint!r}: use completions or chat"),
            (self.engine not in ENGINES, f"unknown collect.server.engine={self.engine!r}: use {', '.join(ENGINES)}"),
            (self.concurrency < 1, f"collect.server.concurrency={self.concurrency} must be ≥ 1: {_FIX}"),
            (self.timeout <= 0, f"collect.server.timeout={self.timeout} must be > 0 seconds: {_FIX}"),
            (self.retries < 0, f"collect.server.retries={self.retries} must be ≥ 0: {_FIX}"),
            (self.backoff < 0, f"collect.server.backoff={self.backoff} must be ≥ 0 seconds: {_FIX}"),
            (self.launch and self.urls,
             "collect.server.launch=true starts its own llama-server: leave collect.server.urls empty")])


@dataclass(frozen=True)
class CollectSettings:
    """`collect.*`, the collect stage (data/collect.py): the target's own generations on the train prompts, into
    ${paths.collect}/dataset + manifest.json, resumable shards under ${paths.collect}/shards/<fingerprint>/. Declared
    once (registered as `collect/default`) and validated in one place (as eval/settings.py); what needs the target or
    the process group is checked where those are known. Validation also normalises (idempotent, so
    `dataclasses.replace` works)."""
    domains: Any = setting(None, "domains to collect, e.g. [code, math] or code; null = every train domain")
    max_prompts_per_domain: int | None = setting(64, "cap per domain (first N in file order); null = all. Sized so the "
                                                 "default CPU run fits 15 minutes on 2 cores (~34k target tokens: the "
                                                 "learning curve's first-order gain, docs/results.md)")
    backend: str = setting("hf", "hf (transformers generate) | vllm (CUDA) | server (OpenAI-compatible servers already "
                           "serving the target: collect.server)")
    max_minutes: float | None = setting(5, "no shard starts that would end past this (at the mean shard time so far; "
                                        "each domain's first always runs; a rerun continues); null = no limit")
    temperature: float = setting(0.7, "the serving temperature the draft learns (the checkpoint's generation_config is "
                                 "ignored on purpose); 0 = greedy; 0.7, a usual chat serving temperature")
    top_p: float = setting(1.0, "1 = off")
    top_k: int = setting(0, "0 = off (passed explicitly: HF generate's default is 50)")
    max_new_tokens: int = setting(96, "tokens per completion (a turn's answer)")
    samples_per_prompt: int = setting(1, "completions per prompt turn; later turns follow sample 0's answer")
    seed: int | None = setting("${seed}", "each shard's RNG is seeded from (seed, domain, shard, turn); null = the root "
                               "seed")
    topk: int = setting(32, "white-box labels: per position the target's top-k ids and T=1 log-probs from the forward "
                        "that produced the token (k x 6 + 8 bytes per token); distill's cached teacher; 0 = off")
    hidden_states: bool = setting(True, "hf backend: also store the target's final hidden state per token (fp16): "
                                  "distill then needs no second target pass over the rows (101 s of a default run on "
                                  "2 cores, docs/results.md)")
    onpolicy: OnPolicySettings = group(OnPolicySettings, "on-policy rows (DistillSpec): the draft answers, the target "
                                       "labels (data/collect_onpolicy.py)")
    text: TextSettings = group(TextSettings, "rows of given text labelled by the target in one forward pass "
                               "(data/collect_text.py): a prefill's cost per label, no generation")
    batch_size: int = setting(16, "sequences per generate call (left-padded); halved on CUDA out-of-memory")
    shard_size: int = setting(32, "prompts per shard and domain: the unit of resume, of process splitting and of a "
                              "budget's cut; 16-prompt shards collected at 135 tokens/s where 64-prompt ones reached 203")
    keep_shards: bool = setting(True, "keep shards after the merge (a rerun then only re-merges)")
    vllm: dict[str, Any] = setting({"gpu_memory_utilization": 0.85, "tensor_parallel_size": 1, "max_model_len": None},
                                   "backend=vllm only (data/collect_vllm.py): its share of GPU memory (its own "
                                   "default 0.9), GPUs the target is split over, max_model_len (null = the model's)")
    server: ServerSettings = group(ServerSettings, "backend=server only (data/collect_server.py): llama-server, vLLM, "
                                   "SGLang, ...")

    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_k", "top_p")

    @property
    def sampling(self) -> Sampling:
        """The target's serving sampling."""
        return Sampling(self.temperature, self.top_k, self.top_p)

    def __post_init__(self):
        try:
            self.sampling  # noqa: B018  (validates the serving distribution)
        except PipelineError as e:  # the core names the field; the user needs the collect.* key
            raise PipelineError(f"collect.{e} ({_FIX})") from None
        domains = self.domains
        if domains is not None:
            self._normalise("domains", (domains,) if isinstance(domains, str) else tuple(domains))
        self._normalise("vllm", MappingProxyType(dict(self.vllm)))
        refuse([
            (self.max_new_tokens < 1, f"collect.max_new_tokens={self.max_new_tokens} must be ≥ 1: {_FIX}"),
            (self.samples_per_prompt < 1,
             f"collect.samples_per_prompt={self.samples_per_prompt} must be ≥ 1: {_FIX}"),
            (self.topk < 0, f"collect.topk={self.topk} must be ≥ 0 (0 = no white-box labels): {_FIX}"),
            (self.batch_size < 1, f"collect.batch_size={self.batch_size} must be ≥ 1: {_FIX}"),
            (self.shard_size < 1, f"collect.shard_size={self.shard_size} must be ≥ 1: {_FIX}"),
            (self.sampling.greedy and self.samples_per_prompt > 1,
             "collect.temperature=0 (greedy) makes every sample identical: use samples_per_prompt=1 "
             "or a temperature > 0"),
            (self.backend not in BACKENDS, f"unknown collect.backend={self.backend!r}: use hf, vllm or server"),
            (self.backend == "server" and not self.server.urls and not self.server.launch,
             "collect.backend=server needs collect.server.urls: list the servers' base URLs, e.g. "
             "collect.server.urls=[http://127.0.0.1:8080], or set collect.server.launch=true"),
            (self.domains is not None and not self.domains,
             "collect.domains is empty: list domains to collect or set collect.domains=null for all"),
            (self.max_prompts_per_domain is not None and self.max_prompts_per_domain < 0,
             f"collect.max_prompts_per_domain={self.max_prompts_per_domain} must be ≥ 0 (null = all): {_FIX}"),
            (self.max_minutes is not None and self.max_minutes <= 0,
             f"collect.max_minutes={self.max_minutes} must be > 0 (null = no limit): {_FIX}"),
            (self.onpolicy.share and self.backend != "hf", f"collect.onpolicy.share={self.onpolicy.share} needs "
             "collect.backend=hf: the target labels the draft's samples in process"),
            (self.onpolicy.share and not self.topk, f"collect.onpolicy.share={self.onpolicy.share} needs "
             "collect.topk > 0: on-policy rows are worth only the target's labels"),
            (self.text.paths and self.backend != "hf", "collect.text.paths needs collect.backend=hf: the target "
             "labels the text in process"),
            (self.text.paths and not self.topk, "collect.text.paths needs collect.topk > 0: text rows are worth "
             "only the target's labels")])

    @property
    def labels_prepared_text(self) -> bool:
        """collect.text.prepared where it can run: the target in process (hf) and labels kept (topk); a server or vLLM
        collect skips the prepared text rather than fail on a default."""
        return self.text.prepared and self.backend == "hf" and bool(self.topk)

    @classmethod
    def from_config(cls, collect_cfg: DictConfig, default_seed: int) -> "CollectSettings":
        """The settings in `cfg.collect` (interpolations resolved; a null collect.seed is `default_seed`, the root
        seed); checked before anything is loaded."""
        values = OmegaConf.to_container(collect_cfg, resolve=True)
        seed = values.get("seed")
        return build(cls, values, "collect", DECLARED, {"seed": default_seed if seed is None else seed})

    def _normalise(self, key: str, value) -> None:
        object.__setattr__(self, key, value)  # frozen: validation is the one place that may set a field

    def generation_key(self) -> dict:
        """The settings that decide the rows, for the shard fingerprint. batch_size stays out so that a
        resume may change it (e.g. after an out-of-memory); keep_shards only decides the cleanup; the
        prompts (domains, max_prompts_per_domain) are in each shard's own name; max_minutes and vllm's
        memory options decide how far and how fast a run gets, not its rows."""
        key = {"sampling": self.sampling.to_dict(), "max_new_tokens": self.max_new_tokens,
               "samples_per_prompt": self.samples_per_prompt, "topk": self.topk, "shard_size": self.shard_size,
               "backend": self.backend, "seed": self.seed}
        if self.stores_hidden:  # hashed only when stored: collects made before the knob keep their fingerprint
            key["hidden_states"] = True
        if self.backend == "server":  # the urls, concurrency and fault handling decide where and how fast, not what
            key["server"] = {"model": self.server.model, "endpoint": self.server.endpoint,
                             "logprobs": self.server.logprobs}
        if self.onpolicy.share:  # which prompts the draft answers is in each shard's name (their `origin`)
            key["onpolicy"] = {"share": self.onpolicy.share, "draft": self.onpolicy.draft}
        return key

    @property
    def label_topk(self) -> int:
        """The top-k width of the labels the rows carry: collect.topk, except on a server not asked for its
        log-probs (collect.server.logprobs=false), whose rows carry none: distill's label pass computes them."""
        return self.topk if self.backend != "server" or self.server.logprobs else 0

    @property
    def stores_hidden(self) -> bool:
        """Whether the rows carry `final_hidden`: only the in-process HF backend sees the target's hidden states
        (a server or vLLM returns tokens and log-probs), and only with collect.hidden_states."""
        return self.hidden_states and self.backend == "hf"

    @property
    def labels_source(self) -> str:
        """Where the rows' top-k labels come from (distill/labels.py computes them for rows that have none)."""
        if not self.topk:
            return "none"
        if self.backend == "server":
            return "server" if self.server.logprobs else "distill"  # distill: its own target pass labels the rows
        return "target-forward"


# ----------------------------------------------------------------------------- rows

@dataclass
class Completion:
    ids: list[int]
    finish_reason: str                     # "eos" | "length"
    topk_ids: np.ndarray | None = None     # [len(ids), k] int32
    topk_logprobs: np.ndarray | None = None  # [len(ids), k] float16
    final_hidden: np.ndarray | None = None   # [len(ids), hidden] float16: the head's input that produced each token


def features(topk: int, hidden: bool = False, origin: bool = False):
    from datasets import Features, List, Value

    columns = {"id": Value("string"), "prompt_id": Value("string"), "domain": Value("string"),
               "turn": Value("int32"), "sample": Value("int32"),
               "prompt_ids": List(Value("int32")), "completion_ids": List(Value("int32")),
               "text": Value("string"), "finish_reason": Value("string")}
    if origin:
        columns["origin"] = Value("string")
    if topk:
        columns["topk_ids"] = List(List(Value("int32")))
        columns["topk_logprobs"] = List(List(Value("float16")))
    if hidden:
        columns["final_hidden"] = List(List(Value("float16")))
    return Features(columns)


def collect_shard(backend, tokenizer, prompts: list[dict], samples_per_prompt: int, seed: int,
                  progress=None, onpolicy=None) -> tuple[list[dict], dict]:
    """Rows for one shard: every turn of every prompt, samples_per_prompt completions each, one `backend.generate`
    call per turn seeded from (shard seed, turn); turn t+1 follows sample 0's answer to turn t. A request the backend
    skipped (None) is left out, with the later turns of a prompt whose sample 0 was skipped. With an `onpolicy`
    backend (collect.onpolicy) the prompts marked `origin: onpolicy` are its, in a call of their own seeded from
    (shard seed, turn, "onpolicy"), and every row carries its `origin`. Returns the rows and, per origin, the CPU and
    wall seconds of the calls that made them (the manifest's label cost)."""
    answers: dict[str, list[str]] = {prompt["id"]: [] for prompt in prompts}
    rows, spent = [], {}
    for turn in range(max(len(prompt["turns"]) for prompt in prompts)):
        active = [prompt for prompt in prompts if len(prompt["turns"]) > turn and len(answers[prompt["id"]]) == turn]
        if not active:
            break
        messages = [messages_for(prompt, answers[prompt["id"]], turn) for prompt in active]
        contexts = [encode_chat(tokenizer, chat)[0].tolist() for chat in messages]
        requests = [(prompt, context, sample, chat) for prompt, context, chat in zip(active, contexts, messages)
                    for sample in range(samples_per_prompt)]
        completions = [None] * len(requests)
        for origin, chosen, turn_seed in (("target", backend, derive_seed(seed, turn)),
                                          ("onpolicy", onpolicy, derive_seed(seed, turn, "onpolicy"))):
            picked = [i for i, (prompt, *_) in enumerate(requests) if prompt.get("origin", "target") == origin]
            if picked:
                done = _generate(chosen, [requests[i] for i in picked], turn_seed, progress, spent, origin)
                for i, completion in zip(picked, done):
                    completions[i] = completion
        for (prompt, context, sample, _), completion in zip(requests, completions):
            if completion is None:
                continue
            row = _row(tokenizer, prompt, turn, sample, context, completion)
            if onpolicy is not None:
                row["origin"] = prompt.get("origin", "target")
            if sample == 0:
                answers[prompt["id"]].append(row["text"])
            rows.append(row)
    position = {prompt["id"]: i for i, prompt in enumerate(prompts)}
    rows.sort(key=lambda row: (position[row["prompt_id"]], row["turn"], row["sample"]))
    return rows, spent


def _generate(backend, requests: list[tuple], seed: int, progress, spent: dict, origin: str) -> list:
    """One `backend.generate` call for `requests`; its process CPU and wall seconds are added to spent[origin]."""
    wants_messages = {"messages": [chat for *_, chat in requests]} if getattr(backend, "wants_messages", False) \
        else {}  # a server's chat endpoint renders the messages with its own template
    cpu, wall = time.process_time(), time.perf_counter()
    completions = backend.generate([context for _, context, _, _ in requests], seed, progress, **wants_messages)
    entry = spent.setdefault(origin, {"cpu_s": 0.0, "wall_s": 0.0})
    entry["cpu_s"] += time.process_time() - cpu
    entry["wall_s"] += time.perf_counter() - wall
    if hasattr(backend, "take_draft_cpu_s"):  # an on-policy call: the draft's sampling, part of cpu_s
        entry["draft_cpu_s"] = entry.get("draft_cpu_s", 0.0) + backend.take_draft_cpu_s()
    return completions


def _row(tokenizer, prompt: dict, turn: int, sample: int, context: list[int], completion: Completion) -> dict:
    row = {"id": f"{prompt['id']}/t{turn}/s{sample}", "prompt_id": prompt["id"], "domain": prompt["domain"],
           "turn": turn, "sample": sample, "prompt_ids": context, "completion_ids": completion.ids,
           "text": tokenizer.decode(completion.ids, skip_special_tokens=True),
           "finish_reason": completion.finish_reason}
    if completion.topk_ids is not None:
        row["topk_ids"], row["topk_logprobs"] = completion.topk_ids, completion.topk_logprobs
    if completion.final_hidden is not None:
        row["final_hidden"] = completion.final_hidden
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


register("collect", CollectSettings)
