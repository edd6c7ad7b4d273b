"""`python -m pipeline.tools gpu-check` in its CPU mode, end to end on the distill tests' tiny target: collect, a few
distill steps, the export, our decoder's and HF assisted generation's greedy exactness and the speed figures, without
MLflow, DVC or GGUF; and a decoder that returns one wrong token fails the exactness check (exit 1), in fp32 and bf16."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def gpu_check_args(setup, tmp_path, dtype: str = "float32") -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": ("chat", "code")[i % 2],
                                           "turns": [f"w{i} w{i + 1} w{2 * i} w{i + 7}"]}) + "\n" for i in range(4)))
    return ["gpu-check", f"tool.target={setup['target']}", f"tool.prompts={prompts}", "tool.n_prompts=4",
            "tool.collect_tokens=12", "tool.distill_steps=2", "tool.max_new_tokens=16", "tool.repeats=1",
            f"tool.out={tmp_path / 'gpu_check.json'}", "tool.device=cpu", f"runtime.dtype={dtype}",
            "model.draft.derive.layers=[0]", "model.draft.vocab_subset=0", f"paths.artifacts={tmp_path}"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_mode_runs_every_check_and_imports_neither_mlflow_nor_dvc(setup, tmp_path, dtype):
    args = gpu_check_args(setup, tmp_path, dtype) + ["tool.random_weights=true", "runtime.threads=1"]
    code = ("import sys; from pipeline.tools.__main__ import main; rc = main(sys.argv[1:]); "
            "print('imported:', sorted({'mlflow', 'dvc', 'gguf'} & set(sys.modules))); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported: []" in done.stdout and "exactness decoder     PASS" in done.stdout
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["passed"] and result["device"] == "cpu" and result["dtype"] == dtype and result["random_weights"]
    assert result["collect"]["rows"] == 4 and result["collect"]["tokens"] > 0
    assert result["distill"]["steps"] == 2 and result["distill"]["train_tokens"] > 0
    for check in result["exactness"].values():
        if dtype == "float32":  # identical, token for token
            assert check == {"prompts": 4, "identical": 4, "mismatches": [], "passed": True}
        else:  # random weights tie often: every difference at a near-tie, and gone in fp32
            assert all(m["near_tie"] for m in check["mismatches"]) and not check.get("fp32_persisting")
    speed = result["speed"]
    assert speed["requests"] == 4 and speed["plain_tokens_per_s"] > 0 and speed["speedup_ci95"] is not None
    assert 1.0 <= speed["mean_accepted_length"] <= 5.0  # at most γ + 1 = 5 tokens per pass


@pytest.mark.parametrize("dtype, broken", [("float32", "ours_speculative"), ("bfloat16", "ours_speculative"),
                                           ("float32", "hf_assisted")])
def test_a_decoder_returning_one_wrong_token_fails_the_exactness_check(setup, tmp_path, monkeypatch, dtype, broken):
    from pipeline.tools import gpu_check
    from pipeline.tools.__main__ import main

    honest = getattr(gpu_check, broken)

    def wrong(m, ids, n):
        tokens, stats = honest(m, ids, n)
        return tokens[:-1] + [(tokens[-1] + 1) % m.target.config.vocab_size], stats

    monkeypatch.setattr(gpu_check, broken, wrong)
    assert main(gpu_check_args(setup, tmp_path, dtype)) == 1
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    check = result["exactness"]["decoder" if broken == "ours_speculative" else "hf_assisted"]
    assert not result["passed"] and not check["passed"] and check["identical"] == 0
    if dtype == "bfloat16":  # rounding cannot explain it: the wrong token stays wrong in fp32
        assert check["fp32_persisting"] == [0, 1, 2, 3]


def test_a_run_killed_midway_leaves_the_phases_it_finished(setup, tmp_path, monkeypatch):
    """A device's time limit can end the run (a first H200 run ran past 200 s): each finished phase is on disk with
    its time, and the result says it did not pass or fail."""
    from pipeline.tools import gpu_check
    from pipeline.tools.__main__ import main

    def killed(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check, "speed", killed)
    with pytest.raises(KeyboardInterrupt):
        main(gpu_check_args(setup, tmp_path))
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["passed"] is None and "speed" not in result
    assert set(result["phase_seconds"]) == {"collect", "distill", "exactness decoder", "exactness hf_assisted"}
    assert result["collect"]["rows"] == 4 and result["exactness"]["decoder"]["passed"]
