"""The pieces every drafting shape shares: the decoded pair, one call's run (caches, clocks, the loop), the
profile of the loop's parts, the statistics, the forward helper and the cache rollback.

Batch size 1, HF `*ForCausalLM` models, a `DynamicCache` per model holding a prefix of the committed tokens;
p = target distribution, q = draft distribution (pipeline/sampling.py). Each model's first forward reads the prompt
and is reported as prefill_time, not in the per-forward lists, so that c compares decoding steps only. Spans are
marked with a `pipeline.timing.Stopwatch` and resolved once, after the call: profiling adds no host sync.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pipeline.errors import PipelineError
from pipeline.heads import head_logits, head_rows
from pipeline.sampling import Sampling, sample
from pipeline.timing import Stopwatch, synced_clock

MASK_ATTENTION = ("eager", "sdpa")  # the attention implementations that take a 4-D additive mask as given


@dataclass
class DecodeStats:
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens, one entry per verify pass
    drafted: list[int] = field(default_factory=list)  # draft tokens proposed per verify pass (γ, clamped at the end)
    target_passes: int = 0  # target forwards; each yields accepted + 1 tokens (the first also reads the prompt)
    n_generated: int = 0
    draft_times: list[float] = field(default_factory=list)  # seconds per draft forward, the first excluded
    target_times: list[float] = field(default_factory=list)  # seconds per target forward, the first excluded
    sampling_time: float = 0.0  # probabilities, sampling, accept/resample, the host sync for the result
    cache_time: float = 0.0  # cache crops and sequence bookkeeping
    prefill_time: float = 0.0  # each model's first forward, the one that reads the prompt
    total_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # seconds since the call at each pass's commit
    chunk_tokens: list[int] = field(default_factory=list)  # tokens committed by each of those passes

    @property
    def ttft(self) -> float | None:
        """Time to the first token: the first chunk's commit, seconds since the call."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def mean_itl(self) -> float | None:
        """Mean inter-token latency: seconds per token after the first ((t_last − t_first) / (n − 1))."""
        later = sum(self.chunk_tokens) - 1
        return (self.chunk_times[-1] - self.chunk_times[0]) / later if self.chunk_times and later > 0 else None

    def token_gaps(self) -> list[float]:
        """Per-token inter-token latencies: a chunk of k tokens committed g seconds after the previous chunk
        counts as k tokens of g / k each (the rate the stream delivers them); the first chunk has none."""
        return [(b - a) / k for a, b, k in zip(self.chunk_times, self.chunk_times[1:], self.chunk_tokens[1:])
                for _ in range(k)]

    @property
    def n_drafted(self) -> int:
        return sum(self.drafted)

    @property
    def n_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Generated tokens per target pass (includes the bonus/correction token; 1.0 for plain decoding)."""
        return self.n_generated / self.target_passes if self.target_passes else 0.0


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # 1-D LongTensor of generated ids, prompt excluded
    stats: DecodeStats


class Profile:
    """Stopwatch spans of one generate call, grouped by loop part and resolved into DecodeStats at the end:
    `with profile.part("draft"): ...` brackets one draft forward."""

    def __init__(self, device: torch.device | str):
        self.watch = Stopwatch(device)
        self.spans: dict[str, list] = {part: [] for part in ("draft", "target", "sampling", "cache")}
        self.start = self.watch.mark()  # the call's start, for chunk_times
        self.commits: list = []

    def commit(self) -> None:
        self.commits.append(self.watch.mark())

    @contextmanager
    def part(self, name: str):
        start = self.watch.mark()
        yield
        self.spans[name].append((start, self.watch.mark()))

    def resolve(self, stats: DecodeStats) -> None:
        """Seconds of every span into `stats`; each model's first forward read the prompt and counts as prefill."""
        seconds = {part: [self.watch.elapsed(a, b) for a, b in spans] for part, spans in self.spans.items()}
        stats.draft_times, stats.target_times = seconds["draft"], seconds["target"]
        stats.sampling_time, stats.cache_time = sum(seconds["sampling"]), sum(seconds["cache"])
        stats.chunk_times = [self.watch.elapsed(self.start, mark) for mark in self.commits]
        for times in (stats.target_times, stats.draft_times):
            if times:
                stats.prefill_time += times.pop(0)


@dataclass(frozen=True)
class Pair:
    """What one speculative_generate call decodes with."""
    target: torch.nn.Module
    draft: torch.nn.Module
    target_head: tuple  # (weight, bias) from pipeline.heads.head_rows
    draft_head: tuple  # restricted to draft_vocab when there is one
    p: Sampling  # the target's distribution
    q: Sampling  # the draft's: p's filters at the draft temperature
    draft_vocab: torch.Tensor | None = None  # target ids of the draft head's rows (FR-Spec)
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        # Then p and q are one-hot, acceptance is "argmax matches" and the residual is p: argmaxes suffice.
        return self.p.greedy and self.q.greedy


def forward(model, tokens: torch.Tensor, cache: DynamicCache, head, n_logits: int = 1, mask: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """Feeds tokens [1, k] through `model` appending to `cache` (a tree: under a 4-D additive mask at explicit
    positions [1, k]); fp32 logits of the last n_logits positions. The head (a small model's biggest matmul;
    FR-Spec needs only some rows) runs only on the positions sampled from."""
    hidden = model.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                         use_cache=True).last_hidden_state
    return head_logits(hidden[0, -n_logits:], head)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # finfo.min, not -inf: a padding token that sees nothing gets a uniform (finite) row, never NaN
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def check_mask_attention(what: str, **models) -> None:
    """Trees and batches need attention that takes a 4-D additive mask as given."""
    for role, model in models.items():
        attention = getattr(model.config, "_attn_implementation", None)
        if attention not in MASK_ATTENTION:
            raise PipelineError(f"{what} needs attention that takes a 4-D mask ({', '.join(MASK_ATTENTION)}), the "
                                f"{role} uses {attention}: load it with attn_implementation='sdpa'")


def draft_head_rows(draft, vocab: torch.Tensor | None) -> tuple:
    """head_rows(draft, vocab), kept on the draft between calls while its head weight and `vocab` are the same
    tensors, unmodified (torch's version counters): copying a FR-Spec head's rows takes milliseconds, which every
    call would otherwise add to its time to first token."""
    if vocab is None:
        return head_rows(draft)
    weight = draft.get_output_embeddings().weight
    key = (weight, weight._version, vocab, vocab._version)
    cached = getattr(draft, "_decoder_draft_head", None)
    if cached is not None and all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(cached[0], key)):
        return cached[1]
    rows = head_rows(draft, vocab)
    object.__setattr__(draft, "_decoder_draft_head", (key, rows))  # a plain attribute, not a module buffer
    return rows


def crop(cache: DynamicCache, length: int) -> None:
    # transformers 5.x: crop(n) takes a negative count of tokens to drop (a positive max length raises).
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def prompt_tensor(input_ids, device: torch.device) -> torch.Tensor:
    prompt = torch.as_tensor(input_ids, device=device).long()
    prompt = prompt.view(1, -1) if prompt.dim() == 1 else prompt
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
        raise PipelineError(f"input_ids must be a non-empty [T] or [1, T] tensor, got shape "
                            f"{tuple(prompt.shape)}: batch size 1 only, one prompt per call")
    return prompt


def check_request(sampling: Sampling, max_new_tokens: int) -> None:
    if not isinstance(sampling, Sampling):
        raise PipelineError(f"sampling must be a pipeline.sampling.Sampling, got {type(sampling).__name__}: "
                            "pass e.g. sampling=Sampling(temperature=0.7)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise PipelineError(f"max_new_tokens must be >= 1, got {max_new_tokens}: ask for at least one token")


def eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def uses_sliding_window(config) -> bool:
    """Whether a model attends through a sliding window: its KV cache then keeps only the window, and a cache
    that forgot tokens cannot be cropped back to the committed prefix. Qwen2 configs carry `sliding_window`
    with `use_sliding_window: false`; those attend fully."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return True
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def check_pair(target, draft, draft_vocab) -> None:
    for role, model in (("target", target), ("draft", draft)):
        if uses_sliding_window(model.config):
            raise PipelineError(f"the {role} ({type(model).__name__}) uses sliding-window attention, whose KV cache "
                                "cannot be rolled back after a rejected draft: use a full-attention model")
    target_vocab, draft_size = (m.get_output_embeddings().weight.shape[0] for m in (target, draft))
    if target_vocab != draft_size or target.config.vocab_size != draft.config.vocab_size:
        raise PipelineError(f"draft vocabulary ({draft_size}) differs from the target's ({target_vocab}): "
                            "use a draft that shares the target's tokenizer")
    if model_device(draft) != model_device(target):
        raise PipelineError(f"draft is on {model_device(draft)} but target is on {model_device(target)}: "
                            "move both models to the same device")
    if draft_vocab is not None:
        if draft_vocab.dim() != 1 or draft_vocab.numel() == 0 or draft_vocab.dtype != torch.long:
            raise PipelineError("draft_vocab must be a non-empty 1-D LongTensor of target token ids")
        if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= target_vocab:
            raise PipelineError(f"draft_vocab has ids outside [0, {target_vocab}): pass target token ids")


@dataclass
class Run:
    """One generate call's models, caches and clocks; `chunks` is the loop every drafting shape shares."""
    pair: Pair
    seq: torch.Tensor  # the prompt [1, T]
    caches: tuple  # (target cache, draft cache); (target cache,) for plain decoding
    stats: DecodeStats
    profile: Profile
    clock: object
    started: float

    @classmethod
    def start(cls, target, draft, input_ids, p: Sampling, draft_temperature, draft_vocab, generator,
              stats: DecodeStats) -> "Run":
        """The pair and fresh caches for one call (each argument is one of speculative_generate's); draft None
        for plain decoding."""
        if draft is not None:
            check_pair(target, draft, draft_vocab)
        device = model_device(target)
        clock = synced_clock(device)
        started, profile = clock(), Profile(device)
        if draft is None:
            pair = Pair(target, None, head_rows(target), None, p, p, None, generator)
        else:
            if draft_vocab is not None:
                draft_vocab = draft_vocab.to(device)
            q = p if draft_temperature is None else p.with_temperature(draft_temperature)
            pair = Pair(target, draft, head_rows(target), draft_head_rows(draft, draft_vocab), p, q, draft_vocab,
                        generator)
        caches = tuple(DynamicCache(config=model.config) for model in (target, draft) if model is not None)
        return cls(pair, prompt_tensor(input_ids, device), caches, stats, profile, clock, started)

    @torch.inference_mode()  # a generator: torch enters the mode around each resumption
    def chunks(self, step, max_new_tokens: int, eos_token_id):
        """Yields the tokens each call of step(seq, room) -> (seq, new tokens) commits, until max_new_tokens or
        an EOS; `room` is how many drafts can still be used (a step yields at most drafts + 1 tokens: drafting
        past it would be wasted). The first pass gets room 0: a plain prefill, whose one token is the stream's
        first. A step returns its tokens as a list, or (plain decoding) as a device tensor, read on the host only
        to check an EOS. The stats are complete when the generator ends or is closed."""
        eos, seq, n = eos_set(eos_token_id), self.seq, 0
        try:
            while n < max_new_tokens:
                seq, new = step(seq, max_new_tokens - n - 1 if n else 0)
                hit = None
                if eos:
                    new = new if isinstance(new, list) else new.tolist()
                    hit = next((i for i, t in enumerate(new) if t in eos), None)
                    new = new if hit is None else new[:hit + 1]
                n += len(new)
                self.profile.commit()
                self.stats.chunk_tokens.append(len(new))
                yield new
                if hit is not None:
                    break
        finally:
            self.stats.n_generated = n
            self.stats.total_time = self.clock() - self.started
            self.profile.resolve(self.stats)


def plain_step(run: Run):
    """One plain decoding step per call, fed the tokens the cache lacks (the prompt at first, then the newest
    token); its token stays on the device (no host sync unless the loop checks an EOS)."""
    pair, (cache,), profile, stats = run.pair, run.caches, run.profile, run.stats

    def step(tokens, room):
        with profile.part("target"):
            logits = forward(pair.target, tokens, cache, pair.target_head)
        with profile.part("sampling"):
            if pair.p.greedy:  # skip building a one-hot distribution just to take its argmax
                token = logits.argmax(-1, keepdim=True)
            else:
                token = sample(pair.p.probs(logits), pair.generator).view(1, 1)
        stats.target_passes += 1
        return token, token.view(1)
    return step
