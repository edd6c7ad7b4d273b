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
from distill.aligned import Truncation, batches, completion_hidden
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


def stage_inputs(target, tmp_path):
    """What attach_teacher_labels reads of the stage's Inputs."""
    settings = OmegaConf.create({"objective": {"teacher": "topk", "loss": "fkl", "lmbda": 0.0, "seq_kd": False,
                                               "loss_temperature": 1.0, "topk": K, "hidden_weight": 0.0},
                                 "heldout": {"batch_size": 2}})
    return types.SimpleNamespace(target=target, target_ident={"path": "tiny"}, truncation=TRUNCATION, is_main=True,
                                 settings=settings, tokenizer=types.SimpleNamespace(pad_token_id=0),
                                 cfg=OmegaConf.create({"paths": {"cache": str(tmp_path)}}))


def attach(target, train, tmp_path, vocab=None, share=None):
    """The train rows with their label columns; `share`: a learning-curve point's rows of `train`."""
    from distill.job import Split

    split = Split(train, [], "test", vocab) if share is None else Split(train.select(share), [], "test", vocab,
                                                                          train, share)
    return labels.attach_teacher_labels(stage_inputs(target, tmp_path), split, print).train


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


# ---------------------------------------------------------------- labels from stored final hidden states
def test_a_cut_row_with_stored_hidden_states_is_labelled_on_its_truncated_prompt(target, rows, tmp_path, passes):
    """collect.hidden_states rows: the cut rows' hidden states came from the full prompt, so the head alone would
    give full-prompt labels; they get the target pass, the others the head alone."""
    train = collected(target, rows, topk=False, hidden=True)
    vocab = torch.arange(0, VOCAB, 2)
    fresh = labels.teacher_labels(target, rows, TRUNCATION, K, vocab, 2, 0)
    passes.clear()
    out = attach(target, train, tmp_path, vocab).to_dict()
    assert "final_hidden" not in out
    assert_labels_equal(out, fresh, CUT)
    assert [sorted(p) for p in passes] == [sorted(len(rows[i]["prompt_ids"]) for i in CUT)]  # the cut rows only
    stored = labels.labels_from_hidden(target, train.with_format("torch")["final_hidden"],
                                       [len(r["completion_ids"]) for r in rows], K, vocab)
    for name in ("topk_ids", "subset_logmass"):
        assert [out[name][i] for i in KEPT] == [stored[name][i] for i in KEPT]
    assert differs(stored, fresh, CUT)  # the old behaviour (the head on the full-prompt states) fails the check


# ---------------------------------------------------------------- the paths that were consistent already
def test_heldout_distribution_is_the_targets_on_the_truncated_prompt(target, rows):
    """build_heldout truncates its rows before its own target pass: nothing cached from collect is used."""
    from distill.simulator import build_heldout
    from pipeline.sampling import Sampling

    fresh = labels.teacher_labels(target, rows, TRUNCATION, K, None, 2, 0)
    sampling = Sampling(temperature=1.0)

    def heldout_labels(truncation):
        held = build_heldout(target, [r | {"domain": "chat"} for r in rows], sampling, truncation, K, 2, 0)
        ids, probs = held.p_ids.split([len(r["completion_ids"]) for r in rows]), held.p_probs.split(
            [len(r["completion_ids"]) for r in rows])
        return {"topk_ids": [i.tolist() for i in ids], "topk_logprobs": [p.log().tolist() for p in probs]}

    assert_labels_equal(heldout_labels(TRUNCATION), fresh, range(len(rows)))
    assert differs(heldout_labels(WHOLE), fresh, CUT)  # a held-out pass on the full prompt fails the check


def test_online_teacher_and_on_policy_batches_condition_on_the_truncated_prompt(target, rows):
    """The collator lays out the truncated prompt: the online teacher runs on that layout, and on-policy (or
    seq-KD) generation continues `prompts`, its first columns, which TRL's causal layout then carries."""
    from distill.trainer import CAUSAL, DistillCollator, DistillTrainer, positions

    fresh = labels.teacher_labels(target, rows, TRUNCATION, K, None, 2, 0)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
                                    teacher_model=target, vocab=None)

    def online(batch):
        logp = DistillTrainer.teacher_logits(trainer, positions(batch)).log_softmax(-1).topk(K, -1)
        return {"topk_ids": [logp.indices.tolist()], "topk_logprobs": [logp.values.tolist()]}

    for i in CUT:
        batch = DistillCollator(0, TRUNCATION)([rows[i]])
        prompt = batch["prompts"][0].tolist()
        assert prompt == rows[i]["prompt_ids"][-LONGEST:] != rows[i]["prompt_ids"]
        assert_labels_equal(online(batch), {k: [v[i]] for k, v in fresh.items()}, [0])
        completion = torch.tensor([rows[i]["completion_ids"]])  # what TRL's generation returns, laid out causally
        causal = {"layout": CAUSAL, "prompts": batch["prompts"], "input_ids": torch.cat([batch["prompts"], completion], 1),
                  "attention_mask": torch.ones(1, len(prompt) + completion.shape[1], dtype=torch.long),
                  "labels": torch.cat([torch.full((1, len(prompt)), -100), completion], 1)}
        assert_labels_equal(online(causal), {k: [v[i]] for k, v in fresh.items()}, [0])
        whole = DistillCollator(0, WHOLE)([rows[i]])  # the wrong variant: the full prompt
        assert differs(online(whole), {k: [v[i]] for k, v in fresh.items()}, [0])


def test_a_learning_curve_point_takes_its_rows_labels_from_the_labelling_of_every_train_row(target, rows, tmp_path):
    train = collected(target, rows, topk=True, hidden=False)
    every = attach(target, train, tmp_path).to_dict()
    share = [0, 1, 4]
    point = attach(target, train, tmp_path, share=share).to_dict()
    for name in ("topk_ids", "topk_logprobs"):
        assert point[name] == [every[name][i] for i in share]
