"""vLLM, SGLang and TensorRT-LLM as serving engines: distill's calibration for each under the rules it can run
(pipeline/engines/rules.py) written into speculative.json, every exported config checked against the engine's own
config fields (pipeline/engines/fields.json), the eval.engine=vllm plan built from it, and one-line errors where vLLM
or CUDA is missing. The engine run itself needs CUDA and vllm (skipped elsewhere, with why)."""
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
    run_distill_stage(setup, cheap, "calibrate.engines=[hf,vllm,sglang,trtllm]", "calibrate.gpu.c=0.01",
                      "calibrate.batch_sizes=[1,2]", "calibrate.hf.prompts=2",
                      "calibrate.hf.max_new_tokens=8", "calibrate.hf.gammas=[1,2]")
    run_distill_stage(setup, dear, "calibrate.engines=[vllm]", "calibrate.gpu.c=1.5")
    return (read_spec(cheap / "draft"), cheap / "draft",
            read_spec(dear / "draft"))


def test_each_gpu_engine_serves_each_domain_under_the_rule_and_k_it_was_planned_for(gpu_calibrated):
    from pipeline.engines.rules import RULES, VERSIONS

    spec, export, _ = gpu_calibrated
    engines = spec["engines"]
    assert engines["sglang"]["cost"]["c"] == 0.01 and "given" in engines["vllm"]["cost"]["source"]
    assert list(engines["sglang"]["rules"]) == ["greedy"] and set(engines["vllm"]["rules"]) == {"greedy", "tau"}  # T = 1
    for name in ("vllm", "sglang", "trtllm"):
        entry = engines[name]
        assert entry["version"] == VERSIONS[name]
        for domain, e in entry["by_domain"].items():
            k, rule = e["num_speculative_tokens"], e["rule"]
            assert k in (1, 2, 3, 4, 5, 6, 8) and rule in entry["rules"] and 0.0 <= e["predicted_acceptance"] <= 1.0
            config = entry["args" if name == "sglang" else "speculative_config"][domain]
            if not e["speculate"]:
                assert config in (None, [])
            elif name == "sglang":
                assert config[config.index("--speculative-num-steps") + 1] == str(k)
                assert config[config.index("--speculative-num-draft-tokens") + 1] == str(k + 1)
                assert config[config.index("--speculative-accept-threshold-acc") + 1] == "1"
            else:
                length = "num_speculative_tokens" if name == "vllm" else "max_draft_len"
                assert config[length] == k and all(config[key] == value for key, value in RULES[name][rule].items())
    # at c = 0.01 a draft that agrees with the target at all pays somewhere; the card says what runs where and how
    assert all(any(e["speculate"] for e in engines[name]["by_domain"].values()) for name in ("vllm", "trtllm"))
    card = (export / "README.md").read_text()
    assert "In **trtllm**" in card and "rule greedy: the draft proposes its argmax" in card
    assert "What each engine's config can express" in card and "num_speculative_tokens_per_batch_size" in card


def test_every_exported_gpu_config_passes_its_engines_field_check_and_a_renamed_key_fails(gpu_calibrated):
    from pipeline.engines.rules import unknown_keys

    engines, checked = gpu_calibrated[0]["engines"], 0
    for name, key in (("vllm", "speculative_config"), ("sglang", "args"), ("trtllm", "speculative_config")):
        for config in engines[name][key].values():
            if config:
                assert unknown_keys(name, config) == [], (name, config)
                checked += 1
    vllm = next(c for c in engines["vllm"]["speculative_config"].values() if c)
    assert "num_speculative_tokens_per_batch_size" in vllm  # batch_sizes given: vLLM gets its schedule
    assert unknown_keys("vllm", {**vllm, "num_speculative_token": 1}) == ["num_speculative_token"]
    trtllm = next(c for c in engines["trtllm"]["speculative_config"].values() if c)
    assert unknown_keys("trtllm", {**trtllm, "draft_length_schedule": {}}) == ["draft_length_schedule"]
    assert checked >= 3


def test_hf_is_planned_under_its_one_rule_with_fields_of_the_installed_transformers(gpu_calibrated):
    from transformers import GenerationConfig  # HF's config code, live: its own fields

    entry = gpu_calibrated[0]["engines"]["hf"]
    assert all(set(c) <= set(GenerationConfig().to_dict()) for c in entry["generation_config"].values() if c)
    assert list(entry["rules"]) == ["tau"] and entry["rules"]["tau"]["draft_temperature"] == 1.0  # T = 1 here
    assert {e["rule"] for e in entry["by_domain"].values()} == {"tau"} and entry["version"].startswith("transformers")


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
    from pipeline.decoding.spec import Recipe, SpeculativeSpec

    tuned, init = tmp_path / "draft", tmp_path / "draft_init"
    tuned.mkdir(), init.mkdir()
    spec = SpeculativeSpec(target={"path": "t"}, sampling=Sampling(0.0), draft={},
                           recipes={"code": Recipe(gamma=2), "default": Recipe(gamma=3)}, engines={"vllm": {"speculative_config": {
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
    SpeculativeSpec(target={"path": "t"}, sampling=Sampling(0.0), draft={},
                    recipes={"code": Recipe(gamma=2), "default": Recipe(gamma=3)}).write(tuned)
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
