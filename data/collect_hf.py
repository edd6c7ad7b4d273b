"""The collect stage's Hugging Face backend: batched, left-padded `generate` on CPU or CUDA, with the
target's top-k log-probabilities taken from the raw logits (before any sampling filter) and, with
collect.hidden_states, the output head's input at each step (the final hidden state); OnPolicyBackend below."""
from __future__ import annotations

import contextlib
import time

import torch
from torch.nn.utils.rnn import pad_sequence

from data.collect_rows import CollectSettings, Completion
from pipeline.errors import PipelineError
from pipeline.heads import head_inputs, head_logits, head_rows


class HFBackend:
    """Batched `generate` with left padding; halves the batch on CUDA out-of-memory and retries. labels=False: the
    tokens alone (no top-k, no hidden states), for a model whose distribution is not the label (collect.onpolicy)."""

    def __init__(self, model, pad_id: int, stop_ids: list[int], settings: CollectSettings, labels: bool = True):
        from transformers import GenerationConfig

        self.model, self.pad_id, self.stop_ids = model, pad_id, set(stop_ids)
        # batch_size is this backend's own copy: an out-of-memory retry halves it for the rest of the run.
        self.topk, self.hidden = (settings.topk, settings.stores_hidden) if labels else (0, False)
        self.batch_size = settings.batch_size
        self.device = next(model.parameters()).device
        # The stage's settings are the only sampling settings: the checkpoint's generation_config
        # defaults (e.g. a repetition_penalty) would otherwise fill every field left unset here.
        model.generation_config = GenerationConfig(eos_token_id=list(stop_ids), pad_token_id=pad_id,
                                                   bos_token_id=model.config.bos_token_id)
        sampling = settings.sampling
        self.gen_config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens, do_sample=not sampling.greedy,
            **({} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                           "top_k": sampling.top_k}),  # top_k=0 explicitly: HF's default is 50
            eos_token_id=list(stop_ids), pad_token_id=pad_id,
            # raw logits are generate's pre-processing logits (transformers 5.x `_sample`:
            # stored before logits_processor), i.e. the target's distribution at temperature 1.
            output_logits=self.topk > 0, return_dict_in_generate=True)

    def generate(self, contexts: list[list[int]], seed: int, progress=None) -> list[Completion]:
        while True:
            done = [0]

            def count(n):
                done[0] += n
                if progress:
                    progress(n)
            try:
                return self._generate(contexts, seed, count)
            except RuntimeError as e:  # torch.OutOfMemoryError is one
                if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
                    raise
                if progress and done[0]:
                    progress(-done[0])
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                if self.batch_size == 1:
                    raise PipelineError("out of memory at collect.batch_size=1: lower collect.max_new_tokens "
                                        "or collect.topk, or use a larger device") from None
                self.batch_size //= 2
                print(f"[collect] out of memory: retrying with batch_size={self.batch_size}")

    def _generate(self, contexts: list[list[int]], seed: int, progress) -> list[Completion]:
        torch.manual_seed(seed)
        out: list[Completion | None] = [None] * len(contexts)
        for idx in self._batches([len(c) for c in contexts]):
            for i, completion in zip(idx, self._generate_batch([contexts[i] for i in idx])):
                out[i] = completion
            progress(len(idx))
        return out

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices grouped into batches of at most batch_size, longest first (similar lengths share
        a batch; an OOM shows up in the first one). A batch also closes when left padding would
        more than double its prefill (width x rows > 2 x real tokens): one long context among
        short ones would otherwise multiply the prefill work of the whole batch."""
        batches: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            batch = batches[-1] if batches else []
            grown = batch + [i]
            if batch and len(grown) <= self.batch_size and \
                    len(grown) * lengths[grown[0]] <= 2 * sum(lengths[j] for j in grown):
                batch.append(i)
            else:
                batches.append([i])
        return batches

    @torch.inference_mode()
    def _generate_batch(self, contexts: list[list[int]]) -> list[Completion]:
        rows = [torch.tensor(ctx, dtype=torch.long) for ctx in contexts]  # left padding: they end at the same column
        input_ids = pad_sequence(rows, batch_first=True, padding_value=self.pad_id, padding_side="left")
        attention_mask = pad_sequence([torch.ones_like(row) for row in rows], batch_first=True, padding_side="left")
        width = input_ids.shape[1]
        steps_hidden: list[torch.Tensor] = []
        with head_inputs(self.model, steps_hidden, last_only=True) if self.hidden else contextlib.nullcontext():
            result = self.model.generate(input_ids=input_ids.to(self.device),
                                         attention_mask=attention_mask.to(self.device),
                                         generation_config=self.gen_config)
        generated = result.sequences[:, width:].cpu().tolist()
        hidden = torch.stack(steps_hidden, 1).to(torch.float16).cpu().numpy() if self.hidden else None
        top_ids = top_lp = None
        if self.topk:
            # One [B, V] step at a time: a full [B, T, V] log_softmax would double the peak memory.
            steps = [torch.log_softmax(logits.float(), dim=-1).topk(self.topk, dim=-1) for logits in result.logits]
            top_ids = torch.stack([s.indices for s in steps], 1).to(torch.int32).cpu().numpy()
            top_lp = torch.stack([s.values for s in steps], 1).to(torch.float16).cpu().numpy()
        del result
        completions = []
        for row, tokens in enumerate(generated):
            end = next((j for j, t in enumerate(tokens) if t in self.stop_ids), None)
            n, reason = (end + 1, "eos") if end is not None else (len(tokens), "length")
            completions.append(Completion(tokens[:n], reason,
                                          top_ids[row, :n] if top_ids is not None else None,
                                          top_lp[row, :n] if top_lp is not None else None,
                                          hidden[row, :n] if hidden is not None else None))
        return completions


class OnPolicyBackend(HFBackend):
    """Rows of the draft's tokens with the target's labels (DistillSpec's on-policy data, Zhou et al. 2023): the
    draft samples each batch (HFBackend's batching, seeding and out-of-memory retry, without labels), then the target
    labels it in one forward pass over prompt + completion, a prefill instead of a token-by-token generation."""

    def __init__(self, draft, target, pad_id: int, stop_ids: list[int], settings: CollectSettings):
        super().__init__(draft, pad_id, stop_ids, settings, labels=False)
        self.target, self.label_topk, self.label_hidden = target, settings.topk, settings.stores_hidden
        self.draft_cpu_s = 0.0  # process CPU seconds of the draft's sampling, until take_draft_cpu_s

    def take_draft_cpu_s(self) -> float:
        spent, self.draft_cpu_s = self.draft_cpu_s, 0.0
        return spent

    def _generate_batch(self, contexts: list[list[int]]) -> list[Completion]:
        cpu = time.process_time()
        completions = super()._generate_batch(contexts)
        self.draft_cpu_s += time.process_time() - cpu
        return self._label(contexts, completions)

    def _label(self, contexts: list[list[int]], completions: list[Completion]) -> list[Completion]:
        return label_completions(self.target, self.pad_id, contexts, completions, self.label_topk, self.label_hidden)


@torch.inference_mode()
def label_completions(target, pad_id: int, contexts: list[list[int]], completions: list[Completion], topk: int,
                      hidden: bool) -> list[Completion]:
    """Sets the target's top-k T = 1 log-probs (and final hidden states) at each completion position, as a
    target-generated row carries them, from one forward pass over context + completion (on-policy and text rows).
    Right padding: positions count from 0 in every row without position ids; the head runs on the completion
    positions alone."""
    sequences = [context + completion.ids[:-1] for context, completion in zip(contexts, completions)]
    rows = [torch.tensor(sequence, dtype=torch.long) for sequence in sequences]
    input_ids = pad_sequence(rows, batch_first=True, padding_value=pad_id)
    attention_mask = pad_sequence([torch.ones_like(row) for row in rows], batch_first=True)
    device = next(target.parameters()).device
    states_all = target.get_decoder()(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      use_cache=False).last_hidden_state
    head = head_rows(target)
    for row, (context, completion) in enumerate(zip(contexts, completions)):
        states = states_all[row, len(context) - 1:len(context) - 1 + len(completion.ids)]  # state j predicts ids[j]
        top = head_logits(states, head).log_softmax(-1).topk(topk, dim=-1)
        completion.topk_ids = top.indices.to(torch.int32).cpu().numpy()
        completion.topk_logprobs = top.values.to(torch.float16).cpu().numpy()
        if hidden:
            completion.final_hidden = states.to(torch.float16).cpu().numpy()
    return completions


def label_text_shard(target, pad_id: int, rows: list[dict], topk: int, hidden: bool, batch_size: int,
                     tokenizer) -> list[dict]:
    """`rows` with the target's top-k T = 1 log-probs (and final hidden states) at every completion position, from one
    forward pass per batch of similar lengths (`label_completions`)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["prompt_ids"]) - len(rows[i]["completion_ids"]))
    out = [dict(row) for row in rows]
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        completions = [Completion(rows[i]["completion_ids"], rows[i]["finish_reason"]) for i in batch]
        label_completions(target, pad_id, [rows[i]["prompt_ids"] for i in batch], completions, topk, hidden)
        for i, completion in zip(batch, completions):
            out[i].update(topk_ids=completion.topk_ids, topk_logprobs=completion.topk_logprobs,
                          text=tokenizer.decode(completion.ids, skip_special_tokens=True))
            if hidden:
                out[i]["final_hidden"] = completion.final_hidden
    return out
