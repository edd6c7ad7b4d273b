"""DistillTrainer on TRL's GKDTrainer: TRL's on-policy and seq-KD branches run (with a vocabulary-subset draft the
generated ids stay in the subset), the cached teacher never runs the target per step, and the LK math against
hand-computed values. Tiny random models; CPU; a few steps each."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from omegaconf import OmegaConf

from distill.losses import distillation_loss
from tests.conftest import SHIPPED, WORD_VOCAB as VOCAB, logits, tiny_llama, tiny_tokenizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from trl.experimental.gkd import GKDConfig, GKDTrainer

SUBSET = torch.tensor(sorted({1, 3, *range(6, VOCAB, 3)}))  # the stop tokens and every third word


# ---------------------------------------------------------------- losses against hand-computed values
# p = (.5, .3, .2), q = (.2, .5, .3): α = Σ min(p, q) = .2 + .3 + .2 = .7; KL(p ‖ q) = .2238047 (HAND, test_losses.py);
# TV = .3
def test_lk_alpha_is_minus_log_acceptance():
    loss = distillation_loss("lk_alpha", logits([0.2, 0.5, 0.3]), teacher_logits=logits([0.5, 0.3, 0.2]))
    assert loss.item() == pytest.approx(-math.log(0.7), abs=1e-6)  # 0.3566749


def test_lk_lambda_blends_kl_and_tv_by_the_detached_mean_acceptance():
    # one position: λ = exp(−3 · .7) = .1224564; λ · .2238047 + (1 − λ) · .3 = .0274064 + .2632631
    q = logits([0.2, 0.5, 0.3]).requires_grad_()
    loss = distillation_loss("lk_lambda", q, teacher_logits=logits([0.5, 0.3, 0.2]))
    assert loss.item() == pytest.approx(0.2906695, abs=1e-6)
    # two positions share one λ from their mean α: second position q = p (α = 1, KL = TV = 0), ᾱ = .85,
    # λ = exp(−2.55) = .0780817; first position λ · .2238047 + (1 − λ) · .3 = .0174749 + .2765755
    both = distillation_loss("lk_lambda", torch.cat([q, logits([0.5, 0.3, 0.2])]),
                             teacher_logits=logits([0.5, 0.3, 0.2]).repeat(2, 1))
    assert both[0].item() == pytest.approx(0.2940504, abs=1e-6) and both[1].item() == pytest.approx(0.0, abs=1e-6)
    both.sum().backward()  # λ is detached: the gradient is λ ∇KL + (1 − λ) ∇TV
    assert torch.isfinite(q.grad).all()


def test_dense_jsd_is_trls_generalized_jsd_loss(monkeypatch):
    calls = []
    original = GKDTrainer.generalized_jsd_loss
    monkeypatch.setattr(GKDTrainer, "generalized_jsd_loss",
                        staticmethod(lambda *a, **k: calls.append(k) or original(*a, **k)))
    loss = distillation_loss("jsd", logits([0.2, 0.5, 0.3]), teacher_logits=logits([0.5, 0.3, 0.2]), beta=0.5)
    assert calls and loss.item() == pytest.approx(0.0508746, abs=1e-5)  # HAND[("jsd", 0.5)]


# ---------------------------------------------------------------- the trainer on tiny models
def rows_and_models(n_rows: int = 8):
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=2, seed=1, tie=False)
    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=2, tie=True).train()
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": [2, 4, *torch.randint(6, VOCAB, (int(3 + i % 4),), generator=g).tolist(), 3, 2, 5],
             "completion_ids": torch.randint(6, VOCAB, (int(4 + i % 3),), generator=g).tolist()} for i in range(n_rows)]
    return target, draft, rows


def build(tmp_path, target, draft, rows, vocab=None, **objective):
    from datasets import Dataset

    from distill.aligned import Truncation
    from distill.labels import teacher_labels
    from distill.trainer import DistillConfig, DistillTrainer
    from pipeline.heads import use_subset_head

    settings = {**OmegaConf.to_container(SHIPPED.distill.objective),
                "max_completion_length": 8, **objective}
    truncation = Truncation(settings["max_prompt_length"], settings["max_completion_length"])
    columns = teacher_labels(target, rows, truncation, 8, vocab, 4, 1)
    dataset = Dataset.from_list([{**row, **{k: v[i] for k, v in columns.items()}} for i, row in enumerate(rows)])
    use_subset_head(draft, vocab)
    args = DistillConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                         report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
                         remove_unused_columns=False, **settings)
    return DistillTrainer(draft, args, dataset, teacher_model=target, vocab=vocab, stop_ids=[3],
                          processing_class=tiny_tokenizer())


@pytest.fixture
def spy_generation(monkeypatch):
    """Records (model, generated ids, attention mask, prompt width) of every TRL generation."""
    calls = []
    original = GKDTrainer.generate_on_policy_outputs

    def spy(model, inputs, generation_config):
        ids, attention, labels = original(model, inputs, generation_config)
        calls.append((model, ids, attention, inputs["prompts"].shape[1]))
        return ids, attention, labels

    monkeypatch.setattr(GKDTrainer, "generate_on_policy_outputs", staticmethod(spy))
    return calls


def test_config_and_trainer_are_trls(tmp_path):
    from distill.trainer import DistillConfig, DistillTrainer

    target, draft, rows = rows_and_models()
    trainer = build(tmp_path, target, draft, rows)
    assert isinstance(trainer, GKDTrainer) and isinstance(trainer.args, GKDConfig)
    assert issubclass(DistillTrainer, GKDTrainer) and issubclass(DistillConfig, GKDConfig)
    assert trainer.args.max_new_tokens == 8 and not trainer.args.gradient_checkpointing
    assert "forward" not in vars(draft) and "forward" not in vars(target)  # TRL's fused-head patch is undone
    with pytest.raises(ValueError, match="lmbda"):
        DistillConfig(output_dir=str(tmp_path), loss="fkl", use_cpu=True)  # objective keys come from conf


def test_on_policy_batches_run_trls_training_step_and_sample_inside_the_vocab_subset(tmp_path, spy_generation):
    target, draft, rows = rows_and_models()
    trainer = build(tmp_path, target, draft, rows, vocab=SUBSET, lmbda=1.0, teacher="online", loss="fkl")
    before = draft.model.layers[0].mlp.up_proj.weight.detach().clone()
    trainer.train()
    assert trainer.on_policy_batches == 2 and len(spy_generation) == 2
    for model, ids, attention, p_len in spy_generation:
        assert model is draft
        generated = ids[:, p_len:][attention[:, p_len:].bool()]
        assert generated.numel() and torch.isin(generated, SUBSET).all(), generated
    assert not torch.equal(before, draft.model.layers[0].mlp.up_proj.weight)  # it trained
    assert draft(torch.tensor([[2, 4, 7]])).logits.shape[-1] == len(SUBSET)  # the subset head is back


def test_seq_kd_batches_are_generated_by_the_target(tmp_path, spy_generation):
    target, draft, rows = rows_and_models()
    trainer = build(tmp_path, target, draft, rows, lmbda=0.0, seq_kd=True, teacher="topk", loss="jsd")
    trainer.train()
    assert trainer.on_policy_batches == 0 and len(spy_generation) == 2
    assert all(model is target for model, *_ in spy_generation)
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


@pytest.mark.parametrize("teacher", ["topk", "online"])
def test_target_runs_only_when_the_loss_needs_it(tmp_path, teacher):
    target, draft, rows = rows_and_models()
    trainer = build(tmp_path, target, draft, rows, teacher=teacher, loss="lk_lambda")
    forwards = []
    target.model.register_forward_hook(lambda *_: forwards.append(1))
    trainer.train()
    assert len(forwards) == (2 if teacher == "online" else 0)
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_teacher_labels_in_length_sorted_batches_come_back_in_row_order():
    from distill.aligned import Truncation
    from distill.labels import teacher_labels

    target, _, rows = rows_and_models(n_rows=11)  # lengths vary, so the sorted order differs from the row order
    vocab = torch.arange(0, VOCAB, 2)
    truncation = Truncation(384, 8)
    batched = teacher_labels(target, rows, truncation, 4, vocab, 4, 1)
    for i, row in enumerate(rows):
        alone = teacher_labels(target, [row], truncation, 4, vocab, 1, 1)
        assert batched["topk_ids"][i] == alone["topk_ids"][0]
        assert batched["subset_logmass"][i] == pytest.approx(alone["subset_logmass"][0], abs=1e-4)


# ---------------------------------------------------------------- the hidden-state recovery loss
def with_states(model, rows, shift: int = 0):
    """`rows` with `final_hidden`: `model`'s final hidden states at each completion position (`shift` > 0: the states
    of the position `shift` later, the last repeated: a deliberately misaligned target)."""
    from distill.aligned import completion_hidden, layout

    out = []
    for row in rows:
        with torch.no_grad():
            states = completion_hidden(model, layout([row["prompt_ids"]], [row["completion_ids"]], 1))[0]
        if shift:
            states = torch.cat([states[shift:], states[-1:].repeat(shift, 1)])
        out.append({**row, "final_hidden": states.numpy().astype("float16").tolist()})
    return out


def batch_loss(trainer) -> float:
    """The loss over all of the trainer's rows in one batch."""
    batch = trainer.data_collator(list(trainer.train_dataset))
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, batch))


def test_recovery_loss_vanishes_on_the_drafts_own_states_and_not_on_misaligned_ones(tmp_path):
    target, draft, rows = rows_and_models()
    logits_only = batch_loss(build(tmp_path / "a", target, draft, with_states(draft, rows)))
    own = batch_loss(build(tmp_path / "b", target, draft, with_states(draft, rows), hidden_weight=1.0))
    shifted = batch_loss(build(tmp_path / "c", target, draft, with_states(draft, rows, shift=1), hidden_weight=1.0))
    assert own == pytest.approx(logits_only, abs=1e-3)  # fp16 rounding of the stored states
    assert shifted > logits_only + 0.05  # the wrong variant: states one position off


def test_recovery_training_brings_the_drafts_states_toward_the_targets(tmp_path):
    from distill.trainer import positions, recovery_loss
    from pipeline.heads import head_inputs

    errors = {}
    for weight in (0.0, 1.0):
        target, draft, rows = rows_and_models()
        labelled = with_states(target, rows)
        trainer = build(tmp_path / str(weight), target, draft, labelled, vocab=SUBSET, hidden_weight=weight)
        trainer.args.max_steps, trainer.args.learning_rate = 30, 1e-2
        trainer.train()
        batch = trainer.data_collator(list(trainer.train_dataset))
        where = positions(batch)
        with torch.no_grad(), head_inputs(draft, []) as states:
            draft(**where.forward, logits_to_keep=where.keep)
        errors[weight] = float(recovery_loss(where.at(states[0]), batch, where.mask))
    assert errors[1.0] < 0.5 * errors[0.0], errors


def test_rows_whose_prompt_the_truncation_cuts_carry_no_hidden_target(tmp_path):
    target, draft, rows = rows_and_models()
    trainer = build(tmp_path, target, draft, with_states(target, rows), hidden_weight=1.0)
    trainer.data_collator.truncation = type(trainer.data_collator.truncation)(9, 8)
    batch = trainer.data_collator(list(trainer.train_dataset))
    kept = [len(r["prompt_ids"]) <= 9 for r in rows]
    assert 0 < sum(kept) < len(rows)
    assert batch["hidden_mask"].any(1).tolist() == kept
    assert torch.equal(batch["hidden_mask"], batch["hidden_mask"] & (batch["labels"] != -100))
