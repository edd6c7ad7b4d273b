"""Teacher labels see the tokens the draft sees: training keeps a row's last max_prompt_length prompt tokens, and
collect labelled the row (top-k log-probs, final hidden states) on its full prompt. A row the truncation cuts is
relabelled by a target pass over the truncated row; a row it does not cut keeps collect's labels bit for bit,
with no target pass. The held-out simulator, the online teacher and on-policy batches already condition on the
truncated prompt; tests here pin that too. Tiny random model (wide init: its outputs depend on early context)."""
from __future__ import annotations

import types

import pytest
import torch
from omegaconf import OmegaConf

from distill import labels
from distill.batch import Truncation, batches, completion_hidden
from tests.conftest import decoder_llama

VOCAB, K, LONGEST = 32, 4, 8  # vocabulary, top-k of the labels, max_prompt_length of these tests
TRUNCATION = Truncation(LONGEST, 64)
WHOLE = Truncation(10_000, 64)  # what collect labelled on: the full prompt
STAMP = 0.25  # added to the cached log-probs of uncut rows: a needless relabel would show


@pytest.fixture(scope="module")
def target():
    return decoder_llama(seed=3, vocab=VOCAB)


@pytest.fixture(scope="module")
def rows():
    """Collected rows: even rows have prompts longer than LONGEST (the truncation cuts them), odd rows do not."""
    g = torch.Generator().manual_seed(0)
    return [{"prompt_ids": torch.randint(2, VOCAB, (LONGEST + 6 + i if i % 2 == 0 else 3 + i // 2,), generator=g).tolist(),
             "completion_ids": torch.randint(2, VOCAB, (5 + i % 3,), generator=g).tolist()} for i in range(6)]


CUT, KEPT = [0, 2, 4], [1, 3, 5]


def collected(target, rows, topk: bool, hidden: bool):
    """The rows as collect stores them: labels and final hidden states from the full prompt, collect's types."""
    from datasets import Dataset, Features

    from data.collect_rows import features

    data = {"prompt_ids": [r["prompt_ids"] for r in rows], "completion_ids": [r["completion_ids"] for r in rows]}
    if topk:
        full = labels.teacher_labels(target, rows, WHOLE, K, None, 2, 0)
        data["topk_ids"] = full["topk_ids"]
        data["topk_logprobs"] = [lps if len(row["prompt_ids"]) > LONGEST else
                                 (torch.tensor(lps, dtype=torch.float16) + STAMP).tolist()
                                 for row, lps in zip(rows, full["topk_logprobs"])]
    if hidden:
        with torch.no_grad():
            data["final_hidden"] = [completion_hidden(target, batch)[0].half().tolist()
                                    for batch, _ in batches(rows, 1, 0, "cpu")]
    types_of = features(K if topk else 0, hidden)
    return Dataset.from_dict(data, features=Features({name: types_of[name] for name in data}))


def attach(target, train, tmp_path, vocab=None):
    from distill.job import Split

    settings = OmegaConf.create({"objective": {"teacher": "topk", "loss": "fkl", "lmbda": 0.0, "seq_kd": False,
                                               "loss_temperature": 1.0, "topk": K}, "heldout": {"batch_size": 2}})
    inputs = types.SimpleNamespace(target=target, target_ident={"path": "tiny"}, truncation=TRUNCATION, is_main=True,
                                   settings=settings, tokenizer=types.SimpleNamespace(pad_token_id=0),
                                   cfg=OmegaConf.create({"paths": {"cache": str(tmp_path)}}))
    return labels.attach_teacher_labels(inputs, Split(train, [], "test", vocab), print).train


@pytest.fixture
def passes(monkeypatch):
    """The prompt lengths of the rows each target label pass runs over."""
    seen = []
    original = labels.teacher_labels
    monkeypatch.setattr(labels, "teacher_labels", lambda target, rows, *a: seen.append(
        [len(r["prompt_ids"]) for r in rows]) or original(target, rows, *a))
    return seen


def assert_labels_equal(got: dict, want: dict, rows: list[int]):
    for i in rows:
        assert got["topk_ids"][i] == want["topk_ids"][i], i
        for name in ("topk_logprobs", "subset_logmass"):
            if name in want:
                assert torch.allclose(torch.tensor(got[name][i]), torch.tensor(want[name][i]), atol=2e-3), (name, i)


def out_features(target, train, tmp_path):
    return attach(target, train, tmp_path).features["topk_logprobs"]


def differs(got: dict, want: dict, rows: list[int]) -> bool:
    return any(got["topk_ids"][i] != want["topk_ids"][i] or not torch.allclose(
        torch.tensor(got["topk_logprobs"][i]), torch.tensor(want["topk_logprobs"][i]), atol=2e-3) for i in rows)


# ---------------------------------------------------------------- cached top-k labels
def test_a_row_the_truncation_cuts_gets_the_targets_labels_on_its_truncated_prompt(target, rows, tmp_path):
    train = collected(target, rows, topk=True, hidden=False)
    fresh = labels.teacher_labels(target, rows, TRUNCATION, K, None, 2, 0)  # a target pass over every truncated row
    out = attach(target, train, tmp_path).to_dict()
    assert_labels_equal(out, fresh, CUT)
    assert differs(train.to_dict(), fresh, CUT)  # the old behaviour (collect's labels kept) fails the check above
    assert out["topk_ids"] == [fresh["topk_ids"][i] for i in range(len(rows))]


def test_rows_the_truncation_does_not_cut_keep_their_cached_labels_bit_for_bit(target, rows, tmp_path, passes):
    train = collected(target, rows, topk=True, hidden=False)
    passes.clear()  # collect's own pass
    out = attach(target, train, tmp_path).to_dict()
    cached = train.to_dict()
    for name in ("topk_ids", "topk_logprobs"):
        assert [out[name][i] for i in KEPT] == [cached[name][i] for i in KEPT]
    assert out_features(target, train, tmp_path) == train.features["topk_logprobs"]  # collect's float16 kept
    assert [sorted(p) for p in passes] == [sorted(len(rows[i]["prompt_ids"]) for i in CUT)]  # the cut rows only
    fresh = labels.teacher_labels(target, rows, TRUNCATION, K, None, 2, 0)
    assert differs(cached, fresh, KEPT)  # the stamp: a needless relabel of these rows would have changed them


def test_without_cut_rows_no_target_pass_runs(target, rows, tmp_path, passes):
    short = [rows[i] for i in KEPT]
    train = collected(target, short, topk=True, hidden=False)
    passes.clear()
    out = attach(target, train, tmp_path).to_dict()
    assert passes == [] and out["topk_logprobs"] == train.to_dict()["topk_logprobs"]
