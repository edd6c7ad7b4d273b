"""vLLM and SGLang as serving engines: distill's calibration for their drafting rule (greedy draft, fixed k,
acceptance p_T(argmax q)) written into speculative.json, the eval.engine=vllm plan built from it, and one-line
errors where vLLM or CUDA is missing. The engine run itself needs CUDA and vllm (skipped elsewhere, with why)."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.conftest import read_spec, REPO, run_distill_stage, tiny_llama


def test_weights_read_per_step_count_a_tied_head_once_and_skip_an_untied_input_embedding():
    from distill.engines import weights_read_per_step

    tied = tiny_llama(vocab_size=32, hidden_size=16, layers=1, tie=True)
    untied = tiny_llama(vocab_size=32, hidden_size=16, layers=1, tie=False)
    every = sum(p.numel() for p in untied.parameters())
    assert weights_read_per_step(untied) == every - 32 * 16
    assert weights_read_per_step(tied) == sum(p.numel() for p in tied.parameters()) == every - 32 * 16


@pytest.fixture(scope="module")
def gpu_calibrated(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    cheap, dear = out / "cheap", out / "dear"
    run_distill_stage(setup, cheap, "distill.calibration.engines=[vllm,sglang]", "distill.calibration.gpu.c=0.01")
    run_distill_stage(setup, dear, "distill.calibration.engines=[vllm]", "distill.calibration.gpu.c=1.5")
    return (read_spec(cheap / "draft"), cheap / "draft",
            read_spec(dear / "draft"))


def test_vllm_and_sglang_settings_follow_one_per_domain_table(gpu_calibrated):
    spec, export, _ = gpu_calibrated
    vllm, sglang = spec["engines"]["vllm"], spec["engines"]["sglang"]
    assert vllm["by_domain"] == sglang["by_domain"] and vllm["cost"]["c"] == 0.01
    assert "given" in vllm["cost"]["source"]
    for domain, entry in vllm["by_domain"].items():
        k = entry["num_speculative_tokens"]
        assert k in (1, 2, 3, 4, 5, 6, 8) and 0.0 <= entry["predicted_acceptance"] <= 1.0
        config, args = vllm["speculative_config"][domain], sglang["args"][domain]
        if entry["speculate"]:
            assert config == {"model": ".", "method": "draft_model", "num_speculative_tokens": k}
            assert args[args.index("--speculative-num-steps") + 1] == str(k)
            assert args[args.index("--speculative-num-draft-tokens") + 1] == str(k + 1)
        else:
            assert config is None and args == []
    # at c = 0.01 a draft that agrees with the target at all pays somewhere; the card says what runs where
    assert any(e["speculate"] for e in vllm["by_domain"].values())
    card = (export / "README.md").read_text()
    assert "In **vllm**" in card and "num_speculative_tokens" in card


def test_a_draft_costing_more_than_a_target_step_is_off_in_vllm_everywhere(gpu_calibrated):
    cheap, _, dear = gpu_calibrated
    table = dear["engines"]["vllm"]["by_domain"]
    assert not any(e["speculate"] for e in table.values())
    assert all(c is None for c in dear["engines"]["vllm"]["speculative_config"].values())
    assert "sglang" not in dear["engines"]
    # the same held-out acceptance priced at another c: the if-on prediction falls with the cost
    for domain, entry in table.items():
        same_k = cheap["engines"]["vllm"]["by_domain"][domain]
        assert entry["predicted_speedup_if_on"] < same_k["predicted_speedup_if_on"]


def test_vllm_plan_routes_each_domain_as_calibrated_and_falls_back_to_the_decoders_gamma(tmp_path):
    from eval.engine_vllm import engine_plan
    from pipeline.sampling import Sampling
    from pipeline.spec import SpeculativeSpec

    tuned, init = tmp_path / "draft", tmp_path / "draft_init"
    tuned.mkdir(), init.mkdir()
    spec = SpeculativeSpec(target={"path": "t"}, sampling=Sampling(0.0), draft={}, gamma={"code": 2, "default": 3},
                           engines={"vllm": {"speculative_config": {
                               "code": {"model": ".", "method": "draft_model", "num_speculative_tokens": 4},
                               "chat": None, "default": {"model": ".", "method": "draft_model",
                                                         "num_speculative_tokens": 1}}}})
    spec.write(tuned)
    plan = engine_plan({"speculative": tuned, "speculative_init": init}, ["code", "chat", "math"], 5)
    assert plan["autoregressive"] == {"code": None, "chat": None, "math": None}
    assert plan["speculative"]["chat"] is None  # calibrated off: the plain engine answers
    assert json.loads(plan["speculative"]["code"]) == {"model": str(tuned), "method": "draft_model",
                                                       "num_speculative_tokens": 4}
    assert json.loads(plan["speculative"]["math"])["num_speculative_tokens"] == 1  # the default entry
    assert json.loads(plan["speculative_init"]["code"])["model"] == str(init)
    SpeculativeSpec(target={"path": "t"}, sampling=Sampling(0.0), draft={}, gamma={"code": 2, "default": 3}).write(tuned)
    fallback = engine_plan({"speculative": tuned}, ["code", "chat"], 5)  # no vLLM calibration: the decoder's γ
    assert [json.loads(fallback["speculative"][d])["num_speculative_tokens"] for d in ("code", "chat")] == [2, 3]


def test_eval_engine_vllm_without_vllm_is_one_line_and_exit_2(tmp_path):
    import os
    import subprocess

    shadow = tmp_path / "shadow" / "vllm"  # an importable `vllm` that fails as a missing one does, installed or not
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named vllm')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "pipeline", "stage=eval", "eval.engine=vllm",
                           f"paths.artifacts={tmp_path / 'artifacts'}", "tracking.enabled=false"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pip install vllm" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "artifacts" / "eval").exists()


CUDA_VLLM = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not CUDA_VLLM, reason="eval.engine=vllm runs vLLM's engine, which needs CUDA and `pip install vllm`")
def test_vllm_engine_greedy_speculative_equals_plain_on_the_embedded_pair(tmp_path, real_target_path):
    from eval.stage import run
    from hydra import compose, initialize_config_dir

    from tests.conftest import RecordingTracker

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.eval={tmp_path / 'eval'}", "tracking.enabled=false",
                                           "eval.engine=vllm", "eval.temperature=0", "eval.max_prompts_per_domain=2",
                                           "eval.draft=derive", "eval.draft_init=none"])
    run(cfg, RecordingTracker())
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["overall"]["speculative"]["greedy_match"] >= 0.9  # bf16 near-ties aside
    assert metrics["overall"]["speculative"]["n_drafted"] > 0
