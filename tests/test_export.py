"""The exported draft keeps its distillation outside our decoder: engines (HF assisted generation, vLLM,
llama.cpp) run the checkpoint's full head, so the FR-Spec subset the draft was trained through is written
into the weights, and the full head agrees with the target as often as the subset head does."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import read_spec, run_distill_stage, tiny_llama


def test_a_baked_subset_head_scores_the_subset_as_trained_and_nothing_else(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.heads import bake_subset, head_rows

    model = tiny_llama(vocab_size=40, layers=1, tie=True)
    vocab = torch.tensor([1, 3, 5, 8, 13, 21, 34])
    ids = torch.tensor([[2, 7, 11, 39, 0]])  # out-of-subset input ids must keep their embeddings
    with torch.no_grad():
        subset_logits = torch.nn.functional.linear(model.model(ids).last_hidden_state, head_rows(model, vocab)[0])
        embeddings = model.get_input_embeddings().weight.clone()
    bake_subset(model, vocab)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not reloaded.config.tie_word_embeddings
    assert torch.equal(reloaded.get_input_embeddings().weight, embeddings)
    with torch.no_grad():
        logits = reloaded(ids).logits
    torch.testing.assert_close(logits[..., vocab], subset_logits)
    outside = torch.ones(40, dtype=torch.bool)
    outside[vocab] = False
    assert torch.count_nonzero(logits[..., outside]) == 0


def teacher_forced_agreement(target, draft, rows, vocab=None) -> tuple[int, int]:
    """(positions where the draft's argmax equals the target's, positions) over the completions of `rows`;
    `vocab` restricts the draft's argmax to those ids (our decoder's FR-Spec head)."""
    agree = total = 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            start = len(row["prompt_ids"]) - 1
            end = ids.shape[1] - 1
            p = target(ids).logits[0, start:end].argmax(-1)
            logits = draft(ids).logits[0, start:end]
            q = logits.argmax(-1) if vocab is None else vocab[logits[:, vocab].argmax(-1)]
            agree += int((p == q).sum())
            total += len(p)
    return agree, total


def exported_agreements(setup, out):
    """Greedy agreement of the export's full head and of its FR-Spec subset head on the held-out rows."""
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    from pipeline.control.split import split_by_prompt

    spec = read_spec(out / "draft")
    vocab = torch.tensor(spec["vocab_subset"])
    data = load_from_disk(str(setup["collect"] / "dataset"))
    _, held = split_by_prompt(data["prompt_id"], data["domain"], 0.25, None, 0)
    rows = [data[i] for i in held]
    target = AutoModelForCausalLM.from_pretrained(setup["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft").eval()
    full, n = teacher_forced_agreement(target, draft, rows)
    subset, _ = teacher_forced_agreement(target, draft, rows, vocab)
    return full / n, subset / n, n, spec


@pytest.fixture(scope="module")
def subset_export(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("subset_export")
    run_distill_stage(setup, out, "model.draft.vocab_subset=48", "distill.trainer.max_steps=60", "distill.trainer.learning_rate=1e-2")
    return out


def test_the_exported_full_head_agrees_with_the_target_as_the_subset_head_does(setup, subset_export):
    full, subset, n, spec = exported_agreements(setup, subset_export)
    noise = 3 * math.sqrt(subset * (1 - subset) / n)  # three binomial standard errors
    assert subset > 0.2, "the draft learned nothing: the check below would be vacuous"
    assert full >= subset - noise, (full, subset, n)
    # the stage measured the same property on its reporting part, at the calibrated draft temperature
    assert spec["acceptance"]["full_head"]["overall"] == pytest.approx(spec["acceptance"]["after_calibrated"]["overall"],
                                                                       abs=0.02)


def test_the_check_rejects_an_export_that_keeps_the_untrained_rows(setup, tmp_path, monkeypatch):
    """The bug this guards against: the distilled weights saved as they are, so rows outside the FR-Spec subset
    (never trained) win the full head's argmax."""
    import distill.export
    monkeypatch.setattr(distill.export, "bake_subset", lambda model, vocab, fill=None: model)
    run_distill_stage(setup, tmp_path, "model.draft.vocab_subset=48", "distill.trainer.max_steps=60", "distill.trainer.learning_rate=1e-2")
    full, subset, n, _ = exported_agreements(setup, tmp_path)
    assert full < subset - 3 * math.sqrt(subset * (1 - subset) / n), (full, subset, n)
