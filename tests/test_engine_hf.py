"""eval.engine=hf: every method inside HF generate (plain vs assisted with each draft's calibrated policy), on
tiny random models: HF's greedy tokens unchanged by the draft, HF's drafted/accepted tokens counted per pass, a
domain calibrated "off" served by HF plain, and what HF cannot run refused in one line."""
from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from pipeline.decoding.draft_length import DraftLength
from pipeline.errors import PipelineError
from pipeline.sampling import Sampling
from pipeline.decoding.spec import SpeculativeSpec
from tests.test_eval_stage import models, run_stage  # noqa: F401  (the module fixture and the stage runner)
from tests.conftest import read_spec


def test_hf_engine_measures_hf_assisted_against_hf_plain_with_the_same_greedy_tokens(tmp_path, models):
    metrics, out, _ = run_stage(tmp_path, models, "eval.engine=hf", f"eval.draft={models['draft']}",
                                f"eval.draft_init={models['draft_init']}", "eval.temperature=0", "eval.gammas=[1]")
    for name, domain in metrics["domains"].items():
        assert {"autoregressive", "speculative", "speculative_init"} <= set(domain)
        spec = domain["speculative"]
        assert spec["greedy_match"] == 1.0 and domain["speculative_init"]["greedy_match"] == 1.0
        assert spec["n_drafted"] > 0 and 0.0 <= spec["acceptance_rate"] <= 1.0  # HF's own passes, counted
        assert spec["gamma"] == (2 if name == "chat" else 3)  # the calibrated γ reached num_assistant_tokens
    assert metrics["setup"]["settings"]["engine"] == "hf"
    assert set(metrics["gamma_sweep"]["by_gamma"]) == {"1"}  # γ sweeps run in HF too
    report = (out / "report.md").read_text()
    assert "HF assisted" in report and "own speculative" not in report  # the methods are HF's, and say so


def test_hf_engine_serves_a_domain_calibrated_off_with_hf_plain(tmp_path, models):
    variant = tmp_path / "draft_off"
    shutil.copytree(models["draft"], variant)
    spec = SpeculativeSpec.read(variant)
    replace(spec, sampling=Sampling(0.0), recipes={d: replace(r, speculate=d != "code", chain=DraftLength("fixed", 3))
                                                   for d, r in spec.recipes.items()}).write(variant)
    metrics, _, _ = run_stage(tmp_path, models, "eval.engine=hf", f"eval.draft={variant}", "eval.draft_init=none",
                              "eval.temperature=0", "eval.gammas=[]")
    code, chat = metrics["domains"]["code"]["speculative"], metrics["domains"]["chat"]["speculative"]
    assert code["n_drafted"] == 0 and code["greedy_match"] == 1.0
    assert chat["n_drafted"] > 0 and chat["greedy_match"] == 1.0


@pytest.mark.parametrize("override", ["eval.trees=[[2,1]]", "eval.baselines=true", "eval.compare_draft_lengths=true"])
def test_hf_engine_refuses_what_only_our_decoder_runs(tmp_path, models, override):
    with pytest.raises(PipelineError, match="eval.engine=hf"):
        run_stage(tmp_path, models, "eval.engine=hf", override)


def test_hf_engine_follows_the_exports_hf_calibration_per_domain(tmp_path, models):
    """speculative.json engines.hf (HF's own calibration) wins over the decoder's policy in eval.engine=hf: code
    is "off" there (HF plain), every other domain drafts one token per pass."""
    variant = tmp_path / "draft_hf"
    shutil.copytree(models["draft"], variant)
    one = {"num_assistant_tokens": 1, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
    spec = SpeculativeSpec.read(variant)
    replace(spec, sampling=Sampling(0.0), engines={"hf": {"generation_config": {"code": None, "default": one}}}).write(variant)
    metrics, _, _ = run_stage(tmp_path, models, "eval.engine=hf", f"eval.draft={variant}", "eval.draft_init=none",
                              "eval.temperature=0", "eval.gammas=[]")
    code, chat = metrics["domains"]["code"]["speculative"], metrics["domains"]["chat"]["speculative"]
    assert code["n_drafted"] == 0 and code["greedy_match"] == 1.0
    assert 0 < chat["drafted_per_pass"] <= 1.0 and chat["greedy_match"] == 1.0


def test_distill_calibrates_hf_assisted_with_the_passes_hf_runs(setup, tmp_path):
    import json

    from tests.conftest import run_distill_stage

    run_distill_stage(setup, tmp_path / "out", "calibrate.engines=[hf]", "calibrate.hf.prompts=2",
                      "calibrate.hf.max_new_tokens=8", "calibrate.hf.gammas=[1,2]")
    export = tmp_path / "out" / "draft"
    entry = read_spec(export)["engines"]["hf"]
    assert set(entry["cost"]["verify_ratio"]) == {"1", "2"} and entry["cost"]["c"] == 0.0
    assert all(r > 0 for r in entry["cost"]["verify_ratio"].values()) and entry["cost"]["target_forward_ms"] > 0
    for domain, e in entry["by_domain"].items():
        assert e["num_assistant_tokens"] in (1, 2) and 0.0 <= e["predicted_acceptance"] <= 1.0
        config = entry["generation_config"][domain]
        assert (config is None) == (not e["speculate"])
        if config:
            assert config["num_assistant_tokens"] == e["num_assistant_tokens"]
    shipped = json.loads((export / "generation_config.json").read_text())
    default = entry["generation_config"]["default"]
    if default:  # HF reads the assistant's generation_config: the HF calibration's default setting is shipped
        assert shipped["num_assistant_tokens"] == default["num_assistant_tokens"]
        assert shipped["assistant_confidence_threshold"] == 0.0
    assert "In **hf**" in (export / "README.md").read_text()
