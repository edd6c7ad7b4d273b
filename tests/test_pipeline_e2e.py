"""End to end on the real embedded model with the quick budget: `stage=all`, its resume after a
crash, MLflow runs, and `dvc repro` in a fresh clone (first run executes, second is a no-op,
a swept distill param reruns distill, calibrate and eval; a calibration param calibrate and eval only)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.engines.rules import unknown_keys
from tests.conftest import read_spec, REPO, assert_headlines_match_requests

pytestmark = [pytest.mark.smoke, pytest.mark.slow]


def _shared_model_cache() -> list[str]:
    # Reuse the converted embedded model across runs: conversion is tested elsewhere.
    return [f"paths.models={REPO / 'artifacts/models'}", f"paths.cache={REPO / 'artifacts/cache'}"]


# The slow machine's stand-in (README, "Time"): torch and oneDNN held to AVX2 kernels on one thread
SLOW_STAND_IN = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}


def _pipeline(*overrides: str, cwd: Path = REPO, timeout: int = 1200, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline", *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, real_target_path):
    """A quick `stage=all` that first crashes in calibrate (a draft directory that is not there: bad settings fail
    before any stage, tests/test_stage_settings.py, so the crash needs an input only the stage can check), then is
    rerun."""
    artifacts = tmp_path_factory.mktemp("e2e") / "artifacts"
    common = ["experiment=quick", f"paths.artifacts={artifacts}", *_shared_model_cache()]
    crashed = _pipeline(*common, f"calibrate.draft={artifacts.parent / 'no_such_draft'}")
    resumed = _pipeline(*common)
    return artifacts, crashed, resumed


def test_interrupted_run_fails_cleanly_and_resumes(quick_run):
    artifacts, crashed, resumed = quick_run
    assert crashed.returncode == 2, crashed.stderr[-2000:]
    # stderr also carries the earlier stages' progress bars; the failure itself is one line, no traceback
    assert "Traceback" not in crashed.stderr
    last = crashed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "no_such_draft" in last, last
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # collect's finished shards from the crashed run are reused, not regenerated
    done = re.search(r"(\d+) shards \((\d+) already done\)", resumed.stdout)
    assert done and done.group(1) == done.group(2), resumed.stdout[-3000:]


def test_stage_all_gives_each_budgeted_stage_its_share_of_the_deadline(quick_run):
    """stage=all plans each stage from the run's clock (pipeline/control/deadline.py) and the stage runs with that budget."""
    artifacts, _, resumed = quick_run
    plans = dict(re.findall(r"\[pipeline\] deadline: [\d.]+ min left; ([\w.]+)=([\d.]+) ", resumed.stdout))
    assert set(plans) == {"collect.max_minutes", "distill.checkpoint.max_train_minutes", "eval.max_minutes"}, \
        resumed.stdout[-3000:]
    manifest = json.loads((artifacts / "collect/manifest.json").read_text())
    assert manifest["budget"]["max_minutes"] == float(plans["collect.max_minutes"])
    assert float(plans["distill.checkpoint.max_train_minutes"]) <= 1  # experiment=quick's own minute, never raised
    assert re.search(r"\[pipeline\] run finished in [\d.]+ min \(planned [\d.]+, deadline.minutes=15\)", resumed.stdout)
    # the run's first lines: the machine's pass, then the plan sized to it, with the minutes it expects
    lines = [line for line in resumed.stdout.splitlines() if line.startswith("[pipeline]")]
    assert re.match(r"\[pipeline\] machine: .*; a target verify pass \(5 tokens\) takes \d+ ms", lines[0]), lines[:3]
    assert re.match(r"\[pipeline\] plan: [\d.]+ of the shipped sizes .*expected ≈ [\d.]+ min", lines[1]), lines[:3]


def test_on_the_slow_stand_in_the_run_is_sized_to_its_pass(tmp_path):
    """The stand-in's run names it (AVX2 kernels, one thread), plans from its slower pass, and every budgeted stage
    runs with the budget the plan gave it."""
    artifacts = tmp_path / "artifacts"
    run = _pipeline("experiment=quick", f"paths.artifacts={artifacts}", *_shared_model_cache(), env=SLOW_STAND_IN)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("[pipeline]")]
    assert "(AVX2, 1 threads)" in lines[0] and "float32" in lines[0], lines[:2]  # emulated bf16 loses its prefills
    plan = re.match(r"\[pipeline\] plan: ([\d.]+) of the shipped sizes", lines[1])
    assert plan and float(plan.group(1)) < 1, lines[1]  # a pass this slow shrinks the shipped fixed work
    budgets = dict(re.findall(r"\[pipeline\] deadline: [\d.]+ min left; ([\w.]+)=([\d.]+) ", run.stdout))
    manifest = json.loads((artifacts / "collect/manifest.json").read_text())
    assert manifest["budget"]["max_minutes"] == float(budgets["collect.max_minutes"]) and manifest["dtype"] == "float32"


def test_every_artifact_is_written_with_its_schema(quick_run):
    artifacts, _, resumed = quick_run
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (artifacts / f"prompts/{split}.jsonl").read_text().splitlines()]
        assert rows and all({"id", "domain", "turns"} <= set(r) for r in rows)

    from datasets import load_from_disk

    ds = load_from_disk(str(artifacts / "collect/dataset"))
    assert {"id", "domain", "prompt_ids", "completion_ids", "text", "finish_reason"} <= set(ds.column_names)
    assert set(ds["finish_reason"]) <= {"eos", "length"}
    assert json.loads((artifacts / "collect/manifest.json").read_text())["sampling"]

    for name in ("draft", "draft_init"):  # distill's weights, and calibrate's exports of them
        assert (artifacts / "trained" / name / "config.json").exists() and (artifacts / name / "config.json").exists()
    assert json.loads((artifacts / "trained/training.json").read_text())["heldout_idx"]
    spec = read_spec(artifacts / "draft")
    assert {"target", "recipes"} <= set(spec) and spec["recipes"]["default"]["gamma"] >= 1
    assert (artifacts / "draft/README.md").read_text().strip()

    metrics = json.loads((artifacts / "eval/metrics.json").read_text())
    assert {"gamma", "temperature", "target", "draft", "domains", "overall"} <= set(metrics)
    for domain, m in metrics["domains"].items():
        spec_m = m["speculative"]
        assert spec_m["mean_accepted_length"] >= 1.0
        assert {"tokens_per_s", "latency_p50_s", "latency_p95_s", "c", "per_position_acceptance"} <= set(spec_m)
        assert m["autoregressive"]["tokens_per_s"] > 0  # speedup and acceptance: recomputed from requests below
        # Lossless: equal token for token, except where the serving dtype rounds a near-tie differently in the
        # verify pass and the 1-token step (bf16 on CPUs with native bf16; in fp32 that allowance is ~1e-6).
        mismatches = [x for x in metrics["fidelity"]["mismatches"] if x["domain"] == domain]
        assert m["greedy_match"] == 1.0 or mismatches, domain
        assert all(x["near_tie"] for x in mismatches), f"greedy output differs beyond a near-tie: {mismatches}"
    # A near-tie allowance is only an excuse if fp32 agrees: the tuned draft's mismatches are rerun in fp32
    # (eval.fp32_recheck), where speculative and autoregressive output must be equal token for token. An fp32 run
    # has no recheck, and no allowance: any mismatch there fails here.
    tuned = [x for x in metrics["fidelity"]["mismatches"] if x.get("method", "speculative") == "speculative"]
    if tuned:
        recheck = metrics["fidelity"].get("fp32")
        assert recheck is not None, f"greedy mismatches with no fp32 recheck: {tuned}"
        assert recheck["n_prompts"] == len({x["prompt_id"] for x in tuned})
        assert recheck["share"] == 1.0 and recheck["mismatches"] == [], f"fp32 recheck disagrees: {recheck}"
    assert_headlines_match_requests(metrics, artifacts / "eval")
    assert (artifacts / "eval/report.md").read_text().count("|") > 10
    assert list((artifacts / "eval").glob("*.png"))
    # the per-domain table is printed at the end of the run
    assert "overall" in resumed.stdout[-4000:]


def test_mlflow_holds_one_nested_run_per_stage(quick_run):
    artifacts, _, resumed = quick_run
    assert resumed.returncode == 0
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}")
    exp = client.get_experiment_by_name("draft-distillation")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'")
    by_name = {}
    for r in runs:
        by_name.setdefault(r.info.run_name, []).append(r)
    assert {"all", "prepare", "collect", "distill", "calibrate", "eval"} <= set(by_name)
    parent = by_name["all"][-1].info.run_id
    for stage in ("prepare", "collect", "distill", "calibrate", "eval"):
        child = [r for r in by_name[stage] if r.data.tags.get("mlflow.parentRunId") == parent]
        assert child, f"{stage} is not nested under the stage=all run"
        assert child[0].data.metrics, f"{stage} logged no metrics"
        assert child[0].data.tags.get("git_commit")
    eval_run = [r for r in by_name["eval"] if r.data.tags.get("mlflow.parentRunId") == parent][0]
    assert any(k.startswith("overall") or "acceptance" in k for k in eval_run.data.metrics)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_dvc_repro_follows_the_params_file_of_a_preset(tmp_path, real_target_path):
    """`stage=params` with a preset writes params.yaml; `dvc repro` runs from it once, then is a no-op; a param
    of that preset swept with `dvc exp run -S` reruns the stages that read it and only those."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    written = _pipeline("stage=params", "experiment=quick", "tracking.enabled=false", *_shared_model_cache(), cwd=clone)
    assert written.returncode == 0, written.stderr[-2000:]
    assert "experiment=quick" in (clone / "params.yaml").read_text().splitlines()[0]
    dvc = [sys.executable, "-m", "dvc"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DVC_NO_ANALYTICS": "1"}

    def run(*args, timeout=1500):
        return subprocess.run([*dvc, *args], cwd=clone, env=env, capture_output=True, text=True, timeout=timeout)

    first = run("repro")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert _ran(first.stdout) == ["prepare", "collect", "distill", "calibrate", "eval"]
    assert (clone / "artifacts/eval/metrics.json").exists()
    second = run("repro")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Running stage" not in second.stdout, "second dvc repro reran: " + ", ".join(_ran(second.stdout))
    assert "up to date" in run("status", timeout=300).stdout.lower()
    # the quick preset's own distill budget, swept as an experiment: distill, calibrate and eval rerun, nothing else
    exp = run("exp", "run", "-S", "distill.trainer.max_steps=4")
    assert exp.returncode == 0, (exp.stdout + exp.stderr)[-3000:]
    assert _ran(exp.stdout) == ["distill", "calibrate", "eval"], exp.stdout[-2000:]
    # a calibration setting: calibrate and eval rerun, training does not
    exp = run("exp", "run", "-S", "calibrate.speculate_margin=0.1")
    assert exp.returncode == 0, (exp.stdout + exp.stderr)[-3000:]
    assert _ran(exp.stdout) == ["calibrate", "eval"], exp.stdout[-2000:]
    # a collect param of the preset: only collect reads it (its outputs then flow downstream)
    params = clone / "params.yaml"
    # (collect's own key, two spaces in: deadline.sized names eval.max_new_tokens earlier in the file)
    params.write_text(params.read_text().replace("\n  max_new_tokens: 32\n", "\n  max_new_tokens: 30\n", 1))
    status = run("status", timeout=300).stdout
    assert re.findall(r"^(\w+):", status, re.M) == ["collect"], status


def _ran(dvc_stdout: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", dvc_stdout)


def test_calibrate_calibrates_the_export_for_llama_cpp_with_off_as_an_answer(quick_run):
    """calibrate.engines=[llamacpp] on the quick run's data: llama-bench prices the engine's passes,
    every domain gets a llama-server setting or "off", and the export ships the draft as GGUF."""
    artifacts, _, resumed = quick_run
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = _pipeline("experiment=quick", f"paths.artifacts={artifacts}", *_shared_model_cache(),
                    f"paths.engines={REPO / 'artifacts/engines'}", "stage=calibrate", "calibrate.engines=[llamacpp]")
    assert out.returncode == 0, out.stderr[-3000:]
    spec = read_spec(artifacts / "draft")
    llama = spec["engines"]["llamacpp"]
    assert (artifacts / "draft" / llama["draft_gguf"]).stat().st_size > 0 and llama["quant"] == "Q4_1"
    assert set(llama["by_domain"]) == set(spec["recipes"]) and llama["cost"]["c"] > 0
    for domain, entry in llama["by_domain"].items():
        assert entry["predicted_speedup"] == (entry["predicted_speedup_if_on"] if entry["speculate"] else 1.0)
        assert (entry["predicted_speedup_if_on"] > 1.05) == entry["speculate"]  # the 5% margin of conf/distill
        assert ("-md" in llama["flags"][domain]) == entry["speculate"] and entry["rule"] == "greedy"
        assert unknown_keys("llamacpp", llama["flags"][domain]) == []  # flags of the pinned llama-server only
        for key, n_max in (("predicted_per_pass", entry["n_max"]), ("predicted_per_pass_server_defaults", 3)):
            proposed, accepted = entry[key]["proposed"], entry[key]["accepted"]  # per position, for eval's table
            assert len(proposed) == len(accepted) == n_max and all(0 <= a <= p <= 1 for a, p in zip(accepted, proposed))
            assert accepted == sorted(accepted, reverse=True) and proposed == sorted(proposed, reverse=True)
    assert llama["rules"]["greedy"]["verification"] == "strict"
    weights = llama["weights"]  # keep_best again under llama.cpp's greedy drafting, where training ran and was kept
    if spec["selected"] == "distilled":
        alpha, ci = weights["acceptance_calibration"], weights["ci95"]  # the default rule: an interval above 0 ships
        assert weights["rule"] == "interval" and abs(weights["difference"] - (alpha["distilled"] - alpha["init"])) < 2e-4
        assert weights["selected"] == ("distilled" if ci[0] > 0 else "init")
        assert "- weights:" in (artifacts / "draft" / "README.md").read_text()
    else:
        assert weights == {"selected": "init"}
