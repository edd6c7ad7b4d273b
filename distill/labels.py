"""Teacher labels for the cached-teacher path (distill.objective.teacher=topk): the target's mass on the draft's
FR-Spec subset per position, which collect cannot store because the subset is chosen here (without it a subset
draft's "other" class would guess how much of the tail the subset holds, distill/losses.py), with the top-k labels
where collect stored none and for rows prompt truncation cuts. One target pass over the train rows, or the target's
head alone over the rows' stored final hidden states (collect.hidden_states).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from distill.aligned import batches, completion_hidden
from pipeline.errors import PipelineError
from distill.job import Inputs, Split
from pipeline.atomic import atomic_dir
from pipeline.heads import head_logits, head_rows


def _label_names(k: int, vocab: torch.Tensor | None) -> list[str]:
    return [*(("topk_ids", "topk_logprobs") if k else ()), *(("subset_logmass",) if vocab is not None else ())]


def _label_tensors(logp: torch.Tensor, k: int, vocab: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The label columns' values at each position of the target's log-probs `logp` [..., V]: topk_ids /
    topk_logprobs (when k > 0, at the precision collect stores) and subset_logmass (when `vocab` is set)."""
    out = {}
    if k:
        top = logp.topk(k, -1)
        out["topk_ids"], out["topk_logprobs"] = top.indices.int(), top.values.half().float()
    if vocab is not None:
        out["subset_logmass"] = logp.index_select(-1, vocab).logsumexp(-1)
    return out


@torch.no_grad()
def teacher_labels(target, rows: list[dict], truncation, k: int, vocab: torch.Tensor | None, batch_size: int,
                   pad: int) -> dict[str, list]:
    """Columns per row: topk_ids / topk_logprobs (when k > 0) and subset_logmass (when `vocab` is set)."""
    device = next(target.parameters()).device
    rows_of_head = head_rows(target)
    vocab = None if vocab is None else vocab.to(device)
    # rows of similar length share a batch (less padding); columns return in row order
    order = sorted(range(len(rows)), key=lambda i: sum(map(len, truncation(rows[i]))))
    from tqdm.auto import tqdm

    passes = tqdm(batches([rows[i] for i in order], batch_size, pad, device, truncation), desc="target labels",
                  total=-(-len(rows) // batch_size), unit="batch", dynamic_ncols=True)
    columns: dict[str, list] = {name: [] for name in _label_names(k, vocab)}
    for batch, mask in passes:
        values = _label_tensors(head_logits(completion_hidden(target, batch), rows_of_head).log_softmax(-1), k, vocab)
        for name, value in values.items():
            columns[name] += [value[i, :n].tolist() for i, n in enumerate(mask.sum(1).tolist())]
    place = {i: position for position, i in enumerate(order)}
    return {name: [values[place[i]] for i in range(len(order))] for name, values in columns.items()}


@torch.no_grad()
def labels_from_hidden(target, hidden, lengths: list[int], k: int, vocab: torch.Tensor | None,
                       chunk: int = 4096) -> dict[str, list]:
    """teacher_labels' columns from the rows' stored final hidden states (`hidden`: per row an array [n, H], the
    head's input that produced each completion token): the head alone, a few thousand positions at a time."""
    rows_of_head = head_rows(target)
    weight = rows_of_head[0]
    vocab = None if vocab is None else vocab.to(weight.device)
    columns: dict[str, list] = {name: [] for name in _label_names(k, vocab)}
    pending: list[torch.Tensor] = []

    def flush():
        states = torch.cat(pending).to(weight.device, weight.dtype)
        out = _label_tensors(head_logits(states, rows_of_head).log_softmax(-1), k, vocab)
        start = 0
        for row in pending:
            for name, values in out.items():
                columns[name].append(values[start:start + len(row)].tolist())
            start += len(row)
        pending.clear()

    for states, n in zip(hidden, lengths):
        pending.append(torch.as_tensor(states[:n]))
        if sum(map(len, pending)) >= chunk:
            flush()
    if pending:
        flush()
    return columns


def attach_teacher_labels(inputs: Inputs, split: Split, log) -> Split:
    """The split with the label columns the objective needs on its train rows (those it does not use dropped),
    plus the `length` column the Trainer groups batches by."""
    objective = inputs.settings.objective
    train = split.train
    # seq-KD replaces the off-policy batches by the target's own continuations: cached labels would go unused
    cached_teacher = (objective.teacher == "topk" and objective.loss != "ce" and float(objective.lmbda) < 1
                      and not objective.seq_kd)
    if not cached_teacher:
        train = train.remove_columns([c for c in ("topk_ids", "topk_logprobs") if c in train.column_names])
    else:
        if float(objective.loss_temperature) != 1.0:
            log(f"note: cached top-k labels are T=1 log-probs; at loss_temperature={objective.loss_temperature} "
                "their tail is an even-spread estimate (distill/losses.py); distill.objective.teacher=online is exact")
        k = 0 if "topk_ids" in train.column_names else int(objective.topk)
        if split.share is None:
            columns = train_labels(inputs, split.vocab, train, k, log)
        else:  # labelled once for every train row: the other learning-curve points reuse them
            columns = {name: [values[i] for i in split.share]
                       for name, values in train_labels(inputs, split.vocab, split.all_train, k, log).items()}
        for name, values in columns.items():
            feature = train.features.get(name)  # a relabelled cached column keeps collect's types
            if feature is not None:
                train = train.remove_columns(name)
            train = train.add_column(name, values, feature=feature)
    if float(objective.hidden_weight) > 0 and "final_hidden" not in train.column_names:
        raise PipelineError(f"distill.objective.hidden_weight={objective.hidden_weight} needs the target's final hidden "
                            "states in the rows: collect with collect.hidden_states=true (backend=hf), or set it to 0")
    if "final_hidden" in train.column_names and not float(objective.hidden_weight) > 0:
        train = train.remove_columns("final_hidden")  # labels made: only the recovery loss reads the hidden states
    truncate = inputs.truncation
    train = train.add_column("length", [sum(map(len, truncate(row))) for row in
                                        train.select_columns(["prompt_ids", "completion_ids"])])
    return replace(split, train=train)


def train_labels(inputs: Inputs, vocab: torch.Tensor | None, train, k: int, log) -> dict[str, list]:
    """The label columns the train rows need, on the tokens the draft sees: the top-k labels (`k` > 0: collect
    stored none) and the subset's mass (`vocab` set). Collect labelled each row, and stored its final hidden states,
    on the full prompt; the draft sees only the prompt's last max_prompt_length tokens, so the target would
    condition on context the draft never has. Rows the truncation cuts get every label column from a target pass
    over the truncated row; the others keep collect's labels (no target pass for them)."""
    longest = inputs.truncation.max_prompt_length
    cut = [i for i, ids in enumerate(train["prompt_ids"]) if len(ids) > longest]
    if not cut:
        return uncut_labels(inputs, vocab, train, k, log)
    cached_k = cached_topk(train)
    log(f"{len(cut)} of {len(train)} train rows have a prompt longer than distill.objective.max_prompt_length="
        f"{longest}: their labels come from a target pass over the last {longest} prompt tokens (collect's were "
        "computed on the full prompt, context the draft never sees)")
    fresh = cached_teacher_labels(inputs, vocab, train.select(cut), k or cached_k, log)
    kept = sorted(set(range(len(train))) - set(cut))
    rest = {name: [] for name in fresh}
    if kept:
        rest = uncut_labels(inputs, vocab, train.select(kept), k, log)
        if cached_k:
            rest.update(train.select(kept).select_columns(["topk_ids", "topk_logprobs"]).to_dict())
    columns = {name: [None] * len(train) for name in fresh}
    for rows, part in ((cut, fresh), (kept, rest)):
        for name, values in part.items():
            for i, value in zip(rows, values):
                columns[name][i] = value
    return columns


def cached_topk(train) -> int:
    """k of the top-k labels collect stored in the rows (0: none)."""
    if "topk_ids" not in train.column_names:
        return 0
    return next((len(row["topk_ids"][0]) for row in train.select_columns(["topk_ids"]) if row["topk_ids"]), 0)


def uncut_labels(inputs: Inputs, vocab: torch.Tensor | None, train, k: int, log) -> dict[str, list]:
    """The missing label columns of rows the truncation does not cut: from their stored final hidden states
    (the head alone) when collect kept them, else from the (cached) target pass."""
    if not k and vocab is None:
        return {}
    if "final_hidden" in train.column_names:  # the head alone, no target pass: nothing to share or cache
        return hidden_labels(inputs, vocab, train, k, log)
    return cached_teacher_labels(inputs, vocab, train, k, log)


def hidden_labels(inputs: Inputs, vocab: torch.Tensor | None, train, k: int, log) -> dict[str, list]:
    """labels_from_hidden over the train rows, on the completion tokens the trainer keeps."""
    t0 = time.time()
    longest = inputs.truncation.max_completion_length
    lengths = [min(len(ids), longest) for ids in train["completion_ids"]]
    columns = labels_from_hidden(inputs.target, train.with_format("numpy", columns=["final_hidden"])["final_hidden"],
                                 lengths, k, vocab)
    log(f"{', '.join(columns)} for {len(train)} train rows from their stored final hidden states "
        f"(the target's head alone) in {time.time() - t0:.0f}s")
    return columns


def cached_teacher_labels(inputs: Inputs, vocab: torch.Tensor | None, train, k: int, log) -> dict[str, list]:
    """teacher_labels over the train rows, kept under ${paths.cache}/distill/ by what decides them (target, rows,
    truncation, k, subset): a resumed run, or another draft trained on the same rows, skips the target pass."""
    from datasets import Dataset, load_from_disk

    rows = [{"prompt_ids": p, "completion_ids": c} for p, c in zip(train["prompt_ids"], train["completion_ids"])]
    truncation = inputs.truncation
    key = hashlib.sha256(json.dumps({
        "target": inputs.target_ident.get("source_sha256") or inputs.target_ident.get("path"), "k": k,
        "truncation": [truncation.max_prompt_length, truncation.max_completion_length],
        "vocab": None if vocab is None else vocab.tolist(), "rows": rows}, default=str).encode()).hexdigest()[:16]
    path = Path(inputs.cfg.paths.cache) / "distill" / f"labels-{key}"
    if path.exists():
        log(f"teacher labels for {len(rows)} train rows from {path}")
        return load_from_disk(str(path)).to_dict()
    t0 = time.time()
    columns = teacher_labels(inputs.target, rows, truncation, k, vocab, int(inputs.settings.heldout.batch_size),
                             inputs.tokenizer.pad_token_id)
    log(f"target pass over {len(rows)} train rows for {', '.join(columns)} in {time.time() - t0:.0f}s")
    if inputs.is_main:
        with atomic_dir(path) as tmp:
            Dataset.from_dict(columns).save_to_disk(str(tmp))
    return columns
