"""Eval puts distill's prediction beside what it measured: per domain the predicted speedup of what the evaluated
draft runs there (1.0 where calibrated "off"), and the predicted-vs-measured plot; nothing when eval overrides the
calibration (then there is no prediction for what ran)."""
from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from pipeline.sampling import Sampling
from pipeline.decoding.spec import SpeculativeSpec
from tests.test_eval_stage import models, run_stage  # noqa: F401  (the module fixture and the stage runner)


def test_eval_reports_the_calibrations_prediction_beside_the_measured_speedup(tmp_path, models):
    variant = tmp_path / "draft_predicted"
    shutil.copytree(models["draft"], variant)
    spec = SpeculativeSpec.read(variant)
    recipes = {d: replace(r, speculate=True) for d, r in spec.recipes.items()}
    replace(spec, sampling=Sampling(0.0), recipes=recipes | {"code": replace(spec.recipe("code"), speculate=False)},
            predicted_speedup={"chat": 1.2, "code": 0.9, "default": 1.1}).write(variant)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    metrics, out, _ = run_stage(tmp_path / "a", models, f"eval.draft={variant}", "eval.draft_init=none",
                                "eval.temperature=0", "eval.gammas=[]")
    assert metrics["predicted"] == {"chat": {"speedup": 1.2, "speculate": True},
                                    "code": {"speedup": 1.0, "speculate": False}}  # off: plain decoding's 1.0
    assert (out / "predicted_vs_measured.png").stat().st_size > 0
    tokens = metrics["predicted_overall"]["tokens"]
    assert metrics["predicted_overall"]["speedup"] == pytest.approx(
        (tokens["chat"] + tokens["code"]) / (tokens["chat"] / 1.2 + tokens["code"] / 1.0))
    assert "Calibration predicted" in (out / "report.md").read_text()
    forced, out, _ = run_stage(tmp_path / "b", models, f"eval.draft={variant}", "eval.draft_init=none",
                               "eval.temperature=0", "eval.gammas=[]", "eval.drafting=2")
    assert "predicted" not in forced and not (out / "predicted_vs_measured.png").exists()


def test_the_overall_prediction_mixes_the_domains_as_eval_mixes_its_requests():
    """Σ tokens / Σ (tokens / predicted speedup): a domain predicted 2× and one at plain decoding's 1.0, with equal
    tokens, mix to 4/3 (a harmonic mean), not to the 1.5 of their mean; a method other than the evaluated draft
    and a domain without a prediction do not count."""
    from eval.stage import predicted_overall

    predicted = {"code": {"speedup": 2.0, "speculate": True}, "qa": {"speedup": 1.0, "speculate": False}}
    records = [{"method": "speculative", "domain": d, "tokens": [0] * 48} for d in ("code", "qa", "code", "qa")]
    records += [{"method": "autoregressive", "domain": "code", "tokens": [0] * 48},
                {"method": "speculative", "domain": "math", "tokens": [0] * 48}]
    overall = predicted_overall(predicted, records)
    assert overall["speedup"] == pytest.approx(4 / 3) and overall["tokens"] == {"code": 96, "qa": 96}
    assert predicted_overall(predicted, records[4:5]) is None


def test_a_tree_is_guarded_with_its_own_per_depth_acceptance_not_the_chains():
    from hydra import compose, initialize_config_dir

    from eval.settings import EvalSettings
    from tests.conftest import REPO

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        settings = EvalSettings.from_config(compose("config").eval)
    trees = {"code": {"3": {"accepted": 0.4}, "3,1": {"accepted": 0.52}}}
    spec = SpeculativeSpec(target={}, sampling=Sampling(0.7), draft={}, cost={"c": 0.1},
                           per_position_acceptance={"code": [0.28, 0.08], "overall": [0.3, 0.1]},
                           tree_candidates=trees)
    # depth 1 of (3, 1) accepts one of three siblings: A(3) = 0.40; depth 2 adds A(3,1) − A(3) = 0.12
    assert guard_for(spec, "code", settings, [3, 1]).prior == (0.4, 0.12)
    assert guard_for(spec, "code", settings, [3]).prior == (0.4,)
    # a chain, or a tree whose truncations were not simulated: the chain's per-position acceptance
    assert guard_for(spec, "code", settings).prior == (0.28, 0.08)
    assert guard_for(spec, "code", settings, [2, 2]).prior == (0.28, 0.08)


def guard_for(spec, domain, settings, tree=None):
    """The guard spec.plan gives a domain's chain (or `tree`) under eval's guard settings."""
    return spec.plan(domain, spec.sampling, drafting=tuple(tree) if tree else 4, guard=settings.guard_settings).guard
