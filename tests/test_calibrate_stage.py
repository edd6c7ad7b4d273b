"""The calibrate stage (distill/calibrate_stage.py) apart from training: alone on a finished distill output it
reproduces the run's serving recipe, a calibration setting changes the recipe without touching the trained weights
(and under DVC reruns calibrate and eval, never distill), and it calibrates any draft directory."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from pipeline.measure import speculation_profile as sp
from pipeline.errors import PipelineError
from tests.conftest import REPO, read_spec, run_calibrate_stage

RECIPE = ("vocab_subset", "distilled", "selected", "recipes", "acceptance", "mean_accepted_length", "predicted_speedup", "cost", "training", "learning_curve", "heldout")


def spec_of(directory: Path) -> dict:
    return read_spec(directory)


def digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_calibrate_alone_reproduces_the_runs_recipe_and_a_changed_setting_leaves_training_untouched(
        setup, distilled, tmp_path):
    run = distilled[2]
    trained, profile = run / "trained", run / "draft" / "cost_profile.json"  # the run's own measured costs
    before = digest(trained)
    same = tmp_path / "same"
    run_calibrate_stage(setup, same, f"paths.trained={trained}", f"calibrate.cost.profile={profile}")
    for name in ("draft", "draft_init"):
        ours, theirs = spec_of(same / name), spec_of(run / name)
        assert {k: ours[k] for k in RECIPE} == {k: theirs[k] for k in RECIPE}, name
    # the deliberately changed setting: τ may only be the serving temperature; the recipe differs, the weights do not
    changed = tmp_path / "changed"
    run_calibrate_stage(setup, changed, f"paths.trained={trained}", f"calibrate.cost.profile={profile}",
                        "calibrate.tau_ratios=[1.0]", "calibrate.tau_refine=0")
    serving = spec_of(run / "draft")["sampling"]["temperature"]
    taus = {name: {r["draft_temperature"] for r in spec_of(name / "draft")["recipes"].values()} for name in (changed, run)}
    assert taus[changed] == {serving} and taus[run] != {serving}
    assert digest(trained) == before
    assert not (same / "distill_ckpt").exists() and not (changed / "distill_ckpt").exists()  # nothing trained


def test_calibrate_takes_any_draft_directory(setup, distilled, tmp_path):
    run = distilled[2]
    plain = tmp_path / "plain"  # weights alone (distill's draft_init): no speculative.json to read provenance from
    run_calibrate_stage(setup, plain, f"calibrate.draft={run / 'trained' / 'draft_init'}")
    spec = spec_of(plain / "draft")
    assert spec["distilled"] is False and spec["draft"]["init"] == "pretrained" and spec["recipes"]
    assert spec["acceptance"]["before"] == spec["acceptance"]["after"]  # its own numbers: nothing to compare with
    assert not (plain / "draft_init").exists()  # a given draft is calibrated alone
    published = tmp_path / "published"  # an export: its FR-Spec head and provenance travel with it
    run_calibrate_stage(setup, published, f"calibrate.draft={run / 'draft'}")
    spec, own = spec_of(published / "draft"), spec_of(run / "draft")
    assert spec["distilled"] is True and spec["training"] == own["training"] and spec["vocab_subset"] == own["vocab_subset"]
    with pytest.raises(PipelineError, match="not a model directory"):
        run_calibrate_stage(setup, tmp_path / "bad", f"calibrate.draft={tmp_path}")


def test_calibration_reads_the_first_request_tokens_of_each_held_out_completion(setup, distilled, tmp_path):
    """calibrate.request_tokens: the calibration is for requests of that many new tokens, so it reads only each
    held-out completion's first positions (a request's opening accepts differently from its later tokens); its
    speculative.json says the length. null reads the whole completions."""
    run = distilled[2]
    sizes = {}
    for tokens in (4, "null"):
        out = tmp_path / f"first-{tokens}"
        run_calibrate_stage(setup, out, f"calibrate.draft={run / 'draft'}", f"calibrate.request_tokens={tokens}")
        sizes[tokens] = spec_of(out / "draft")["heldout"]
    assert sizes[4]["completion_tokens"] == 4
    for part in ("calibration", "reporting"):
        assert sizes[4][part]["rows"] == sizes["null"][part]["rows"]
        assert sizes[4][part]["positions"] <= 4 * sizes[4][part]["rows"] < sizes["null"][part]["positions"]
    with pytest.raises(PipelineError, match="request_tokens"):
        run_calibrate_stage(setup, tmp_path / "bad", f"calibrate.draft={run / 'draft'}", "calibrate.request_tokens=0")


def test_the_off_line_names_the_draft_it_is_about(setup, distilled, tmp_path, capsys):
    """The stage calibrates two drafts one after the other: a domain's "off" must say whose it is. A margin no
    drafting can reach turns every domain off for both."""
    out = tmp_path / "off"
    run_calibrate_stage(setup, out, f"paths.trained={distilled[2] / 'trained'}",
                        "calibrate.speculate_margin=1000")
    off = [line for line in capsys.readouterr().out.splitlines() if "plain decoding (off) for" in line]
    assert [line.split("] ", 1)[1].split(": plain", 1)[0] for line in off] == [str(out / "draft"), str(out / "draft_init")]


def test_each_calibrated_export_carries_a_speculation_profile_that_reproduces_its_mean_accepted_length(distilled):
    run = distilled[2]
    for name in ("draft", "draft_init"):
        spec, profile = spec_of(run / name), sp.read(run / name)
        if not spec.get("mean_accepted_length"):  # an uncalibrated draft_init: no recipe to profile
            assert profile is None
            continue
        means = spec["mean_accepted_length"]
        sections = {"overall": profile, **profile["per_category"]}
        assert set(sections) == set(means["after"]) and profile["measurement_conditions"]["source"] == sp.HELDOUT
        for domain, mean in means["after"].items():
            assert sections[domain]["marginal_accept_rates"] == pytest.approx(
                spec["per_position_acceptance"][domain], abs=1e-6)
            assert sp.consistency(sections[domain], mean, means["gamma"])["passed"], (name, domain)


def test_calibrate_without_a_trained_draft_names_the_stage_to_run(setup, tmp_path):
    with pytest.raises(PipelineError, match="stage=distill"):
        run_calibrate_stage(setup, tmp_path)


# ---------------------------------------------------------------- DVC: which stage a setting reruns
def stage_params() -> dict[str, list[str]]:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    return {name: [p for p in stage.get("params", []) if isinstance(p, str)] for name, stage in stages.items()}


def leaf_keys(tree, prefix: str) -> list[str]:
    if not isinstance(tree, dict):
        return [prefix]
    return [key for name, value in tree.items() for key in leaf_keys(value, f"{prefix}.{name}")]


def reads(params: list[str], key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in params)


def calibration_keys_rerunning(params: dict[str, list[str]], stage: str) -> list[str]:
    calibrate = yaml.safe_load((REPO / "params.yaml").read_text())["calibrate"]
    keys = [k for k in leaf_keys(calibrate, "calibrate") if k not in ("calibrate.keep_best", "calibrate.keep_best_rule")]
    return [k for k in keys if reads(params[stage], k)]


def test_a_calibration_setting_reruns_calibrate_and_not_distill_under_dvc():
    params = stage_params()
    assert calibration_keys_rerunning(params, "distill") == []
    assert len(calibration_keys_rerunning(params, "calibrate")) > 20  # every one of them
    assert reads(params["distill"], "distill.trainer.max_steps") and reads(params["distill"], "distill.objective.loss")
    # the deliberately wrong dvc.yaml: distill reading calibrate's whole group, so every knob would retrain
    assert calibration_keys_rerunning({**params, "distill": ["distill", "calibrate"]}, "distill")


def test_a_training_setting_reruns_distill_and_not_calibrate_under_dvc():
    params = stage_params()
    defaults = yaml.safe_load((REPO / "params.yaml").read_text())["distill"]
    training = [k for group in ("trainer", "checkpoint") for k in leaf_keys(defaults[group], f"distill.{group}")]
    assert training and all(reads(params["distill"], k) for k in training)
    assert [k for k in training if reads(params["calibrate"], k)] == []
    assert reads(params["calibrate"], "distill.heldout.support")
    assert reads(params["calibrate"], "distill.split.heldout_fraction")
    # the deliberately wrong dvc.yaml: calibrate reading the whole distill group
    assert any(reads(["calibrate", "distill"], k) for k in training)


def test_an_engine_judges_the_trained_weights_only_where_keep_best_may_choose():
    from types import SimpleNamespace

    from distill.calibrate_stage import engine_rival

    init_job = SimpleNamespace(draft="initial weights")
    trained, kept_init = SimpleNamespace(selected="distilled"), SimpleNamespace(selected="init")
    assert engine_rival(init_job, trained, keep_best=True) == "initial weights"
    assert engine_rival(init_job, trained, keep_best=False) is None  # keep_best=false: the trained weights everywhere
    assert engine_rival(init_job, kept_init, keep_best=True) is None  # nothing trained to judge
    assert engine_rival(None, trained, keep_best=True) is None  # a given draft alone
