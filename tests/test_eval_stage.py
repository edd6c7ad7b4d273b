"""The eval stage end to end on tiny random models (plus one smoke run on the real embedded target):
artifacts and their schema, lossless greedy decoding, calibration from speculative.json, prompt formats,
Hydra multirun, and bad input refused before anything is written."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
import torch

from pipeline.decoding import PLAIN, DraftPlan
from pipeline.decoding.draft_length import DraftLength
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from pipeline.decoding.spec import Recipe, SpeculativeSpec
from tests.conftest import read_spec, REPO, RecordingTracker, assert_headlines_match_requests, tiny_llama
from tests.conftest import tiny_tokenizer as word_tokenizer

VOCAB = 64
SPECIALS = ["<unk>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
PROMPTS = [
    {"id": "chat-1", "domain": "chat", "turns": ["w7 w8 w9 w10", "w11 w12"]},  # second turn follows the answer
    {"id": "chat-2", "domain": "chat", "turns": ["w13 w14 w15"]},
    {"id": "code-1", "domain": "code", "turns": ["w20 w21 w22 w23 w24"]},
    {"id": "code-2", "domain": "code", "turns": ["w25 w26"]},
]


def tiny_tokenizer(words: list[str] | None = None):
    """conftest's word-level tokenizer over this file's 64 words (a "system" role included)."""
    return word_tokenizer(words or SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))])


def save(model, tokenizer, path: Path, spec: SpeculativeSpec | None = None) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if spec is not None:
        spec.write(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny target, its one-layer derived draft (export with speculative.json), a two-layer undistilled
    draft, and a draft whose tokenizer maps one word differently."""
    from pipeline.modelio.models import derive_draft

    root = tmp_path_factory.mktemp("models")
    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=4, seed=0, tie=False)
    # Calibrated for serving at T=0.8, top-k 20: the sampled test below evaluates with exactly that.
    calibration = SpeculativeSpec(target={"path": "tiny"}, sampling=Sampling(0.8, 20), draft={"init": "derive"},
                                  vocab_subset=list(range(48)),
                                  recipes={"chat": Recipe(gamma=2, draft_temperature=1.1),
                                           "code": Recipe(gamma=3, draft_temperature=1.3),
                                           "default": Recipe(gamma=3, draft_temperature=1.1)})
    undistilled = SpeculativeSpec(target={"path": "tiny"}, sampling=Sampling(0.8, 20), draft={"init": "derive"},
                                  distilled=False, selected="init")
    bad_words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    bad_words[10], bad_words[11] = bad_words[11], bad_words[10]
    return {"target": save(target, tok, root / "target"),
            "draft": save(derive_draft(target, [0]), tok, root / "draft", calibration),
            "draft_init": save(derive_draft(target, [0, 1]), tok, root / "draft_init", undistilled),
            "bad_draft": save(derive_draft(target, [0]), tiny_tokenizer(bad_words), root / "bad_draft")}


def compose_cfg(root: Path, target: Path, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"paths.artifacts={root}", f"model.target.path={target}",
                                            "tracking.enabled=false", "runtime.device=cpu", "runtime.dtype=float32", "eval.max_new_tokens=12",
                                            "eval.warmup_tokens=2", *overrides])


def eval_settings(tmp_path: Path, *overrides: str):
    """EvalSettings of the composed config (the eval group plus compose_cfg's and these overrides)."""
    from eval.settings import EvalSettings

    return EvalSettings.from_config(compose_cfg(tmp_path, tmp_path / "target", *overrides).eval)


def run_stage(tmp_path: Path, models: dict, *overrides: str, prompts: list[dict] = PROMPTS) -> tuple[dict, Path]:
    from eval.stage import run

    prompts_file = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    cfg = compose_cfg(tmp_path / "artifacts", models["target"], f"eval.prompts_file={prompts_file}", *overrides)
    tracker = RecordingTracker()
    run(cfg, tracker)
    out = Path(cfg.paths.eval)
    return json.loads((out / "metrics.json").read_text()), out, tracker


def test_greedy_eval_writes_schema_report_plots_and_matches_autoregressive(tmp_path, models):
    metrics, out, tracker = run_stage(tmp_path, models, f"eval.draft={models['draft']}",
                                      f"eval.draft_init={models['draft_init']}", "eval.temperature=0",
                                      "eval.gammas=[1,3]", "eval.baselines=true")
    assert {"gamma", "temperature", "target", "draft", "domains", "overall"} <= set(metrics)
    assert metrics["temperature"] == 0 and metrics["gamma"] == 3  # the export's default γ
    assert set(metrics["domains"]) == {"chat", "code"}
    methods = {"autoregressive", "speculative", "speculative_init", "hf_generate", "hf_assisted", "hf_assisted_fixed"}
    for name, d in metrics["domains"].items():
        assert d["n_prompts"] == 2 and methods <= set(d)
        spec = d["speculative"]
        for key in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "tokens_per_s",
                    "latency_p50_s", "latency_p95_s", "c"):
            assert key in spec
        assert 0.0 <= spec["acceptance_rate"] <= 1.0
        assert spec["mean_accepted_length"] >= 1.0
        assert all(0.0 <= a <= 1.0 for a in spec["per_position_acceptance"])
        assert 1 <= len(spec["per_position_acceptance"]) <= spec["gamma"]
        assert spec["gamma"] == (2 if name == "chat" else 3)  # per-domain γ from speculative.json
        assert spec["draft_temperature"] is None  # greedy: the calibrated τ is not used
        assert {"tokens_per_s", "latency_p50_s", "latency_p95_s"} <= set(d["autoregressive"])
        assert d["greedy_match"] == 1.0 and d["speculative_init"]["greedy_match"] == 1.0
    assert {"acceptance_rate", "mean_accepted_length", "speedup"} <= set(metrics["overall"])
    measured = metrics["measured"]  # the tuned draft's per-position acceptance in speculation_profile.json's shape
    assert set(measured["per_category"]) == {"chat", "code"} and measured["measurement_conditions"]["drafting"]
    if not (metrics.get("stalls") or {}).get("n_excluded"):  # both pool the same requests
        assert measured["marginal_accept_rates"] == pytest.approx(
            metrics["overall"]["speculative"]["per_position_acceptance"], abs=1e-6)
    # the headline figures are the ones the per-request records give
    assert_headlines_match_requests(metrics, out, ("speculative", "speculative_init"))
    assert metrics["domains"]["chat"]["n_requests"] == 3  # two turns + one turn
    assert set(metrics["gamma_sweep"]["by_gamma"]) == {"1", "3"}
    assert metrics["setup"]["draft"]["vocab_subset"] == 48
    for name in ("metrics.json", "report.md", "requests.jsonl", "acceptance_by_domain.png",
                 "per_position_acceptance.png", "gamma_sweep.png", "latency.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "| chat |" in report and "![latency](latency.png)" in report and "greedy match" in report.lower()
    chat = metrics["domains"]["chat"]["speculative"]
    assert tracker.metrics["chat.speculative.acceptance_rate"] == chat["acceptance_rate"]
    assert str(out) in tracker.artifacts and tracker.tags["eval.resolved_gamma"] == 3
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".eval.tmp")]  # atomic: no leftovers


def test_sampling_eval_uses_calibrated_draft_temperature_and_checks_greedy_fidelity(tmp_path, models):
    metrics, out, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.draft_init=none",
                                "eval.temperature=0.8", "eval.top_k=20", "eval.baselines=false", "eval.gammas=[]")
    assert metrics["temperature"] == 0.8 and "speculative_init" not in metrics["domains"]["code"]
    assert metrics["domains"]["code"]["speculative"]["draft_temperature"] == 1.3
    assert metrics["domains"]["chat"]["speculative"]["draft_temperature"] == 1.1  # the export's default τ
    assert "greedy_match" not in metrics["domains"]["code"]
    assert metrics["fidelity"]["share"] == 1.0
    assert_headlines_match_requests(metrics, out)
    # A user override beats the calibration.
    metrics, _, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.temperature=0.8",
                              "eval.draft_temperature=0.5", "eval.drafting=2", "eval.baselines=false", "eval.gammas=[]",
                              "eval.fidelity_prompts_per_domain=0")
    spec = metrics["domains"]["code"]["speculative"]
    assert spec["draft_temperature"] == 0.5 and spec["gamma"] == 2 and "fidelity" not in metrics


def test_the_guarded_and_the_unguarded_draft_run_side_by_side_on_the_same_requests(tmp_path, models):
    metrics, _, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.draft_init=none",
                              "eval.temperature=0.8", "eval.top_k=20", "eval.baselines=false", "eval.gammas=[]",
                              "eval.guard.compare=true", "eval.min_requests_for_ci=2")
    assert set(metrics["domains"]) == {"chat", "code"} and metrics["temperature"] > 0
    for entry in (*metrics["domains"].values(), metrics["overall"]):
        assert {"speculative", "speculative_unguarded"} <= set(entry)
    versus = metrics["overall"]["comparisons"]["speculative_vs_speculative_unguarded"]
    assert versus["n_requests"] == metrics["overall"]["autoregressive"]["n_requests"] and versus["ci95"] is not None  # paired over the same requests


def test_spec_bench_prompts_file_and_derived_draft(tmp_path, models):
    spec_bench = [{"question_id": 81 + i, "category": cat, "turns": [f"w{30 + i} w31", f"w{40 + i}"]}
                  for i, cat in enumerate(["writing", "writing", "writing", "math_reasoning"])]
    metrics, _, _ = run_stage(tmp_path, models, "eval.draft=derive", "model.draft.derive.layers=[0]",
                              "eval.max_prompts_per_domain=2", "eval.temperature=0", "eval.baselines=false",
                              "eval.gammas=[]", prompts=spec_bench)
    assert set(metrics["domains"]) == {"writing", "math_reasoning"}
    assert metrics["domains"]["writing"]["n_prompts"] == 2 and metrics["domains"]["writing"]["n_requests"] == 4
    assert "derived from target layers [0]" in metrics["draft"]
    assert metrics["overall"]["greedy_match"] == 1.0


def test_missing_default_draft_falls_back_to_derived_draft(tmp_path, models, capsys):
    metrics, _, _ = run_stage(tmp_path, models, "model.draft.derive.layers=[1]", "eval.temperature=0",
                              "eval.baselines=false", "eval.gammas=[]", "eval.domains=[code]")
    assert "no exported draft" in capsys.readouterr().out
    assert "derived" in metrics["draft"] and set(metrics["domains"]) == {"code"}


@pytest.mark.parametrize("override, message", [
    ("eval.drafting=0", "eval.drafting"),
    ("eval.temperature=-1", "eval.temperature"),
    ("eval.top_p=1.5", "eval.top_p"),
    ("eval.gammas=[2,0]", "eval.gammas"),
    ("eval.domains=[poetry]", "poetry"),
    ("eval.draft={bad_draft}", "tokenizers map"),
    ("eval.draft={missing}", "not a model directory"),
    ("+eval.extra_drafts.other={missing}", "not a model directory"),
    ("+eval.extra_drafts.fixed={bad_draft}", "name must be an identifier other than"),
    ("eval.baselines=[hf_assisted,vllm]", "unknown baseline"),
])
def test_bad_input_is_refused_and_writes_nothing(tmp_path, models, override, message):
    override = override.format(bad_draft=models["bad_draft"], missing=tmp_path / "nowhere")
    with pytest.raises(PipelineError, match=message):
        run_stage(tmp_path, models, "eval.baselines=false", "eval.gammas=[]", override)
    assert not (tmp_path / "artifacts" / "eval").exists()


def test_eval_settings_are_the_group_keys_validated_and_normalised_once(tmp_path):
    import dataclasses

    from eval.settings import HF_METHODS, EvalSettings
    from pipeline.decoding import POLICIES

    from pipeline.control.params import compose_config

    assert [f.name for f in dataclasses.fields(EvalSettings)] == list(compose_config([]).eval)  # the group's keys
    settings = eval_settings(tmp_path, "eval.compare_draft_lengths=true", "eval.baselines=true", "eval.domains=code",
                             "eval.gammas=[1,2]", "eval.drafting=[3,2,1]", "eval.trees=null")
    assert settings.compare_draft_lengths == POLICIES and settings.baselines == HF_METHODS
    assert settings.domains == ("code",) and settings.gammas == (1, 2) and settings.drafting == (3, 2, 1)
    assert settings.trees == () and settings.baselines_draft == "speculative" and settings.extra_drafts == {}
    assert settings.sampling.temperature == settings.temperature
    with pytest.raises(FrozenInstanceError):
        settings.drafting = 3
    assert replace(settings, drafting=2).compare_draft_lengths == POLICIES  # replace validates again: idempotent
    with pytest.raises(PipelineError, match="eval.drafting=0 is invalid"):
        replace(settings, drafting=0)
    for override, message in (("+eval.gama=3", "unknown setting"), ("eval.drafting={policy:confidence,max:12.5,threshold:0.4}", "integer >= 1"),
                              ("eval.compare_draft_lengths=fixed", "unknown policy"),
                              ("eval.baselines_draft=other", "not a draft eval loads"),
                              ("eval.control_band=[1.0,1.25]", "0 < low < 1 < high"),
                              ("eval.control_band=[0.8,0.9]", "0 < low < 1 < high"),
                              ("eval.control_band=[1.25,0.8]", "0 < low < 1 < high"),
                              ("eval.control_band=[0.8]", "0 < low < 1 < high")):
        with pytest.raises(PipelineError, match=message) as info:
            eval_settings(tmp_path, override)
        assert "\n" not in str(info.value)
    assert settings.control_band == (0.8, 1.25)  # the shipped pre-registered band
    assert eval_settings(tmp_path, "eval.control_band=[0.5,2]").control_band == (0.5, 2.0)


def test_empty_prompts_file_is_refused(tmp_path, models):
    with pytest.raises(PipelineError, match="empty"):
        run_stage(tmp_path, models, "eval.draft=derive", prompts=[])
    assert not (tmp_path / "artifacts" / "eval").exists()


def test_hydra_multirun_writes_one_eval_per_job(tmp_path, models):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[2:3])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pipeline", "-m", "stage=eval", f"paths.artifacts={tmp_path / 'a'}",
           f"model.target.path={models['target']}", "tracking.enabled=false", "runtime.threads=1", "runtime.dtype=float32",
           f"eval.prompts_file={prompts}", "eval.draft=derive", "model.draft.derive.layers=[0]",
           "eval.max_new_tokens=8", "eval.temperature=0", "eval.baselines=false", "eval.gammas=[]", "eval.drafting=1,2"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = sorted((tmp_path / "a" / "hydra-multirun").glob("*/*/eval/metrics.json"))
    assert [json.loads(p.read_text())["gamma"] for p in found] == [1, 2]
    assert not (tmp_path / "a" / "eval").exists()


@pytest.mark.smoke
def test_smoke_real_model_greedy_speculative_matches_autoregressive(tmp_path, real_target_path):
    prompts = [{"id": "c1", "domain": "chat", "turns": ["Name three primary colours."]},
               {"id": "k1", "domain": "code", "turns": ["Write a Python function that reverses a string."]}]
    prompts_file = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    from eval.stage import run

    cfg = compose_cfg(tmp_path / "artifacts", real_target_path, f"eval.prompts_file={prompts_file}",
                      "eval.draft=derive", "eval.temperature=0", "eval.max_new_tokens=16", "eval.baselines=false",
                      "eval.gammas=[]")
    run(cfg, RecordingTracker())
    metrics = json.loads((Path(cfg.paths.eval) / "metrics.json").read_text())
    assert set(metrics["domains"]) == {"chat", "code"}
    assert metrics["overall"]["greedy_match"] == 1.0
    assert metrics["overall"]["mean_accepted_length"] >= 1.0


def test_a_greedy_mismatch_is_located_and_judged_by_the_targets_top2_gap():
    from eval.fidelity import divergence, ulp

    target = tiny_llama(vocab_size=64, hidden_size=32, layers=2, tie=False)
    ids = torch.tensor([[0, 5, 9, 12]])
    ar = autoregressive_tokens(target, ids, 8)
    spec = ar[:3] + [(ar[3] + 1) % 64] + ar[4:]
    found = divergence(target, ids, ar, spec)
    assert found["position"] == 3 and found["dtype"] == "float32"
    with torch.no_grad():
        logits = target(torch.cat([ids, torch.tensor([ar[:3]])], 1)).logits[0, -1]
    top = logits.topk(2).values
    assert found["top2_gap"] == pytest.approx(float(top[0] - top[1]), abs=1e-5)
    assert not found["near_tie"]  # a random model's fp32 top-2 gap is far above a few ulps
    # Two identical output rows tie exactly: a mismatch between them is a near-tie, not a bug.
    with torch.no_grad():
        head = target.lm_head.weight
        runner_up = int(logits.topk(2).indices[1])
        head[runner_up] = head[ar[3]]
    tied = divergence(target, ids, ar, spec)
    assert tied["top2_gap"] == 0.0 and tied["near_tie"]
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(1.0, torch.float32) == 2 ** -23


def autoregressive_tokens(model, ids, n: int) -> list[int]:
    from pipeline.decoding import autoregressive_generate

    return autoregressive_generate(model, ids, max_new_tokens=n).tokens.tolist()


def test_fp32_recheck_reruns_only_the_mismatched_requests_in_float32(tmp_path):
    from eval.fidelity import fp32_recheck
    from eval.stage import Draft
    from pipeline.modelio.models import derive_draft

    target = tiny_llama(vocab_size=64, hidden_size=32, layers=3).to(torch.bfloat16)
    draft = Draft(derive_draft(target, [0]), {})
    contexts = [{"domain": d, "prompt_id": f"{d}-{i}", "turn": 0, "ids": torch.tensor([[0, 5 + i, 9, 12]])}
                for d in ("chat", "code") for i in range(2)]
    plans = {"chat": DraftPlan(3), "code": DraftPlan(2)}
    s = eval_settings(tmp_path, "eval.fidelity_prompts_per_domain=1")  # max_new_tokens=12
    out = fp32_recheck(contexts, target, draft, plans, None, s, [{"prompt_id": "code-1"}, {"prompt_id": "chat-0"}])
    assert out["n_prompts"] == 2 and out["share"] == 1.0 and out["mismatches"] == []
    assert next(target.parameters()).dtype == torch.bfloat16  # the served models are left as they were


def test_draft_length_comes_from_the_calibration_unless_overridden(tmp_path):
    from eval.stage import Draft, draft_plan

    spec = SpeculativeSpec(target={}, sampling=Sampling(0.0), draft={},
                           recipes={"code": Recipe(chain=DraftLength("confidence", 16, 0.3), gamma=5),
                                    "default": Recipe(chain=DraftLength("fixed", 3), gamma=3)})
    draft = Draft(None, {}, spec)
    settings = eval_settings(tmp_path)  # calibrated
    policy = lambda domain, **over: draft_plan(draft, domain, replace(settings, **over), Sampling(0.0)).drafting
    assert policy("code") == DraftLength("confidence", 16, 0.3)
    assert policy("chat") == DraftLength("fixed", 3)
    assert policy("code", drafting="fixed") == DraftLength("fixed", 5)  # the calibrated fixed γ
    assert policy("chat", drafting="confidence") == DraftLength("confidence", 16, 0.4)  # HF's threshold, cap 16
    assert policy("chat", drafting={"policy": "confidence", "max": 12, "threshold": 0.5}) == \
        DraftLength("confidence", 12, 0.5)
    assert policy("code", drafting="heuristic") == DraftLength("heuristic", 5)
    assert policy("code", drafting=2) == DraftLength("fixed", 2)  # an explicit γ wins
    assert policy("chat", drafting=2) == DraftLength("fixed", 2)  # also over a calibrated fixed γ (it returned 3)


@pytest.mark.parametrize("override,message", [
    ("eval.drafting=longest", "is not a drafting"),
    ("eval.drafting={policy:confidence,max:16,threshold:1.5}", "must be in \\(0, 1\\)"),
    ("eval.drafting={policy:confidence,max:0,threshold:0.4}", "integer >= 1"),
])
def test_bad_draft_length_settings_are_refused(tmp_path, models, override, message):
    with pytest.raises(PipelineError, match=message):
        run_stage(tmp_path, models, override)
    assert not (tmp_path / "artifacts" / "eval").exists()


def test_hf_assisted_can_run_with_the_undistilled_draft(tmp_path, models):
    metrics, _, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", f"eval.draft_init={models['draft_init']}",
                              "eval.baselines=true", "eval.baselines_draft=speculative_init", "eval.temperature=0",
                              "eval.gammas=[]")
    assert metrics["overall"]["hf_assisted"]["greedy_match"] == 1.0
    with pytest.raises(PipelineError, match="baselines_draft"):
        run_stage(tmp_path, models, "eval.baselines_draft=other")


def test_extra_drafts_run_side_by_side_with_their_own_calibration(tmp_path, models):
    metrics, out, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.draft_init=none",
                                f"+eval.extra_drafts.wide={models['draft_init']}", "eval.baselines=[hf_assisted]",
                                "eval.baselines_draft=speculative_wide", "eval.temperature=0", "eval.gammas=[]")
    assert set(metrics["methods"]) == {"autoregressive", "speculative", "speculative_wide", "hf_assisted"}
    overall = metrics["overall"]
    assert overall["speculative_wide"]["greedy_match"] == overall["hf_assisted"]["greedy_match"] == 1.0
    # Each draft keeps its own calibration: the tuned export's γ on chat is 2, the other draft has none (default 4).
    assert metrics["domains"]["chat"]["speculative"]["gamma"] == 2
    assert metrics["domains"]["chat"]["speculative_wide"]["gamma"] == 4
    assert "hf_generate" not in overall and "speculative_vs_speculative_wide" in overall["comparisons"]
    report = (out / "report.md").read_text()
    assert "## Drafts side by side" in report and "own speculative, draft `wide`" in report


def test_a_speculative_json_of_another_version_is_refused_in_one_line(tmp_path, models):
    import shutil

    draft = shutil.copytree(models["draft"], tmp_path / "old_draft")
    old = read_spec(draft) | {"version": 1, "temperature": 0.8}
    (draft / "speculative.json").write_text(json.dumps(old))
    with pytest.raises(PipelineError, match="format version 1") as info:
        run_stage(tmp_path, models, f"eval.draft={draft}", "eval.baselines=false", "eval.gammas=[]")
    assert "\n" not in str(info.value) and "stage=calibrate" in str(info.value)
    assert not (tmp_path / "artifacts" / "eval").exists()


def test_draft_plan_uses_the_calibration_only_for_the_distribution_it_was_calibrated_for(tmp_path):
    from eval.stage import Draft, draft_plan

    spec = SpeculativeSpec(target={}, sampling=Sampling(0.8, 20), draft={},
                           recipes={"code": Recipe(gamma=5, draft_temperature=1.3),
                                    "default": Recipe(gamma=3, draft_temperature=1.1)})
    draft = Draft(None, {}, spec)
    settings = eval_settings(tmp_path)  # calibrated, no override, default_gamma 4

    def plan(*args):
        result = draft_plan(*args)
        return {"gamma": result.gamma, "draft_temperature": result.draft_temperature}

    assert plan(draft, "code", settings, Sampling(0.8, 20)) == {"gamma": 5, "draft_temperature": 1.3}
    assert plan(draft, "poetry", settings, Sampling(0.8, 20)) == {"gamma": 3, "draft_temperature": 1.1}
    # Another serving distribution: the calibrated γ still applies, the calibrated τ does not.
    assert plan(draft, "code", settings, Sampling(0.8, 0)) == {"gamma": 5, "draft_temperature": None}
    assert plan(draft, "code", settings, Sampling(0.0)) == {"gamma": 5, "draft_temperature": None}
    overridden = replace(settings, drafting=2, draft_temperature=0.5)
    assert plan(draft, "code", overridden, Sampling(0.8, 20)) == {"gamma": 2, "draft_temperature": 0.5}
    uncalibrated = replace(settings, drafting="uncalibrated")
    assert plan(draft, "code", uncalibrated, Sampling(0.8, 20)) == {"gamma": 4, "draft_temperature": None}
    assert draft_plan(Draft(None, {}), "code", settings, Sampling(0.8, 20)).gamma == 4
    # A token tree chosen for sampled serving runs at that sampling only.
    with_tree = Draft(None, {}, SpeculativeSpec(target={}, sampling=Sampling(0.8, 20), draft={},
                                                recipes={"code": Recipe(tree=(3, 1)), "default": Recipe()}))
    assert draft_plan(with_tree, "code", settings, Sampling(0.8, 20)).tree == (3, 1)
    assert draft_plan(with_tree, "chat", settings, Sampling(0.8, 20)).tree is None
    assert draft_plan(with_tree, "code", settings, Sampling(0.0)).tree is None


def test_draft_length_policies_side_by_side(tmp_path, models):
    from eval.tables import policy_rows

    metrics, _, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.temperature=0",
                              "eval.compare_draft_lengths=true", "eval.gammas=[]",
                              "eval.min_requests_for_ci=2")  # intervals on 2-3 requests
    for domain in metrics["domains"].values():
        for policy in ("fixed", "confidence", "heuristic"):
            entry = domain[f"speculative_{policy}"]
            assert entry["draft_length"]["policy"] == policy and entry["greedy_match"] == 1.0  # lossless
            assert entry["n_drafted"] >= entry["n_accepted"] and entry["speedup_ci95"] is not None
    confidence = metrics["overall"]["speculative_confidence"]
    assert confidence["drafted_per_pass"] <= 16  # UNCALIBRATED_CONFIDENCE's cap
    header, rows = policy_rows(metrics)
    assert {row[1] for row in rows} == {"calibrated", "fixed", "confidence", "heuristic"}
    assert "## Draft-length policies" in (tmp_path / "artifacts" / "eval" / "report.md").read_text()
    (tmp_path / "one").mkdir()
    only, _, _ = run_stage(tmp_path / "one", models, f"eval.draft={models['draft']}", "eval.temperature=0",
                           "eval.compare_draft_lengths=[confidence]", "eval.gammas=[]", "eval.max_prompts_per_domain=1")
    assert {k for k in only["overall"] if k.startswith("speculative_")} == {"speculative_confidence"}


def test_tree_sweep_measures_each_tree_beside_the_predicted_speedup(tmp_path, models):
    import shutil

    draft = shutil.copytree(models["draft"], tmp_path / "draft_with_trees")
    spec = SpeculativeSpec.read(draft)
    spec.sampling = Sampling(0.0)  # calibrated for greedy serving: no τ
    spec.recipes = {d: replace(r, draft_temperature=None) for d, r in spec.recipes.items()}
    spec.tree_candidates = {"chat": {"2,1": {"predicted_speedup": 1.2}, "1,1": {"predicted_speedup": 1.1}},
                            "default": {"2,1": {"predicted_speedup": 1.4}, "1,1": {"predicted_speedup": 1.3}}}
    spec.write(draft)
    metrics, out, _ = run_stage(tmp_path, models, f"eval.draft={draft}", "eval.temperature=0", "eval.gammas=[]",
                                "eval.baselines=false", "eval.trees=[[1,1],[2,1]]")
    sweep = metrics["tree_sweep"]
    assert list(sweep["by_tree"]) == ["1,1", "2,1"] and sweep["n_requests"] == 3  # chat-1 has two turns
    # request-weighted over domains: chat's two requests at chat's prediction, code's one at the default
    assert sweep["by_tree"]["2,1"]["predicted_speedup"] == pytest.approx((1.2 * 2 + 1.4) / 3)
    assert 1.0 < sweep["by_tree"]["1,1"]["drafted_per_pass"] <= 2.0 < sweep["by_tree"]["2,1"]["drafted_per_pass"] <= 4.0
    assert (out / "tree_sweep.png").exists() and "## Tree sweep" in (out / "report.md").read_text()
    with pytest.raises(PipelineError, match="eval.trees"):
        run_stage(tmp_path, models, "eval.trees=[[2,a]]")


def test_the_batch_sweep_times_both_batched_decoders_on_the_same_batches(tmp_path, models):
    metrics, out, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.draft_init=none",
                                "eval.temperature=0", "eval.gammas=[]", "eval.baselines=false",
                                "eval.batch_sizes=[1,2,4,8]", "eval.sweep_prompts_per_domain=2")
    sweep = metrics["batch_sweep"]
    assert sweep["batch_sizes"] == [1, 2, 4] and sweep["n_prompts"] == 4  # first turns: no batch of 8
    assert [sweep["by_batch"][b]["n_batches"] for b in ("1", "2", "4")] == [4, 2, 1]
    assert all(row["identical"] for row in sweep["by_batch"].values())  # greedy: lossless per row
    assert sweep["prediction"] == "profile" and sweep["by_batch"]["2"]["gamma"] == 3  # no batching: the plan's γ
    assert "## Batch sweep" in (out / "report.md").read_text()
    with pytest.raises(PipelineError, match="eval.batch_sizes"):
        eval_settings(tmp_path, "eval.batch_sizes=[0]")


def test_a_token_tree_runs_losslessly_in_the_eval_stage(tmp_path, models):
    metrics, _, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.temperature=0",
                              "eval.drafting=[2,2]", "eval.gammas=[]")
    spec = metrics["overall"]["speculative"]
    assert spec["tree"] == [2, 2] and metrics["overall"]["greedy_match"] == 1.0
    assert 0 < spec["drafted_per_pass"] <= 6 and spec["tokens_per_verified_node"] > 0
    # per depth, not per node: two depths; reaching depth 2 unconditioned is at most reaching depth 1
    depth = spec["per_depth_acceptance"]
    assert len(depth) == 2 and len(spec["per_position_acceptance"]) == 2 and all(0 <= a <= 1 for a in depth)
    assert spec["per_position_acceptance"][1] <= spec["per_position_acceptance"][0]
    assert spec["per_position_acceptance"][0] == pytest.approx(depth[0])
    assert "per_depth_acceptance" not in metrics["overall"]["autoregressive"]
    with pytest.raises(PipelineError, match="branching factor"):
        run_stage(tmp_path, models, "eval.drafting=[0,2]")


def test_a_domain_calibrated_off_is_decoded_plainly_unless_a_drafting_is_forced(tmp_path, models):
    """speculative.json speculate[code] = false: eval's `speculative` method decodes code plainly (no draft token
    proposed, the same greedy tokens), chat still speculates; eval.drafting=<γ> forces speculation everywhere."""
    import shutil

    from pipeline.decoding import speculative_generate

    variant = tmp_path / "draft_off"
    shutil.copytree(models["draft"], variant)
    spec = SpeculativeSpec.read(variant)
    spec = replace(spec, sampling=Sampling(0.0), recipes={d: replace(r, speculate=d != "code", chain=DraftLength("fixed", 3))
                                                          for d, r in spec.recipes.items()})
    spec.write(variant)
    assert spec.recipe("code").drafting is None and spec.recipe("chat").drafting == DraftLength("fixed", 3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    metrics, _, _ = run_stage(tmp_path / "a", models, f"eval.draft={variant}", "eval.draft_init=none",
                              "eval.temperature=0.0", "eval.gammas=[]")
    code, chat = metrics["domains"]["code"]["speculative"], metrics["domains"]["chat"]["speculative"]
    assert code["speculate"] is False and code["n_drafted"] == 0 and code["greedy_match"] == 1.0
    assert chat["speculate"] is True and chat["n_drafted"] > 0 and chat["greedy_match"] == 1.0
    forced, _, _ = run_stage(tmp_path / "b", models, f"eval.draft={variant}", "eval.draft_init=none",
                             "eval.temperature=0.0", "eval.gammas=[]", "eval.drafting=2")
    assert forced["domains"]["code"]["speculative"]["n_drafted"] > 0
    # the public API: drafting=None is plain decoding
    from pipeline.modelio.models import load_model

    target = load_model(models["target"])
    ids = torch.tensor([[2, 4, 7, 8, 3, 2, 5]])
    assert (speculative_generate(target, target, ids, plan=PLAIN, max_new_tokens=6).stats.drafted == [])


def test_a_budget_stops_before_a_prompt_that_would_overrun_after_one_per_domain(tmp_path, models):
    """eval.max_minutes far below one prompt's time: the first round (a prompt per domain) still runs, then no
    prompt starts that would end past the budget; the report says how far it got."""
    metrics, out, _ = run_stage(tmp_path, models, f"eval.draft={models['draft']}", "eval.draft_init=none",
                                "eval.temperature=0", "eval.max_minutes=0.0001")
    assert metrics["budget"] == {"max_minutes": 0.0001, "prompts_done": 2, "prompts_planned": 4}
    assert {domain: d["n_prompts"] for domain, d in metrics["domains"].items()} == {"chat": 1, "code": 1}
    assert "eval.max_minutes" in (out / "report.md").read_text()


def test_heldout_prompts_are_the_reporting_part_the_calibration_predicted_on(tmp_path, models):
    """eval.prompts_file=heldout: the train prompts whose ids the draft's evidence.json lists for the reporting part,
    nothing else (not the calibration part's, not eval.jsonl's); a draft without that record is one line."""
    from eval.stage import load_eval_prompts
    from pipeline.decoding.spec import SpeculativeSpec

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    write_jsonl(prompts / "train.jsonl", [{"id": f"t{i}", "domain": "chat", "turns": [f"train {i}"]} for i in range(5)])
    write_jsonl(prompts / "eval.jsonl", [{"id": "e0", "domain": "chat", "turns": ["eval"]}])
    draft = tmp_path / "draft"
    draft.mkdir()
    spec = SpeculativeSpec(target={"path": "tiny"}, sampling=Sampling(0.7), draft={"init": "derive"},
                           heldout={"prompt_ids": {"calibration": ["t1"], "reporting": ["t3", "t4"]}})
    spec.write(draft)
    cfg = compose_cfg(tmp_path / "artifacts", models["target"], f"paths.prompts={prompts}", "eval.prompts_file=heldout",
                      f"eval.draft={draft}")
    settings = eval_settings(tmp_path, f"paths.prompts={prompts}", "eval.prompts_file=heldout", f"eval.draft={draft}")
    by_domain, source = load_eval_prompts(cfg, settings)
    assert [p["id"] for p in by_domain["chat"]] == ["t3", "t4"] and "reporting part" in source
    SpeculativeSpec(target={"path": "tiny"}, sampling=Sampling(0.7), draft={"init": "derive"}).write(draft)
    with pytest.raises(PipelineError, match="records no held-out prompts"):
        load_eval_prompts(cfg, settings)
