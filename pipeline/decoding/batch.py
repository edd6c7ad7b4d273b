"""Batched decoding: B prompts of different lengths decoded together, speculatively (a chain of fixed γ) or
plainly, each row sampling exactly the target's distribution, as at batch size 1 (docs/architecture.md, "Batches":
the `RaggedCache`'s holes, masks and compaction). Caches keep the chain's convention (chain.py).

    out = speculative_generate_batch(target, draft, [ids_a, ids_b, ids_c], sampling=Sampling(0.7), plan=DraftPlan(4))
    out.tokens[1], out.stats[1].accepted
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pipeline import sampling as sampling_math
from pipeline.decoding.draft_length import DraftLength
from pipeline.decoding.generate import GREEDY, check_plan
from pipeline.decoding.plan import DraftPlan
from pipeline.decoding.loop import (DecodeStats, additive_mask, check_mask_attention, check_pair, check_request,
                                    draft_head_rows, eos_set, model_device)
from pipeline.errors import PipelineError
from pipeline.heads import head_logits, scatter_to_vocab
from pipeline.sampling import Sampling, sample
from pipeline.timing import synced_clock


@dataclass
class BatchOutput:
    tokens: list[torch.Tensor]  # per row: 1-D LongTensor of generated ids, prompt excluded
    stats: list[DecodeStats]  # per row: accepted/drafted per pass the row took part in; total_time the batch's
    target_passes: int  # batched target forwards
    total_time: float


class RaggedCache:
    """One model's KV cache for a batch whose rows hold different numbers of tokens (module docstring)."""

    def __init__(self, model, batch: int, device: torch.device, vocab: torch.Tensor | None = None):
        self.model, self.head = model, draft_head_rows(model, vocab)
        self.cache = DynamicCache(config=model.config)
        self.valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.holes = False

    def forward(self, tokens: torch.Tensor, fed: torch.Tensor, n_logits: int) -> torch.Tensor:
        """Feeds tokens [B, k] (fed [B, k]: False for padding) after each row's valid slots; fp32 logits
        [B, n_logits, V] of the last n_logits positions."""
        slots, k = self.valid.shape[1], tokens.shape[1]
        positions = (self.valid.sum(1, keepdim=True) + fed.cumsum(1) - 1).clamp_min(0)
        visible = torch.cat([self.valid, fed], 1)  # [B, slots + k]
        causal = torch.ones(k, slots + k, dtype=torch.bool, device=tokens.device).tril(slots)
        mask = additive_mask(causal.unsqueeze(0) & visible.unsqueeze(1), self.model.dtype)  # [B, k, slots + k]
        hidden = self.model.model(input_ids=tokens, attention_mask=mask.unsqueeze(1), position_ids=positions,
                                  cache=self.cache, use_cache=True).last_hidden_state
        self.valid = visible
        return head_logits(hidden[:, -n_logits:], self.head)

    def keep_last(self, keep: torch.Tensor) -> None:
        """Keeps, of each row's last keep.shape[1] slots, those where keep [B, k] is True; the rest become holes."""
        if keep.shape[1] and not bool(keep.all()):
            self.valid[:, -keep.shape[1]:] &= keep
            self.holes = True

    def compact(self) -> None:
        """Each row's valid slots gathered, in order, to the right end; columns no row uses cut."""
        if not self.holes:
            return
        width = int(self.valid.sum(1).max())
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.valid.shape[1] - width:]
        self.valid = self.valid.gather(1, order)
        for layer in self.cache.layers:
            index = order.view(order.shape[0], 1, width, 1).expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.holes = False

    def select(self, rows: torch.Tensor) -> None:
        """Keeps only these rows of the batch."""
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]


def left_padded(prompts, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], real-token mask [B, T]) of 1-D prompts, left-padded with id 0."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise PipelineError("prompts must be a non-empty list of 1-D token-id tensors: one prompt per row")
    rows = [torch.as_tensor(p, device=device).long().view(-1) for p in prompts]
    if any(r.numel() == 0 for r in rows):
        raise PipelineError("a prompt of the batch is empty: every row needs at least one token")
    width = max(r.numel() for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for b, row in enumerate(rows):
        ids[b, width - row.numel():], mask[b, width - row.numel():] = row, True
    return ids, mask


def verify_rows(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, generator, greedy: bool):
    """(n accepted [B], next token [B]) per row from target probabilities p [B, γ+1, V] (logits when greedy) and
    the drafts' q [B, γ, V]: pipeline.sampling.verify_draft on every row at once."""
    batch, gamma = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    if greedy:
        best = p.argmax(-1)
        n = (best[:, :-1] == drafts).long().cumprod(1).sum(1)
        return n, best[rows, n]
    p_x, q_x = p[:, :gamma].gather(2, drafts.unsqueeze(2))[..., 0], q.gather(2, drafts.unsqueeze(2))[..., 0]
    u = torch.rand(batch, gamma, device=p.device, generator=generator)
    n = (u * q_x < p_x).long().cumprod(1).sum(1)
    q_ext = torch.cat([q, torch.zeros_like(p[:, :1])], 1)  # the all-accepted case: the residual of p_γ is p_γ
    return n, sample(sampling_math.residual_distribution(p[rows, n], q_ext[rows, n]), generator)


class BatchRun:
    """One batched call: the rows still decoding, their caches and what each model has not yet been fed."""

    def __init__(self, target, draft, prompts, p: Sampling, q: Sampling, generator, draft_vocab=None):
        self.device = model_device(target)
        ids, mask = left_padded(prompts, self.device)
        self.p, self.q, self.generator = p, q, generator
        self.vocab = None if draft_vocab is None else draft_vocab.to(self.device)  # FR-Spec: the draft's rows
        self.target = RaggedCache(target, len(ids), self.device)
        self.draft = None if draft is None else RaggedCache(draft, len(ids), self.device, self.vocab)
        self.rows = list(range(len(ids)))  # the original index of each row still decoding
        self.pending = {"target": (ids, mask), "draft": (ids, mask)}  # (tokens, fed) each model lacks

    def draft_block(self, gamma: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """γ draft tokens per row [B, γ] and, when sampling, their distributions q [B, γ, V]."""
        tokens, fed = self.pending["draft"]
        drafts, qs = [], []
        for _ in range(gamma):
            logits = self.draft.forward(tokens, fed, 1)[:, 0]
            if self.p.greedy and self.q.greedy:
                index = logits.argmax(-1)
            else:
                qs.append(self.q.probs(logits))  # exactly the distribution the token is sampled from
                index = sample(qs[-1], self.generator)
            token = index if self.vocab is None else self.vocab[index]
            drafts.append(token)
            tokens, fed = token.view(-1, 1), torch.ones(len(index), 1, dtype=torch.bool, device=self.device)
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def step(self, gamma: int) -> list[list[int]]:
        """One pass over every row: γ drafts (none at γ = 0), one target forward, verification, rollback. Returns
        per row [n accepted, drafts..., next token] (the one host sync)."""
        tokens, fed = self.pending["target"]
        drafts, qs = self.draft_block(gamma) if gamma else (tokens.new_zeros(len(tokens), 0), None)
        tokens, fed = torch.cat([tokens, drafts], 1), torch.cat([fed, torch.ones_like(drafts, dtype=torch.bool)], 1)
        logits = self.target.forward(tokens, fed, gamma + 1)
        if self.p.greedy and self.q.greedy:
            n, next_token = verify_rows(logits, None, drafts, self.generator, greedy=True)
        else:
            p = self.p.probs(logits)
            # q is 0 outside a draft vocabulary subset: the residual covers those tokens exactly
            q = scatter_to_vocab(qs, self.vocab, p.shape[-1]) if qs is not None else p.new_zeros(len(p), 0, p.shape[-1])
            n, next_token = verify_rows(p, q, drafts, self.generator, greedy=False)
        result = torch.cat([n.view(-1, 1), drafts, next_token.view(-1, 1)], 1).tolist()
        self.roll_back(gamma, n, drafts, next_token)
        return result

    def roll_back(self, gamma: int, n: torch.Tensor, drafts: torch.Tensor, next_token: torch.Tensor) -> None:
        """Rejected drafts become holes; each model's pending tokens are what it now lacks."""
        ones = torch.ones(len(n), 1, dtype=torch.bool, device=self.device)
        # target slots fed: the newest committed token, then d1..dγ; it keeps the token and d1..dn
        self.target.keep_last(torch.arange(gamma + 1, device=self.device).view(1, -1) <= n.view(-1, 1))
        self.pending["target"] = next_token.view(-1, 1), ones
        if self.draft is None:
            return
        if gamma:  # draft slots fed: its pending tokens, then d1..dγ−1 (it never feeds its own last proposal)
            self.draft.keep_last(torch.arange(1, gamma, device=self.device).view(1, -1) <= n.view(-1, 1))
            last = torch.stack([drafts[:, -1], next_token], 1)  # dγ is pending only when every draft was accepted
            self.pending["draft"] = last, torch.cat([(n == gamma).view(-1, 1), ones], 1)
        else:  # the draft fed nothing this pass (the prefill): it lacks what it lacked and the new token
            tokens, fed = self.pending["draft"]
            self.pending["draft"] = torch.cat([tokens, next_token.view(-1, 1)], 1), torch.cat([fed, ones], 1)
        self.target.compact()
        self.draft.compact()

    def keep_rows(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for cache in filter(None, (self.target, self.draft)):
            cache.select(index)
            cache.holes = True  # columns only the finished rows used are cut at the next compaction
        self.pending = {k: (tokens[index], fed[index]) for k, (tokens, fed) in self.pending.items()}
        self.rows = [self.rows[i] for i in keep]


@torch.inference_mode()
def decode_batch(run: BatchRun, gamma: int, max_new_tokens: int, eos_token_id) -> BatchOutput:
    """The loop: passes until every row has an EOS or max_new_tokens; the first pass is the plain prefill."""
    clock = synced_clock(run.device)
    started = clock()
    eos, batch = eos_set(eos_token_id), len(run.rows)
    out, stats, passes = [[] for _ in range(batch)], [DecodeStats() for _ in range(batch)], 0
    while run.rows:
        room = max(max_new_tokens - len(out[r]) for r in run.rows) - 1
        drafted = 0 if passes == 0 or run.draft is None else min(gamma, room)
        result = run.step(drafted)
        passes += 1
        keep = []
        for i, (row, values) in enumerate(zip(run.rows, result)):
            n = values[0]
            new = (values[1:1 + n] + values[-1:])[:max_new_tokens - len(out[row])]
            hit = next((k for k, t in enumerate(new) if t in eos), None)
            out[row] += new if hit is None else new[:hit + 1]
            s = stats[row]
            s.accepted.append(n), s.drafted.append(drafted)
            s.target_passes += 1
            if hit is None and len(out[row]) < max_new_tokens:
                keep.append(i)
        if len(keep) < len(run.rows):
            run.keep_rows(keep)
    total = clock() - started
    for s, tokens in zip(stats, out):
        s.n_generated, s.total_time = len(tokens), total
    return BatchOutput([torch.tensor(t, dtype=torch.long) for t in out], stats, passes, total)


def speculative_generate_batch(target, draft, prompts, *, plan: DraftPlan = DraftPlan(), sampling: Sampling = GREEDY,
                               max_new_tokens: int = 128, eos_token_id=None,
                               generator: torch.Generator | None = None) -> BatchOutput:
    """Speculative decoding of a batch of prompts (a list of 1-D id tensors of any lengths), a chain of the plan's
    fixed γ drafts per pass for every row, each row exactly the target's distribution `sampling`. The keywords
    mean what they mean for speculative_generate; a plan without drafting decodes the batch plainly."""
    check_request(sampling, max_new_tokens)
    check_plan(plan)
    if not plan.speculates:
        return autoregressive_generate_batch(target, prompts, sampling=sampling, max_new_tokens=max_new_tokens,
                                             eos_token_id=eos_token_id, generator=generator)
    shape = plan.shape
    if not isinstance(shape, DraftLength) or shape.policy != "fixed" or plan.guard is not None:
        raise PipelineError(f"batched decoding drafts a fixed γ per pass, not {plan.describe()}"
                            f"{' with a guard' if plan.guard else ''}: pass e.g. plan=DraftPlan(4)")
    check_pair(target, draft, plan.draft_vocab)
    check_mask_attention("batched decoding", target=target, draft=draft)
    tau = plan.draft_temperature
    q = sampling if tau is None else sampling.with_temperature(tau)
    run = BatchRun(target, draft, prompts, sampling, q, generator, plan.draft_vocab)
    return decode_batch(run, shape.max, max_new_tokens, eos_token_id)


def autoregressive_generate_batch(target, prompts, *, sampling: Sampling = GREEDY, max_new_tokens: int = 128,
                                  eos_token_id=None, generator: torch.Generator | None = None) -> BatchOutput:
    """Plain decoding of a batch through the same loop, caches and masks (γ = 0, no draft)."""
    check_request(sampling, max_new_tokens)
    check_mask_attention("batched decoding", target=target)
    return decode_batch(BatchRun(target, None, prompts, sampling, sampling, generator), 0, max_new_tokens,
                        eos_token_id)
