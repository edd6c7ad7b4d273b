"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) and plain autoregressive decoding.

Batch size 1, HF `*ForCausalLM` models (Llama/Qwen2 family), `DynamicCache` KV caches for both models.
p = target distribution, q = draft distribution (see pipeline/sampling.py for the math).

Caches: each model's cache holds a prefix of the committed tokens (prompt + accepted output) and the
next forward feeds the rest. There is no separate prefill pass: the first forward of each model feeds
the whole prompt (with the drafts, for the target), like HF generate's prefill that also yields the first
token. So every target pass yields tokens (accepted + 1), plain decoding is exactly 1.0 token per pass,
and no forward is spent that HF would not spend. The time of each model's first forward is reported as
prefill_time, not in the per-forward lists, so that c compares decoding steps only. After a step the
target cache lacks only the newest token; the draft cache lacks 1 token, or 2 after a fully accepted
block (the draft never fed its own last proposal), fed together in its next forward.

Timing: the parts of the loop are marked with a `pipeline.timing.Stopwatch` (CUDA events on GPU) and the
marks are turned into seconds once, after the call, so profiling adds no host synchronisation to the loop;
only `total_time` is bracketed with a synchronising clock.
"""
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pipeline.draft_length import DraftLength, Policy
from pipeline.errors import PipelineError
from pipeline.heads import head_logits, head_rows
from pipeline.sampling import Sampling, sample, verify_draft
from pipeline.timing import Stopwatch, synced_clock


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
    """Stopwatch marks of one generate call, grouped by loop part and resolved into DecodeStats at the end."""

    PARTS = ("draft", "target", "sampling", "cache")

    def __init__(self, device: torch.device | str):
        self.watch = Stopwatch(device)
        self.spans: dict[str, list] = {part: [] for part in self.PARTS}

    def mark(self):
        return self.watch.mark()

    def span(self, part: str, start, end) -> None:
        self.spans[part].append((start, end))

    def resolve(self, stats: DecodeStats) -> None:
        """Seconds of every span into `stats`; each model's first forward read the prompt and counts as prefill."""
        seconds = {part: [self.watch.elapsed(a, b) for a, b in spans] for part, spans in self.spans.items()}
        stats.draft_times, stats.target_times = seconds["draft"], seconds["target"]
        stats.sampling_time, stats.cache_time = sum(seconds["sampling"]), sum(seconds["cache"])
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


def forward(model, tokens: torch.Tensor, cache: DynamicCache, head, n_logits: int = 1) -> torch.Tensor:
    """Feeds tokens [1, k] through `model` appending to `cache`; fp32 logits of the last n_logits positions.

    Runs the base model and applies the head only to the positions we sample from: the head is the
    biggest matmul of a small model, and a vocabulary subset (FR-Spec) needs only some of its rows.
    """
    hidden = model.model(input_ids=tokens, cache=cache, use_cache=True).last_hidden_state
    return head_logits(hidden[0, -n_logits:], head)


def crop(cache: DynamicCache, length: int) -> None:
    # transformers 5.x: crop(n) takes a negative count of tokens to drop (a positive max length raises).
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def _draft_block(pair: Pair, seq, draft_cache, budget: int, policy: Policy, profile: Profile):
    """Up to `budget` draft tokens [γ] (the policy may stop earlier) and, when sampling, the distributions
    q [γ, V_draft] they were drawn from."""
    drafts, qs = [], []
    tokens = seq[:, draft_cache.get_seq_length():]  # committed tokens the draft has not seen yet
    for _ in range(budget):
        t0 = profile.mark()
        logits = forward(pair.draft, tokens, draft_cache, pair.draft_head)
        t1 = profile.mark()
        if pair.greedy:
            index = logits.argmax(-1)
        else:
            qs.append(pair.q.probs(logits))  # exactly the distribution the token is sampled from
            index = sample(qs[-1], pair.generator)
        tokens = (index if pair.draft_vocab is None else pair.draft_vocab[index]).view(1, 1)
        drafts.append(tokens[0])
        profile.span("draft", t0, t1)
        stop = policy.needs_confidence and not policy.keep_going(_confidence(pair, logits, qs, index))
        profile.span("sampling", t1, profile.mark())
        if stop:
            break
    return (torch.cat(drafts) if drafts else seq.new_empty(0)), qs


def _confidence(pair: Pair, logits: torch.Tensor, qs: list, index: torch.Tensor) -> torch.Tensor:
    """The draft's probability of the token it just proposed: under q when sampling; greedy drafting has a
    one-hot q, so there it is the draft's temperature-1 probability of its argmax (as HF assisted generation)."""
    if pair.greedy:
        return logits.softmax(-1).amax()
    return qs[-1][0, index[0]]


def _verify(pair: Pair, logits: torch.Tensor, drafts: torch.Tensor, qs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(n accepted, next token) from the target's logits [γ+1, V] at the draft positions and the bonus one."""
    gamma = drafts.shape[0]
    if pair.greedy:
        best = logits.argmax(-1)  # [γ+1]
        n_accepted = (best[:-1] == drafts).long().cumprod(0).sum()
        return n_accepted, best.index_select(0, n_accepted.view(1))[0]
    p = pair.p.probs(logits)  # [γ+1, V]
    q = torch.cat(qs) if gamma else p.new_empty(0, p.shape[-1])
    if pair.draft_vocab is not None and gamma:  # q is 0 outside the subset; the residual covers those exactly
        q = p.new_zeros(gamma, p.shape[-1]).index_copy_(1, pair.draft_vocab, q)
    return verify_draft(p, q, drafts, pair.generator)


def speculative_step(pair: Pair, seq: torch.Tensor, target_cache: DynamicCache, draft_cache: DynamicCache,
                     budget: int, policy: Policy, stats: DecodeStats, profile: Profile) -> tuple[torch.Tensor, list[int]]:
    """Drafts up to `budget` tokens, verifies them in one target pass, rolls both caches back to the committed
    prefix. seq [1, C] holds every committed token (prompt included). Returns the extended seq and the new ids.
    """
    committed = seq.shape[1]
    drafts, qs = _draft_block(pair, seq, draft_cache, budget, policy, profile)
    gamma = drafts.shape[0]
    t0 = profile.mark()
    # Committed tokens the target has not seen (the newest one; the whole prompt at first) + the drafts.
    tokens = torch.cat([seq[:, target_cache.get_seq_length():], drafts.view(1, -1)], 1)
    logits = forward(pair.target, tokens, target_cache, pair.target_head, gamma + 1)
    t1 = profile.mark()
    n_accepted, next_token = _verify(pair, logits, drafts, qs)
    # The one host sync of the step: we need n to crop the caches and the ids to check EOS.
    result = torch.cat([n_accepted.view(1), drafts, next_token.view(1)]).tolist()
    t2 = profile.mark()
    n = result[0]
    new_tokens = result[1:1 + n] + result[-1:]

    seq = torch.cat([seq, drafts[:n].view(1, -1), next_token.view(1, 1)], 1)
    crop(target_cache, committed + n)  # drop rejected drafts; keep all committed tokens but the newest
    crop(draft_cache, min(draft_cache.get_seq_length(), committed + n))  # drop rejected drafts
    profile.span("cache", t2, profile.mark())
    profile.span("target", t0, t1)
    profile.span("sampling", t1, t2)
    stats.accepted.append(n)
    stats.drafted.append(gamma)
    stats.target_passes += 1
    policy.update(gamma, n)
    return seq, new_tokens


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _prompt(input_ids, device: torch.device) -> torch.Tensor:
    prompt = torch.as_tensor(input_ids, device=device).long()
    prompt = prompt.view(1, -1) if prompt.dim() == 1 else prompt
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
        raise PipelineError(f"input_ids must be a non-empty [T] or [1, T] tensor, got shape "
                            f"{tuple(prompt.shape)}: batch size 1 only, one prompt per call")
    return prompt


def _target_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> Sampling:
    if max_new_tokens is None or max_new_tokens < 1:
        raise PipelineError(f"max_new_tokens must be >= 1, got {max_new_tokens}: ask for at least one token")
    return Sampling(temperature, top_k, top_p)  # validates itself with a one-line error


def uses_sliding_window(config) -> bool:
    """Whether a model attends through a sliding window: its KV cache then keeps only the window, and a cache
    that forgot tokens cannot be cropped back to the committed prefix. Qwen2 configs carry `sliding_window`
    with `use_sliding_window: false`; those attend fully."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return True
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _draft_length(gamma: int, draft_length: DraftLength | None) -> DraftLength:
    if draft_length is not None:
        if not isinstance(draft_length, DraftLength):
            raise PipelineError(f"draft_length must be a pipeline.draft_length.DraftLength, got {type(draft_length).__name__}")
        return draft_length
    if not isinstance(gamma, int) or gamma < 1:
        raise PipelineError(f"gamma (draft tokens per step) must be >= 1, got {gamma}: use e.g. gamma=4")
    return DraftLength("fixed", gamma)


def _validate_pair(target, draft, draft_temperature, draft_vocab) -> None:
    if draft_temperature is not None and draft_temperature < 0:
        raise PipelineError(f"draft_temperature must be >= 0 or None, got {draft_temperature}: pass e.g. None")
    for role, model in (("target", target), ("draft", draft)):
        if uses_sliding_window(model.config):
            raise PipelineError(f"the {role} ({type(model).__name__}) uses sliding-window attention, whose KV cache "
                                "cannot be rolled back after a rejected draft: use a full-attention model")
    target_vocab, draft_size = (m.get_output_embeddings().weight.shape[0] for m in (target, draft))
    if target_vocab != draft_size or target.config.vocab_size != draft.config.vocab_size:
        raise PipelineError(f"draft vocabulary ({draft_size}) differs from the target's ({target_vocab}): "
                            "use a draft that shares the target's tokenizer")
    if _device(draft) != _device(target):
        raise PipelineError(f"draft is on {_device(draft)} but target is on {_device(target)}: "
                            "move both models to the same device")
    if draft_vocab is not None:
        if draft_vocab.dim() != 1 or draft_vocab.numel() == 0 or draft_vocab.dtype != torch.long:
            raise PipelineError("draft_vocab must be a non-empty 1-D LongTensor of target token ids")
        if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= target_vocab:
            raise PipelineError(f"draft_vocab has ids outside [0, {target_vocab}): pass target token ids")


@torch.inference_mode()
def speculative_generate(target, draft, input_ids, max_new_tokens=128, gamma=4, temperature=0.7, top_k=0,
                         top_p=1.0, draft_temperature=None, eos_token_id=None, generator=None,
                         draft_vocab=None, draft_length: DraftLength | None = None, tree=None) -> GenerationOutput:
    """Samples from exactly the target's distribution, drafting γ tokens per target pass.

    draft_temperature (None = temperature) changes only q. draft_vocab (FR-Spec, Zhao et al. 2025) is a
    1-D LongTensor of target ids the draft may propose; its head is restricted to those rows.
    draft_length (pipeline.draft_length.DraftLength), when given, decides the tokens per pass instead of a
    fixed γ. generator, if given, must live on the models' device (it drives draft sampling and acceptance).
    tree (a tuple of branching factors per depth, or a list of parent indices) drafts a token tree instead
    of a chain (eval/tree.py); gamma and a fixed draft_length are then unused.
    """
    if tree is not None:
        from eval.tree import tree_generate  # eval.tree builds on this module's helpers
        return tree_generate(target, draft, input_ids, max_new_tokens, tree, temperature, top_k, top_p,
                             draft_temperature, eos_token_id, generator, draft_vocab, draft_length)
    p = _target_sampling(max_new_tokens, temperature, top_k, top_p)
    policy = _draft_length(gamma, draft_length).make()
    run = Run.start(target, draft, input_ids, p, draft_temperature, draft_vocab, generator, DecodeStats())

    def step(seq, room):
        budget = min(policy.budget(), room)
        return speculative_step(run.pair, seq, *run.caches, budget, policy, run.stats, run.profile)

    return run.decode(step, max_new_tokens, eos_token_id)


@dataclass
class Run:
    """One generate call's models, caches and clocks; `decode` is the loop every drafting shape shares."""
    pair: Pair
    seq: torch.Tensor  # the prompt [1, T]
    caches: tuple  # (target cache, draft cache)
    stats: DecodeStats
    profile: Profile
    clock: object
    started: float

    @classmethod
    def start(cls, target, draft, input_ids, p: Sampling, draft_temperature, draft_vocab, generator,
              stats: DecodeStats) -> "Run":
        _validate_pair(target, draft, draft_temperature, draft_vocab)
        device = _device(target)
        clock = synced_clock(device)
        started = clock()
        if draft_vocab is not None:
            draft_vocab = draft_vocab.to(device)
        q = p if draft_temperature is None else p.with_temperature(draft_temperature)
        pair = Pair(target, draft, head_rows(target), head_rows(draft, draft_vocab), p, q, draft_vocab, generator)
        caches = (DynamicCache(config=target.config), DynamicCache(config=draft.config))
        return cls(pair, _prompt(input_ids, device), caches, stats, Profile(device), clock, started)

    def decode(self, step, max_new_tokens: int, eos_token_id) -> GenerationOutput:
        """Calls step(seq, room) -> (seq, new token ids) until max_new_tokens or an EOS; `room` is how many
        drafts can still be used (a step yields at most drafts + 1 tokens: drafting past it would be wasted)."""
        eos, seq, out = _eos_set(eos_token_id), self.seq, []
        while len(out) < max_new_tokens:
            seq, new_tokens = step(seq, max_new_tokens - len(out) - 1)
            hit = next((i for i, t in enumerate(new_tokens) if t in eos), None)
            out += new_tokens if hit is None else new_tokens[:hit + 1]
            if hit is not None:
                break
        self.stats.n_generated = len(out)
        self.stats.total_time = self.clock() - self.started
        self.profile.resolve(self.stats)
        return GenerationOutput(torch.tensor(out, dtype=torch.long), self.stats)


@torch.inference_mode()
def autoregressive_generate(target, input_ids, max_new_tokens=128, temperature=0.7, top_k=0, top_p=1.0,
                            eos_token_id=None, generator=None) -> GenerationOutput:
    """Plain decoding through the same forward helper and cache type as speculative_generate."""
    p = _target_sampling(max_new_tokens, temperature, top_k, top_p)
    device = _device(target)
    clock, profile, stats = synced_clock(device), Profile(device), DecodeStats()
    start = clock()
    eos = _eos_set(eos_token_id)
    head = head_rows(target)
    token = _prompt(input_ids, device)  # the first forward feeds the whole prompt
    cache = DynamicCache(config=target.config)
    out = []
    for _ in range(max_new_tokens):
        t0 = profile.mark()
        logits = forward(target, token, cache, head)
        t1 = profile.mark()
        if p.greedy:  # skip building a one-hot distribution just to take its argmax
            token = logits.argmax(-1, keepdim=True)
        else:
            token = sample(p.probs(logits), generator).view(1, 1)
        out.append(token)
        profile.span("target", t0, t1)
        profile.span("sampling", t1, profile.mark())
        if eos and token.item() in eos:  # the only per-step host sync, and only when there is an EOS to check
            break
    stats.target_passes = stats.n_generated = len(out)
    tokens = torch.cat(out).view(-1).cpu()
    stats.total_time = clock() - start
    profile.resolve(stats)
    return GenerationOutput(tokens, stats)
