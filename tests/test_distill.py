"""Distill stage: losses against hand-computed values, top-k vs online teacher, a short distillation that
raises held-out acceptance, temperature calibration, export round-trip (HF assisted generation), resume,
two processes under accelerate, and bad input refused with one line. Tiny random models; CPU; fixed seeds."""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch

from distill.losses import distillation_loss, sparse_teacher
from pipeline.errors import PipelineError
from tests.conftest import REPO, tiny_llama

VOCAB = 96
SPECIALS = ["<unk>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
DOMAINS = ("chat", "code")


# ---------------------------------------------------------------- fixtures
def tiny_tokenizer():
    """A word-level tokenizer over a fixed vocabulary, built offline, with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def peaked_target(seed: int = 0):
    """A tiny random Llama whose next-token distributions are peaked (a scaled head), like a real LM's."""
    model = tiny_llama(vocab_size=VOCAB, hidden_size=64, layers=4, seed=seed, tie=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


def collect(target, path: Path, n_prompts: int = 24, new_tokens: int = 24, temperature: float = 1.0,
            topk: int = 16, seed: int = 0) -> Path:
    """A collect-stage output (dataset + manifest) sampled from `target`, with top-k labels at T=1."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_prompts):
        domain = DOMAINS[i % len(DOMAINS)]
        prompt = [2, 4] + torch.randint(6, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() + [3, 2, 5]
        ids = torch.tensor([prompt])
        completion, ids_k, lps_k = [], [], []
        with torch.no_grad():
            for _ in range(new_tokens):
                logp = target(ids).logits[0, -1].float().log_softmax(-1)
                top = logp.topk(topk)
                probs = (logp / temperature).softmax(-1)
                tok = int(torch.multinomial(probs, 1, generator=g))
                completion.append(tok)
                ids_k.append(top.indices.tolist())
                lps_k.append(top.values.tolist())
                ids = torch.cat([ids, torch.tensor([[tok]])], 1)
        rows.append({"id": f"{domain}-{i}/t0/s0", "prompt_id": f"{domain}-{i}", "domain": domain, "turn": 0,
                     "sample": 0, "prompt_ids": prompt, "completion_ids": completion, "text": "",
                     "finish_reason": "length", "topk_ids": ids_k, "topk_logprobs": lps_k})
    path.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows).save_to_disk(str(path / "dataset"))
    (path / "manifest.json").write_text(json.dumps({"sampling": {"temperature": temperature, "top_p": 1.0,
                                                                 "top_k": 0}}))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill")
    target = peaked_target()
    tok = tiny_tokenizer()
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return {"root": root, "target": root / "target", "collect": collect(target, root / "collect")}


class Tracker:
    """Records what the stage logs (stands in for MLflow)."""

    def __init__(self):
        self.metrics, self.steps = {}, []

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)
        self.steps.append((step, dict(metrics)))

    def log_params(self, params): ...
    def log_artifact(self, path, artifact_path=None): ...
    def log_artifacts(self, path, artifact_path=None): ...
    def set_tags(self, tags): ...


def overrides(setup, out: Path, *extra: str) -> list[str]:
    return [f"paths.artifacts={out}", f"model.target.path={setup['target']}", f"paths.collect={setup['collect']}",
            "tracking.enabled=false", "runtime.device=cpu", "runtime.dtype=float32", "model.draft.derive.layers=[0]",
            "model.draft.vocab_subset=0", "distill.trainer.max_steps=40", "distill.trainer.max_epochs=null", "distill.trainer.per_device_train_batch_size=4",
            "distill.heldout.eval_steps=20", "distill.checkpoint.save_steps=20", "distill.trainer.learning_rate=3e-3", "distill.split.heldout_fraction=0.25",
            "distill.calibration.cost.repeats=2", "distill.calibration.cost.contexts=[16]", "distill.checkpoint.max_train_minutes=null", "seed=0", *extra]


def compose(setup, out: Path, *extra: str):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=overrides(setup, out, *extra))


def run_stage(setup, out: Path, *extra: str):
    from distill.stage import run

    tracker = Tracker()
    return run(compose(setup, out, *extra), tracker), tracker


# ---------------------------------------------------------------- losses
# p = target, q = draft over three tokens; each expected value is worked out by hand in its comment.
P, Q = [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]
HAND = {
    # ½(|.5−.2| + |.3−.5| + |.2−.3|) = ½(.3 + .2 + .1)
    ("tvd", None): 0.3,
    # .5 ln(.5/.2) + .3 ln(.3/.5) + .2 ln(.2/.3) = .45815 − .15325 − .08109
    ("fkl", None): 0.2238047,
    # .2 ln(.2/.5) + .5 ln(.5/.3) + .3 ln(.3/.2) = −.18326 + .25541 + .12164
    ("rkl", None): 0.1937942,
    # m = βp + (1−β)q; β KL(p‖m) + (1−β) KL(q‖m). β=.5: m = (.35, .4, .25)
    ("jsd", 0.1): 0.0196612,
    ("jsd", 0.5): 0.0508746,
    ("jsd", 0.9): 0.0175626,
}


def logits(probs):
    return torch.tensor([probs]).log()


@pytest.mark.parametrize("name,beta", list(HAND), ids=[f"{n}{'' if b is None else b}" for n, b in HAND])
def test_loss_matches_hand_computed_value(name, beta):
    loss = distillation_loss(name, logits(Q), teacher_logits=logits(P), beta=beta or 0.5)
    assert loss.shape == (1,)
    assert loss.item() == pytest.approx(HAND[(name, beta)], abs=1e-5)


def test_cross_entropy_is_negative_log_prob_of_the_target_token():
    loss = distillation_loss("ce", logits(Q), labels=torch.tensor([1]))
    assert loss.item() == pytest.approx(-math.log(0.5), abs=1e-6)  # q(token 1) = .5
    assert distillation_loss("ce", logits(Q), labels=torch.tensor([-100])).item() == 0.0  # ignored position


def test_loss_temperature_softens_both_distributions():
    # T=2: p ∝ √p = (.7071, .5477, .4472)/1.7020 = (.41545, .32180, .26275); q likewise = (.26275, .41545, .32180)
    # TVD = ½(.15270 + .09365 + .05905)
    loss = distillation_loss("tvd", logits(Q), teacher_logits=logits(P), temperature=2.0)
    assert loss.item() == pytest.approx(0.1526948, abs=1e-5)


def test_topk_bucket_is_exact_on_the_listed_tokens_plus_other():
    # p = (.5, .3, .15, .05), top-2 listed, "other" = .2; q uniform: (.25, .25) + other .5
    # TVD = ½(.25 + .05 + .3) = .3; FKL = .5 ln 2 + .3 ln 1.2 + .2 ln .4
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    teacher = sparse_teacher(torch.tensor([[0, 1]]), p[:, :2].log(), vocab_size=4)
    q = torch.zeros(1, 4)
    assert distillation_loss("tvd", q, teacher=teacher).item() == pytest.approx(0.3, abs=1e-6)
    fkl = 0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
    assert distillation_loss("fkl", q, teacher=teacher).item() == pytest.approx(fkl, abs=1e-6)
    # renormalize: p = (.625, .375) on the listed tokens, 0 elsewhere; TVD = ½(.375 + .125 + .5)
    assert distillation_loss("tvd", q, teacher=teacher, tail="renormalize").item() == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_cached_topk_teacher_is_close_to_online_teacher(name):
    """At loss temperature 1 with the top-32 holding ~97% of the mass. (Reverse KL is the most tail-sensitive:
    a draft's mass on tokens the target finds unlikely is weighted by log q/p. At T != 1 the cached tail is an
    even-spread estimate; distill/losses.py says so.)"""
    torch.manual_seed(0)
    vocab, k = 512, 32
    teacher_logits = torch.randn(64, vocab) * 4  # peaked, like an LM
    draft_logits = teacher_logits * 0.9 + torch.randn(64, vocab) * 0.5
    logp = teacher_logits.log_softmax(-1)
    top = logp.topk(k)
    assert top.values.exp().sum(-1).mean() > 0.95
    online = distillation_loss(name, draft_logits, teacher_logits=teacher_logits).mean()
    # float16 log-probs, as the collect stage stores them
    cached = distillation_loss(name, draft_logits, teacher=sparse_teacher(top.indices, top.values.half().float(), vocab)).mean()
    assert cached.item() == pytest.approx(online.item(), rel=0.08)


def test_losses_have_finite_gradients_with_a_vocab_subset():
    from pipeline.heads import column_map

    torch.manual_seed(0)
    subset = torch.arange(0, 64, 2)
    column_of = column_map(subset, 64)
    teacher_logits = torch.randn(8, 64) * 3
    top = teacher_logits.log_softmax(-1).topk(8)
    mass = teacher_logits.log_softmax(-1)[:, subset].logsumexp(-1)
    for name in ("fkl", "rkl", "jsd", "tvd"):
        draft = torch.randn(8, len(subset), requires_grad=True)
        loss = distillation_loss(name, draft, teacher=sparse_teacher(top.indices, top.values, 64, column_of, mass)).sum()
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(draft.grad).all(), name


def test_reverse_kl_stays_finite_when_the_cached_top_k_mass_rounds_to_one():
    # top-1 log-prob −1e-9 (fp16 stores it as −0.0) plus 31 small listed tokens: the listed mass sums past 1, so the
    # "other" class has no teacher mass left. The draft puts ≈ 0.006 there. FKL/TVD/JSD charge ≈ that much; reverse KL
    # must too (a floor, not log 0: with log p = −1e4 it was ≈ 60).
    k, vocab = 32, 4096
    logprobs = torch.cat([torch.tensor([[-1e-9]]), torch.full((1, k - 1), -12.0)], 1).half().float()
    assert logprobs.exp().sum() >= 1.0
    teacher = sparse_teacher(torch.arange(k)[None], logprobs, vocab)
    draft_logits = torch.full((1, vocab), -30.0)
    draft_logits[0, 0] = 0.0
    draft_logits[0, k:] = math.log(0.006 / (vocab - k))  # q(other) ≈ 0.006, q(top-1) ≈ 0.994
    losses = {name: distillation_loss(name, draft_logits, teacher=teacher).item() for name in ("fkl", "tvd", "jsd", "rkl")}
    assert losses["tvd"] == pytest.approx(0.006, abs=1e-3)
    assert 0 < losses["rkl"] < 0.1, losses


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_cached_and_online_teachers_agree_for_a_vocab_subset_draft(name):
    """A frequency-ranked subset holds most of the target's tail. With the draft's conditional distribution on the
    unlisted subset tokens equal to the target's (so bucketing the tail loses nothing), the cached top-k teacher
    with the subset's mass must give the online (subset-renormalised) teacher's loss. An even-spread tail over
    all V − k tokens gives the subset's "other" class ≈ K/V of the tail and fails this."""
    from pipeline.heads import column_map

    torch.manual_seed(0)
    vocab, k, rows = 512, 16, 32
    teacher_logits = torch.randn(rows, vocab) * 2
    subset = torch.cat([teacher_logits.mean(0).topk(96).indices, torch.tensor([0])]).unique()  # the frequent tokens
    logp = teacher_logits.log_softmax(-1)
    top = logp.topk(k)
    draft_logits = teacher_logits.clone()
    draft_logits.scatter_add_(-1, top.indices, torch.randn(rows, k))  # differs only on the listed tokens
    online = distillation_loss(name, draft_logits[:, subset], teacher_logits=teacher_logits[:, subset])
    teacher = sparse_teacher(top.indices, top.values, vocab, column_map(subset, vocab), logp[:, subset].logsumexp(-1))
    cached = distillation_loss(name, draft_logits[:, subset], teacher=teacher)
    assert torch.allclose(cached, online, atol=1e-4), (cached - online).abs().max()


def test_unknown_loss_or_bad_beta_is_refused():
    from distill.losses import check_loss

    with pytest.raises(PipelineError, match="unknown distillation loss"):
        check_loss("kl")
    with pytest.raises(PipelineError, match="outside"):
        check_loss("jsd", beta=1.0)
    with pytest.raises(PipelineError, match="infinite"):
        check_loss("rkl", tail="renormalize", teacher="topk")


# ---------------------------------------------------------------- draft construction
def test_vocab_subset_keeps_stop_tokens_and_the_most_frequent_tokens():
    from distill.draft import vocab_subset

    completions = [[10, 10, 10, 11, 11, 12], [10, 13, 11]]
    subset = vocab_subset(completions, 4, vocab_size=50, always=[1])
    assert subset.tolist() == [1, 10, 11, 12]  # the stop token 1 even though it never occurs
    with_prompts = vocab_subset([[10, 10, 11]], 4, vocab_size=50, always=[1], prompts=[[30, 30, 31, 10]])
    assert with_prompts.tolist() == [1, 10, 11, 30]  # then the prompts' most frequent tokens
    filled = vocab_subset([[40]], 3, vocab_size=50, always=[1])
    assert filled.tolist() == [0, 1, 40]  # too few distinct tokens: the lowest (most common BPE) ids fill in


def test_subset_head_is_full_vocab_on_save(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.heads import restore_full_head, use_subset_head

    model = tiny_llama(vocab_size=VOCAB, layers=1, tie=True)
    head = use_subset_head(model, torch.arange(10))
    assert model(torch.tensor([[3, 4]])).logits.shape[-1] == 10
    model.save_pretrained(tmp_path)
    restore_full_head(model, head)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded(torch.tensor([[3, 4]])).logits.shape[-1] == VOCAB
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_narrower_derived_draft_runs():
    from distill.draft import narrow_hidden
    from pipeline.models import derive_draft

    target = tiny_llama(vocab_size=VOCAB, hidden_size=64, layers=2, tie=True)
    draft = narrow_hidden(derive_draft(target, [0]), 32)
    assert draft.config.hidden_size == 32 and draft.lm_head.weight.shape == (VOCAB, 32)
    assert torch.isfinite(draft(torch.tensor([[3, 4, 5]])).logits).all()


# ---------------------------------------------------------------- calibration
@pytest.mark.parametrize("scale", [1.5, 1 / 1.5])
def test_calibration_recovers_a_known_temperature(scale):
    """Draft logits = target logits × s, so q_τ = p_T exactly at τ = s·T: calibration must find it
    (s = 1/1.5 is "draft = target logits / 1.5", whose best τ is T/1.5)."""
    import copy

    from distill.batch import Truncation
    from distill.calibrate import build_heldout, calibrate_temperature
    from pipeline.sampling import Sampling

    target = peaked_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(1 / 20)  # moderate peaks, so temperature matters everywhere
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.mul_(scale)
    g = torch.Generator().manual_seed(1)
    rows = [{"prompt_ids": torch.randint(6, VOCAB, (5,), generator=g).tolist(),
             "completion_ids": torch.randint(6, VOCAB, (12,), generator=g).tolist()} for _ in range(6)]
    T = 0.8
    heldout = build_heldout(target, rows, ["a", "b"] * 3, Sampling(T), Truncation(512, 256), support=VOCAB,
                            pad_token_id=1)
    result = calibrate_temperature(draft, heldout, [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0], refine=7)
    for domain in ("a", "b", "overall"):
        assert result["temperature"][domain] == pytest.approx(scale * T, rel=0.04)
        assert result["acceptance"][domain] == pytest.approx(1.0, abs=0.01)
    assert result["acceptance_at_serving"]["overall"] < 0.97


def test_best_gamma_follows_the_walltime_formula():
    from distill.calibrate import best_gamma

    alpha = 0.8
    gamma, speedups = best_gamma([alpha ** k for k in range(1, 9)], c=0.05, gammas=range(1, 9))
    formula = {g: (1 - alpha ** (g + 1)) / ((1 - alpha) * (g * 0.05 + 1)) for g in range(1, 9)}
    assert gamma == max(formula, key=formula.get)
    assert speedups[4] == pytest.approx(formula[4])
    assert best_gamma([0.1 ** k for k in range(1, 9)], c=0.3, gammas=range(1, 9))[0] == 1


def test_best_gamma_costs_the_verify_pass_as_measured():
    from distill.calibrate import best_gamma

    # with verification costing r_γ, the speedup is (1 + Σ P_k) / (γc + r_γ)
    gamma, speedups = best_gamma([0.5, 0.25], c=0.1, gammas=[1, 2], verify_ratio={1: 1.5, 2: 1.6})
    assert speedups[1] == pytest.approx(1.5 / 1.6) and speedups[2] == pytest.approx(1.75 / 1.8) and gamma == 2


def test_a_cost_profile_of_another_device_is_used_for_calibration(setup, distilled, tmp_path):
    """distill.calibration.cost.profile: γ and the policy are chosen for that profile's costs, which travel with
    the export; a profile for other model shapes is refused with one line."""
    from pipeline.cost_profile import read_profile, write_profile

    measured = read_profile(distilled[2] / "draft" / "cost_profile.json")
    assert measured["machine"]["device"] == "cpu"
    slow_draft = json.loads(json.dumps(measured))
    slow_draft["draft"]["ms"] = measured["target"][str(min(map(int, measured["target"])))]["1"]["ms"] * 0.9
    write_profile(tmp_path / "slow_draft.json", slow_draft)
    run_stage(setup, tmp_path / "out", f"distill.calibration.cost.profile={tmp_path / 'slow_draft.json'}")
    spec = json.loads((tmp_path / "out" / "draft" / "speculative.json").read_text())
    assert spec["cost"]["c"] == pytest.approx(0.9, rel=0.01)
    fast = json.loads((distilled[2] / "draft" / "speculative.json").read_text())["predicted_speedup"]
    assert all(spec["predicted_speedup"][d] < fast[d] for d in fast), (spec["predicted_speedup"], fast)
    assert json.loads((tmp_path / "out" / "draft" / "cost_profile.json").read_text()) == slow_draft
    other = json.loads(json.dumps(measured))
    other["shapes"]["target"]["hidden_size"] += 1
    write_profile(tmp_path / "other.json", other)
    with pytest.raises(PipelineError, match="hidden_size"):
        run_stage(setup, tmp_path / "out2", f"distill.calibration.cost.profile={tmp_path / 'other.json'}")


# ---------------------------------------------------------------- the stage
@pytest.fixture(scope="module")
def distilled(setup):
    """One short distillation of a one-layer draft (shared frozen embeddings/head) on the tiny target."""
    result, tracker = run_stage(setup, setup["root"] / "run")
    return result, tracker, setup["root"] / "run"


def test_short_distillation_raises_heldout_acceptance(distilled):
    result, tracker, _ = distilled
    assert result["acceptance_after"] - result["acceptance_before"] > 0.15, result
    steps = [s for s, m in tracker.steps if "heldout/acceptance/overall" in m]
    assert steps == [20, 40]  # the acceptance simulator ran at every eval step
    assert "heldout/mean_accepted_length_g4/chat" in tracker.metrics


def test_bf16_autocast_training_learns_and_exports_in_the_serving_dtype(setup, tmp_path):
    # the path a CPU with native bf16 (or a GPU) takes by default: bf16 target, autocast over fp32 master weights
    result, _ = run_stage(setup, tmp_path, "runtime.dtype=bfloat16", "distill.trainer.bf16=auto", "distill.trainer.max_steps=20")
    assert result["acceptance_after"] - result["acceptance_before"] > 0.1, result
    spec = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["dtype"] == "bfloat16"
    assert 0 < spec["cost"]["c"] < 5


def test_a_learning_curve_point_trains_on_a_nested_share_and_reports_the_same_heldout(setup, distilled, tmp_path):
    full = json.loads((distilled[2] / "draft" / "speculative.json").read_text())
    run_stage(setup, tmp_path, "distill.split.train_fraction=0.5", "distill.trainer.max_steps=4",
              "distill.heldout.eval_steps=4", "distill.checkpoint.save_steps=4")
    half = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert half["training"]["train_fraction"] == 0.5 and full["training"]["train_fraction"] == 1.0
    assert 0 < half["training"]["rows"] < full["training"]["rows"]
    assert 0 < half["training"]["data_tokens"] < full["training"]["data_tokens"]
    assert half["heldout"] == full["heldout"]  # the same held-out prompts judge every point
    assert half["training"]["fingerprint"] != full["training"]["fingerprint"]
    with pytest.raises(PipelineError, match="train_fraction"):
        run_stage(setup, tmp_path / "bad", "distill.split.train_fraction=0")


def test_learning_curve_points_share_one_head_and_one_labelling_of_every_train_row(setup, tmp_path, monkeypatch):
    from distill import labels

    labelled = []
    original = labels.cached_teacher_labels
    monkeypatch.setattr(labels, "cached_teacher_labels",
                        lambda job, train, k, log: labelled.append(len(train)) or original(job, train, k, log))
    specs = {}
    for share in (0.5, 1.0):
        run_stage(setup, tmp_path / str(share), "model.draft.vocab_subset=40", f"distill.split.train_fraction={share}",
                  "distill.trainer.max_steps=2", "distill.heldout.eval_steps=2", "distill.checkpoint.save_steps=2")
        specs[share] = json.loads((tmp_path / str(share) / "draft" / "speculative.json").read_text())
    assert specs[0.5]["training"]["rows"] < specs[1.0]["training"]["rows"]
    assert labelled == [specs[1.0]["training"]["rows"]] * 2  # the half point labelled every row, not its half
    assert specs[0.5]["vocab_subset"] == specs[1.0]["vocab_subset"]  # the same FR-Spec head for every point


def test_teacher_labels_are_computed_once_per_rows_and_subset(setup, tmp_path, monkeypatch):
    from datasets import Dataset
    from omegaconf import OmegaConf

    from distill import labels
    from distill.batch import Truncation
    from pipeline.models import load_model

    target = load_model(setup["target"], torch.device("cpu"), torch.float32)
    train = Dataset.from_dict({"prompt_ids": [[3, 4, 5], [6, 7]], "completion_ids": [[8, 9, 10, 11], [12, 13]]})
    job = types.SimpleNamespace(target=target, target_ident={"path": "tiny"}, truncation=Truncation(8, 8),
                                vocab=torch.tensor([1, 8, 9, 10, 12]), is_main=True,
                                settings=OmegaConf.create({"heldout": {"batch_size": 2}}),
                                tokenizer=types.SimpleNamespace(pad_token_id=0),
                                cfg=OmegaConf.create({"paths": {"cache": str(tmp_path)}}))
    first = labels.cached_teacher_labels(job, train, 4, print)
    monkeypatch.setattr(labels, "teacher_labels", lambda *a, **k: pytest.fail("the target pass ran again"))
    assert labels.cached_teacher_labels(job, train, 4, print) == first  # same rows, same subset: from disk
    assert [len(x) for x in first["subset_logmass"]] == [4, 2]
    job.vocab = torch.tensor([1, 8, 9])
    with pytest.raises(pytest.fail.Exception, match="ran again"):  # another subset: other labels
        labels.cached_teacher_labels(job, train, 4, print)


def test_heldout_prompts_split_into_disjoint_calibration_and_reporting_parts():
    """keep_best, τ, γ and the draft-length policy are chosen on the calibration part; every reported number
    comes from the reporting part, so no number is measured on the rows that chose it."""
    from distill.split import split_heldout

    prompt_ids = [f"{d}-{i}" for d in ("chat", "code") for i in range(6) for _turn in range(2)]
    domains = [p.split("-")[0] for p in prompt_ids]
    calibration, reporting, disjoint = split_heldout(prompt_ids, domains, 0.5, seed=0)
    chosen, reported = {prompt_ids[i] for i in calibration}, {prompt_ids[i] for i in reporting}
    assert disjoint and not chosen & reported and chosen | reported == set(prompt_ids)
    assert {p.split("-")[0] for p in chosen} == {p.split("-")[0] for p in reported} == {"chat", "code"}
    assert len(calibration) + len(reporting) == len(prompt_ids)  # every turn of a prompt stays with it
    # a domain with a single held-out prompt: it serves both, and the split says it is not disjoint
    _, _, disjoint = split_heldout(["a-0", "b-0", "b-1"], ["a", "b", "b"], 0.5, seed=0)
    assert not disjoint


def test_the_export_reports_on_the_reporting_part(distilled):
    _, _, out = distilled
    spec = json.loads((out / "draft" / "speculative.json").read_text())
    parts = spec["heldout"]
    assert parts["disjoint"] and parts["calibration"]["rows"] > 0 and parts["reporting"]["rows"] > 0
    assert "reporting part" in (out / "draft" / "README.md").read_text()


def test_distill_leaves_the_collected_data_untouched(distilled, setup):
    # datasets' cache files written next to the input would make DVC rerun collect on every repro
    assert not list((setup["collect"] / "dataset").glob("cache-*.arrow"))


def test_export_has_weights_tokenizer_calibration_and_model_card(distilled):
    _, _, out = distilled
    spec = json.loads((out / "draft" / "speculative.json").read_text())
    for key in ("version", "target", "sampling", "draft_temperature", "gamma", "vocab_subset", "acceptance", "cost"):
        assert key in spec
    assert set(spec["draft_temperature"]) == set(spec["gamma"]) == {"chat", "code", "default"}
    assert spec["acceptance"]["after"]["overall"] > spec["acceptance"]["before"]["overall"]
    assert 0 < spec["cost"]["c"] < 5
    card = (out / "draft" / "README.md").read_text()
    assert f"{spec['acceptance']['after']['chat']:.3f}" in card  # the card shows this run's numbers
    assert (out / "draft_init" / "config.json").exists() and (out / "draft" / "tokenizer.json").exists()


def test_the_undistilled_draft_ships_with_its_own_calibration(distilled):
    # a fair "before": the initial weights get τ, γ, policy and tree from the same calibration part and cost profile
    from pipeline.spec import SpeculativeSpec

    _, _, out = distilled
    init, tuned = SpeculativeSpec.read(out / "draft_init"), SpeculativeSpec.read(out / "draft")
    assert not init.distilled and init.selected == "init" and tuned.distilled
    assert set(init.gamma) == set(init.draft_length) == {"chat", "code", "default"}
    assert init.cost == tuned.cost  # one cost profile: the draft's shape sets it, not its weights
    assert init.acceptance["after"] == init.acceptance["before"] == tuned.acceptance["before"]
    assert init.predicted_speedup != tuned.predicted_speedup  # calibrated on the initial weights, not copied
    assert (out / "draft_init" / "cost_profile.json").exists()


def test_export_carries_the_draft_length_policy_for_our_decoder_and_for_hf(distilled):
    from transformers import GenerationConfig

    from pipeline.decoding.draft_length import DraftLength
    from pipeline.spec import SpeculativeSpec

    _, _, out = distilled
    spec = SpeculativeSpec.read(out / "draft")
    assert set(spec.draft_length) == {"chat", "code", "default"}
    default = spec.draft_length_for("default")
    assert isinstance(default, DraftLength) and default.max >= 1
    assert all(v > 0 for v in spec.predicted_speedup.values())
    config = GenerationConfig.from_pretrained(out / "draft")
    assert config.num_assistant_tokens == default.max
    expected_threshold = default.threshold if default.policy == "confidence" else 0.0
    assert config.assistant_confidence_threshold == pytest.approx(expected_threshold)
    assert config.num_assistant_tokens_schedule == ("heuristic" if default.policy == "heuristic" else "constant")


def test_policy_simulator_matches_the_walltime_formula_and_prefers_stopping_when_unsure():
    from distill.calibrate import HeldOut
    from distill.policy import choose, simulate
    from pipeline.decoding.draft_length import DraftLength
    from pipeline.sampling import Sampling

    n = 400
    heldout = HeldOut([{}], ["d"] * 1, torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), torch.zeros(n),
                      torch.zeros(n, dtype=torch.long), Sampling(), 1, 0)
    everywhere = torch.ones(n, dtype=torch.bool)
    alpha = torch.full((n,), 0.8)
    drafted, accepted = simulate(alpha, None, heldout, everywhere, 4)
    assert drafted == 4 and accepted == pytest.approx(sum(0.8 ** k for k in range(1, 5)), rel=0.02)  # Leviathan eq. 1
    # positions alternate sure (α = 1, the draft is confident) and hopeless (α = 0, unsure): a confidence stop
    # drafts through the sure ones and stops at the first unsure one, which fixed γ cannot
    alpha = torch.tensor([1.0, 1.0, 1.0, 0.0] * (n // 4))
    keep = {0.5: torch.tensor([1.0, 1.0, 1.0, 0.0] * (n // 4))}
    options = [DraftLength("fixed", g) for g in (1, 2, 4, 8)] + [DraftLength("confidence", 16, 0.5)]
    best = choose(alpha, keep, heldout, options, c=0.3, verify_ratio=None)["overall"]
    assert best["draft_length"].policy == "confidence", best


def test_tree_choice_counts_top_k_hits_per_depth_and_prefers_a_tree_where_the_argmax_misses():
    from distill.calibrate import HeldOut
    from distill.tree_choice import K_MAX, choose, nodes, simulate
    from pipeline.sampling import Sampling

    n = 400
    heldout = HeldOut([{}], ["d"], torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), torch.zeros(n),
                      torch.zeros(n, dtype=torch.long), Sampling(), 1, 0)
    everywhere = torch.ones(n, dtype=torch.bool)

    def hits(rank: int) -> torch.Tensor:  # greedy: the target's token is the draft's (rank+1)-th choice
        return (torch.full((n, 1), rank) < torch.arange(1, K_MAX + 1)).float()

    # the target's token is the draft's second choice everywhere: a chain never gets past depth 1, a (2, 2, 2)
    # tree accepts all three depths
    assert simulate(hits(1), heldout, everywhere, (1, 1, 1)) == 0.0
    assert simulate(hits(1), heldout, everywhere, (2, 2, 2)) == pytest.approx(3.0, abs=0.02)
    assert simulate(hits(1), heldout, everywhere, (2, 1)) == pytest.approx(1.0, abs=0.01)
    # sampled serving: per-depth probabilities multiply along the path
    half = torch.full((n, K_MAX), 0.5)
    assert simulate(half, heldout, everywhere, (2, 2)) == pytest.approx(0.5 + 0.25, abs=0.01)
    assert nodes((3, 2, 1)) == 3 + 6 + 6
    flat = {"settings": {"contexts": [64]},
            "target": {"64": {"1": {"ms": 10.0, "ratio": 1.0}, "32": {"ms": 10.0, "ratio": 1.0}}}}  # free verify
    best = choose(hits(1), heldout, flat, c=0.05, candidates=[(1,), (1, 1, 1), (2, 2), (2, 2, 2)])["overall"]
    assert best["tree"] == [2, 2, 2]
    # the draft's argmax always right: the chain wins (a tree only adds verify cost)
    costly = {"settings": {"contexts": [64]},
              "target": {"64": {"1": {"ms": 10.0, "ratio": 1.0}, "32": {"ms": 40.0, "ratio": 4.0}}}}
    best = choose(hits(0), heldout, costly, c=0.05, candidates=[(1, 1, 1), (2, 2, 2)])
    assert best["overall"]["tree"] == [1, 1, 1]


def _exact_sibling_acceptance(p: list[float], q: list[float], k: int, replace: bool = False) -> float:
    """P(one of k candidates is accepted) by enumerating every draw order: recursive rejection sampling with
    candidates drawn without replacement (q renormalised without the rejected token), or, for the wrong
    variant, i.i.d. draws with q left as it was."""
    def step(p, q, depth):
        if depth == k or sum(q) == 0:
            return 0.0
        total = 0.0
        for x, qx in enumerate(q):
            if qx == 0:
                continue
            a = min(1.0, p[x] / qx)
            residual = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
            mass = sum(residual)
            p_next = [r / mass for r in residual] if mass > 0 else p
            if replace:
                q_next = q
            else:
                q_next = [0.0 if i == x else qi for i, qi in enumerate(q)]
                q_next = [qi / sum(q_next) for qi in q_next] if sum(q_next) > 0 else q_next
            total += qx * (a + (1 - a) * step(p_next, q_next, depth + 1))
        return total

    return step(p, q, 0)


def test_sibling_acceptance_matches_exact_enumeration_and_rejects_iid_siblings():
    from distill.tree_choice import K_MAX, _race

    p = [0.05, 0.4, 0.3, 0.15, 0.1]  # the last column is the bucket the draft cannot propose
    q = [0.5, 0.2, 0.25, 0.05, 0.0]
    estimate = _race(torch.tensor([p]), torch.tensor([q]), 20000, torch.Generator().manual_seed(0))[0]
    exact = [_exact_sibling_acceptance(p, q, k) for k in range(1, K_MAX + 1)]
    iid = [_exact_sibling_acceptance(p, q, k, replace=True) for k in range(1, K_MAX + 1)]
    assert exact[0] == pytest.approx(sum(min(a, b) for a, b in zip(p, q)))  # one sibling: the chain's α
    # Monte Carlo error of a mean of 20k bounded draws: ≤ 0.5/sqrt(20000) ≈ 0.0035 per column; 4 sigma
    assert estimate.tolist() == pytest.approx(exact, abs=0.015)
    assert max(abs(a - b) for a, b in zip(iid[1:], exact[1:])) > 0.05  # the wrong rule is told apart
    assert all(a <= b + 1e-9 for a, b in zip(exact, exact[1:])) and exact[-1] <= 0.9 + 1e-9  # never the bucket


def test_greedy_serving_calibrates_a_tree_or_a_chain_per_domain(setup, tmp_path):
    from pipeline.spec import SpeculativeSpec

    run_stage(setup, tmp_path, "distill.serving.temperature=0", "distill.trainer.max_steps=20")
    spec = SpeculativeSpec.read(tmp_path / "draft")
    assert set(spec.tree) == {"chat", "code", "default"}
    assert all(tree is None or (isinstance(tree, list) and set(tree) != {1}) for tree in spec.tree.values())
    assert all(v > 0 for v in spec.predicted_speedup.values())


def test_sampled_serving_calibrates_trees_from_the_sibling_acceptance(setup, tmp_path):
    from pipeline.spec import SpeculativeSpec

    run_stage(setup, tmp_path, "distill.trainer.max_steps=20", "distill.calibration.tree_samples=4")
    spec = SpeculativeSpec.read(tmp_path / "draft")
    assert not spec.sampling.greedy and set(spec.tree) == {"chat", "code", "default"}
    assert all(tree is None or (isinstance(tree, list) and set(tree) != {1}) for tree in spec.tree.values())
    assert all(v > 0 for v in spec.predicted_speedup.values())
    run_stage(setup, tmp_path / "chains", "distill.trainer.max_steps=20", "distill.calibration.tree_samples=0")
    assert set(SpeculativeSpec.read(tmp_path / "chains" / "draft").tree.values()) == {None}


def test_export_works_as_hf_assistant_model_with_greedy_output_equal_to_target(distilled, setup):
    from transformers import AutoModelForCausalLM

    _, _, out = distilled
    target = AutoModelForCausalLM.from_pretrained(setup["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft").eval()
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == VOCAB
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.cat([torch.tensor([[2, 4]]), torch.randint(6, VOCAB, (1, 6), generator=g)], 1)
        kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=1, eos_token_id=None)
        plain = target.generate(ids, **kwargs)
        assisted = target.generate(ids, assistant_model=draft, **kwargs)
        assert torch.equal(plain, assisted)


def test_vocab_subset_online_teacher_and_on_policy_batches(setup, tmp_path):
    result, tracker = run_stage(setup, tmp_path, "model.draft.vocab_subset=48", "distill.objective.teacher=online",
                                "distill.objective.lmbda=0.5", "distill.trainer.max_epochs=1", "distill.objective.loss=fkl")
    spec = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert spec["training"]["steps"] == 5  # max_epochs=1 caps max_steps: ceil(18 train rows / batch 4)
    assert len(spec["vocab_subset"]) == 48 and 1 in spec["vocab_subset"] and 3 in spec["vocab_subset"]
    assert tracker.metrics["on_policy_batches"] > 0


def crash_at_step_30(setup, out: Path, monkeypatch, *overrides: str):
    """Runs the stage until its 31st loss computation raises, as a Ctrl-C would (checkpoint-20 is on disk);
    returns the real compute_loss to put back."""
    from distill.trainer import DistillTrainer

    compute = DistillTrainer.compute_loss
    calls = {"n": 0}

    def crashing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 30:
            raise KeyboardInterrupt("simulated crash")
        return compute(self, *args, **kwargs)

    monkeypatch.setattr(DistillTrainer, "compute_loss", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_stage(setup, out, *overrides)
    return compute


def test_resume_continues_from_the_last_checkpoint(setup, distilled, tmp_path, monkeypatch, capsys):
    from distill.trainer import DistillTrainer

    compute = crash_at_step_30(setup, tmp_path, monkeypatch)
    checkpoints = list((tmp_path / "distill_ckpt").glob("*/checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-20"]
    assert not (tmp_path / "draft").exists()  # nothing half-exported
    monkeypatch.setattr(DistillTrainer, "compute_loss", compute)
    capsys.readouterr()
    result, _ = run_stage(setup, tmp_path)
    assert "resuming from" in capsys.readouterr().out and "checkpoint-20" in str(checkpoints[0])
    uninterrupted = json.loads((distilled[2] / "draft" / "speculative.json").read_text())
    assert result["acceptance_after"] == pytest.approx(uninterrupted["acceptance"]["after"]["overall"], abs=0.02)
    # The run's counters continue from the checkpoint: the curve keeps its point from before the crash, the token
    # count is the whole run's, and the time budget counts the minutes trained before the crash.
    resumed = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert [p["step"] for p in resumed["learning_curve"]] == [p["step"] for p in uninterrupted["learning_curve"]] == [20, 40]
    assert resumed["training"]["train_tokens"] == uninterrupted["training"]["train_tokens"]
    assert resumed["learning_curve"][0]["train_tokens"] == uninterrupted["learning_curve"][0]["train_tokens"]
    assert 0 < resumed["learning_curve"][0]["train_minutes"] < resumed["learning_curve"][1]["train_minutes"]
    assert set(resumed["learning_curve"][1]["by_domain"]) == set(uninterrupted["acceptance"]["after"]) - {"overall"}


def test_a_resume_with_the_budget_spent_trains_no_further_step(setup, tmp_path, monkeypatch):
    from distill.progress import PROGRESS_FILE
    from distill.trainer import DistillTrainer

    # checkpoints every 12 steps: the last one before the crash (24) is mid-epoch (5 steps an epoch), where
    # Trainer.train would resume into one more step
    compute = crash_at_step_30(setup, tmp_path, monkeypatch, "distill.checkpoint.save_steps=12")
    checkpoint = max((tmp_path / "distill_ckpt").glob("*/checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoint.name == "checkpoint-24"
    saved = json.loads((checkpoint / PROGRESS_FILE).read_text())
    (checkpoint / PROGRESS_FILE).write_text(json.dumps(saved | {"train_seconds": 120.0}))  # 2 minutes spent
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint_weights = load_file(checkpoint / "model.safetensors")
    calls = []
    monkeypatch.setattr(DistillTrainer, "compute_loss", lambda *a, **k: calls.append(1) or compute(*a, **k))
    run_stage(setup, tmp_path, "distill.checkpoint.save_steps=12", "distill.checkpoint.max_train_minutes=1")
    spec = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert not calls and spec["training"]["steps"] == 24 and spec["training"]["train_tokens"] == saved["train_tokens"]
    assert spec["learning_curve"][-1]["step"] == 24
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").state_dict()
    layer = next(k for k in checkpoint_weights if "layers.0.mlp.up_proj" in k)
    assert torch.allclose(exported[layer].float(), checkpoint_weights[layer].float(), atol=1e-2)  # bf16 export


def test_the_time_budget_counts_minutes_trained_before_a_resume(tmp_path):
    from distill.progress import PROGRESS_FILE, RunProgress, TimeBudgetCallback

    checkpoint = tmp_path / "checkpoint-20"
    checkpoint.mkdir()
    (checkpoint / PROGRESS_FILE).write_text(json.dumps({"step": 20, "train_tokens": 500, "train_seconds": 59.0,
                                                        "curve": []}))
    progress = RunProgress(checkpoint)
    progress.started = time.time() - 2  # two more seconds trained after the resume
    control = types.SimpleNamespace(should_training_stop=False, should_save=False)
    TimeBudgetCallback(1.0, progress).on_step_end(types.SimpleNamespace(device="cpu"), None, control)
    assert control.should_training_stop and control.should_save  # 59 s + 2 s > 1 minute
    assert progress.tokens() == 500 and RunProgress(None).seconds() == 0.0


@pytest.mark.parametrize("extra,match", [
    (("paths.collect=/nonexistent",), "no collected data"),
    (("distill.objective.loss=kl",), "unknown distillation loss"),
    (("model.draft.derive.layers=[0,9]",), "out of range"),
])
def test_bad_input_is_one_clear_error(setup, tmp_path, extra, match):
    with pytest.raises(PipelineError, match=match):
        run_stage(setup, tmp_path, *extra)
    assert not (tmp_path / "draft").exists()


def test_draft_with_another_tokenizer_is_refused(setup, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    words[10], words[11] = words[11], words[10]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    other = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    draft = tiny_llama(vocab_size=VOCAB, layers=1)
    draft.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(PipelineError, match="different ids"):
        run_stage(setup, tmp_path / "out", "model.draft.init=pretrained", f"model.draft.path={tmp_path / 'other'}")


def test_two_processes_with_accelerate(setup, tmp_path):
    """`accelerate launch --num_processes 2 -m pipeline stage=distill` on CPU (gloo)."""
    if shutil.which("accelerate") is None:
        pytest.skip("accelerate CLI not installed")
    cmd = ["accelerate", "launch", "--num_processes", "2", "--cpu", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "pipeline", "stage=distill",
           *overrides(setup, tmp_path, "runtime.threads=1", "distill.trainer.max_steps=10", "distill.heldout.eval_steps=5",
                      "distill.checkpoint.save_steps=5")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    rendezvous = ("Address already in use", "Connection refused", "connectFullMesh", "failed to bind", "DistNetworkError")
    if proc.returncode != 0 and any(s in output for s in rendezvous):
        pytest.skip(f"two CPU processes cannot rendezvous here: {output.strip().splitlines()[-1][:200]}")
    assert proc.returncode == 0, output[-3000:]
    spec = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert spec["training"]["steps"] == 10
    assert output.count("held-out acceptance before") == 1  # evaluation runs on the main process only


@pytest.mark.smoke
def test_real_target_derived_draft_with_vocab_subset_exports_a_working_assistant(real_target, tmp_path):
    """The embedded SmolLM2 target: a two-layer derived draft with an FR-Spec head, exported, reloaded and used
    as HF `assistant_model`: greedy output equals the target's own."""
    from transformers import AutoModelForCausalLM

    from distill.draft import build_draft
    from distill.export import save_draft
    from pipeline.heads import restore_full_head, use_subset_head
    from pipeline.sampling import Sampling
    from pipeline.spec import SpeculativeSpec

    target, tokenizer = real_target
    draft, draft_tok, info = build_draft({"init": "derive", "derive": {"layers": [0, 1]}}, target, tokenizer, {})
    head = use_subset_head(draft, torch.arange(4096))
    assert draft(torch.tensor([[1, 2, 3]])).logits.shape[-1] == 4096
    restore_full_head(draft, head)
    spec = SpeculativeSpec({"name": "SmolLM2"}, Sampling(), info, list(range(4096)))
    save_draft(draft, draft_tok, tmp_path / "draft", spec, "# card", target.generation_config)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, **kwargs), target.generate(ids, assistant_model=reloaded, **kwargs))


def test_a_draft_that_training_made_worse_is_not_shipped(setup, tmp_path):
    # a learning rate this high wrecks the one-layer draft; keep_best exports the initial weights instead
    result, _ = run_stage(setup, tmp_path, "distill.trainer.learning_rate=3.0", "distill.trainer.max_steps=10", "distill.trainer.warmup_steps=0",
                          "distill.trainer.max_grad_norm=1e9")
    spec = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert spec["acceptance"]["after_training"]["overall"] < spec["acceptance"]["before"]["overall"]
    assert spec["selected"] == "init" and spec["acceptance"]["after"] == spec["acceptance"]["before"]
    assert "the initial draft" in (tmp_path / "draft" / "README.md").read_text()


def test_a_knob_added_later_keeps_older_checkpoints_fingerprint_until_it_is_set():
    from omegaconf import OmegaConf, open_dict

    from distill.stage import ADDED_LATER, fingerprint
    from tests.conftest import REPO

    cfg = OmegaConf.create({"seed": 0, "model": {"draft": {"layers": [0, 1]}},
                            "distill": OmegaConf.load(REPO / "conf/distill/default.yaml")})
    older = copy.deepcopy(cfg)
    with open_dict(older):
        for group, key in ADDED_LATER:
            del older.distill[group][key]  # the config as it was before the knob existed
    args = ({"path": "t"}, {"fingerprint": "c"}, 10)
    assert fingerprint(cfg, *args) == fingerprint(older, *args)
    cfg.distill.objective.adaspec_reference = "some/draft"
    assert fingerprint(cfg, *args) != fingerprint(older, *args)


def test_on_policy_continuations_are_as_long_as_the_collected_ones_and_that_length_names_the_checkpoint():
    from omegaconf import OmegaConf

    from distill.stage import fingerprint
    from distill.trainer import DistillConfig
    from distill.training import generation_length
    from tests.conftest import REPO

    cfg = OmegaConf.create({"seed": 0, "model": {"draft": {"layers": [0, 1]}},
                            "distill": OmegaConf.load(REPO / "conf/distill/default.yaml")})
    manifest, ident = {"fingerprint": "c", "max_new_tokens": 96}, {"path": "t"}
    assert generation_length(cfg.distill.objective, manifest) == 96

    def print_with(**objective):
        c = cfg.copy()
        c.distill.objective.update(objective)
        return fingerprint(c, ident, manifest, 10)

    # off-policy: nothing is generated, so the length names nothing (older checkpoints keep their name)
    assert print_with(max_new_tokens=64) == print_with()
    # on-policy: the resolved length is what counts: null and an explicit 96 train alike, 64 does not
    assert print_with(lmbda=0.5) == print_with(lmbda=0.5, max_new_tokens=96) != print_with(lmbda=0.5, max_new_tokens=64)
    assert print_with(lmbda=0.5, max_new_tokens=400) == print_with(lmbda=0.5, max_new_tokens=256)  # capped
    objective = {**OmegaConf.to_container(cfg.distill.objective), "max_new_tokens": 96}
    assert DistillConfig(output_dir="unused", report_to="none", **objective).max_new_tokens == 96
    objective["max_new_tokens"] = None
    assert DistillConfig(output_dir="unused", report_to="none", **objective).max_new_tokens == 256


def test_a_resume_from_the_last_step_trains_no_further_step(setup, tmp_path, monkeypatch):
    """A crash after the final checkpoint (or a rerun to calibrate for other serving): the step budget is spent."""
    import shutil

    from distill.trainer import DistillTrainer

    compute = crash_at_step_30(setup, tmp_path, monkeypatch, "distill.checkpoint.save_steps=12")
    checkpoint = max((tmp_path / "distill_ckpt").glob("*/checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    shutil.move(checkpoint, checkpoint.with_name("checkpoint-40"))  # as if saved at the last step (max_steps=40)
    calls = []
    monkeypatch.setattr(DistillTrainer, "compute_loss", lambda *a, **k: calls.append(1) or compute(*a, **k))
    run_stage(setup, tmp_path, "distill.checkpoint.save_steps=12")
    spec = json.loads((tmp_path / "draft" / "speculative.json").read_text())
    assert not calls and spec["training"]["steps"] == 40
