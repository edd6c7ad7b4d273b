"""The cost profile (pipeline/measure/cost_profile.py) and its tool (`python -m pipeline.tools cost-profile`) on tiny random models.
Wall-clock values are only checked for positivity and the monotone fit, never for size."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline.measure import cost_profile as cp
from pipeline.errors import PipelineError
from tests.conftest import REPO, tiny_llama

FAST = {"tokens_fed": (1, 2, 4, 8), "contexts": (8, 24), "draft_context": 8, "repeats": 2, "warmup": 0}


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(layers=2, seed=0), tiny_llama(layers=1, seed=1)


@pytest.fixture(scope="module")
def profile(pair):
    return cp.measure_cost_profile(*pair, torch.arange(16), cp.CostPlan(**FAST))


def test_profile_has_every_count_and_context_with_positive_times(profile):
    assert set(profile["target"]) == {"8", "24"}
    for table in profile["target"].values():
        assert set(table) == {"1", "2", "4", "8"}
        for entry in table.values():
            assert 0 < entry["p25"] <= entry["ms"] <= entry["p75"]
    assert profile["draft"]["ms"] > 0 and profile["draft"]["context"] == 8
    assert profile["shapes"]["draft"]["head_rows"] == 16 and profile["shapes"]["target"]["head_rows"] == 32
    assert profile["machine"]["device"] == "cpu" and profile["machine"]["torch_threads"] >= 1


def test_derived_costs_are_positive_and_monotone(profile):
    assert cp.c(profile) > 0
    ratios = [cp.verify_ratio(profile, g) for g in range(0, 12)]
    assert ratios[0] == 1.0 and min(ratios) >= 1.0
    assert all(a <= b for a, b in zip(ratios, ratios[1:]))
    cost = cp.summary(profile, 4)
    assert set(cost) == {"c", "verify_ratio", "tree_verify_ratio", "canary_ratio", "draft_forward_ms",
                         "target_forward_ms"}
    assert list(cost["verify_ratio"]) == [1, 2, 3, 4] == list(cost["tree_verify_ratio"])
    assert set(profile["tree_target"]) == set(profile["target"])  # tree verifies timed at the same points


def test_a_profile_times_the_decoders_own_passes_and_prices_their_host_work(pair):
    from pipeline.decoding.cost import pass_speedup
    from pipeline.sampling import Sampling

    profile = cp.measure_cost_profile(*pair, torch.arange(16), cp.CostPlan(**FAST), host_sampling=Sampling(0.7))
    host = profile["host"]
    assert host["sampling"]["temperature"] == 0.7 and host["step_ms"] > 0
    assert set(host["chain"]) == {"1", "4"} and set(host["tree"]) == {"3", "6"}
    assert all(h >= 0 for h in [host["plain"], *host["chain"].values(), *host["tree"].values()])
    # a speculative pass does more host work than a plain one (a draft distribution, a residual, two crops)
    assert min(host["chain"].values()) > host["plain"]
    cost = cp.summary(profile, 4)
    assert cost["host"]["chain"] == host["chain"] and profile["canary"]["start_ms"] > 0
    h0, h1 = host["plain"], host["chain"]["1"]
    expected = 1.5 * (1 + h0) / (cost["c"] + cost["verify_ratio"][1] + h1)  # both sides pay their host work
    assert pass_speedup(0.5, 1, 1, cost) == pytest.approx(expected)
    assert pass_speedup(0.0, 0, 0, cost) == pytest.approx(1.0)  # a pass of no drafts is a plain pass


def test_host_work_is_relative_to_the_plain_pass_and_interpolated():
    from pipeline.decoding.cost import host_cost, pass_speedup

    host = {"plain": 0.1, "chain": {"1": 0.3, "4": 0.6}, "tree": {"3": 0.5, "6": 1.1}}
    assert host_cost(host, 2) == (0.1, pytest.approx(0.4)) and host_cost(host, 6) == (0.1, pytest.approx(0.8))
    assert host_cost(host, 4.5, tree=True) == (0.1, pytest.approx(0.8)) and host_cost(None, 3) == (0.0, 0.0)
    cost = {"c": 0.1, "verify_ratio": {1: 1.2}, "host": host}
    # (1 + A)(1 + h_0) / (γc + r + h(γ)): both sides pay their host work
    assert pass_speedup(0.5, 1, 1, cost) == pytest.approx(1.5 * 1.1 / (0.1 + 1.2 + 0.3))


def test_the_canary_flags_a_profile_measured_under_changing_load():
    assert cp.canary_warning({"canary": {"ratio": 1.02}}) is None and cp.canary_warning({}) is None
    assert "changing load" in cp.canary_warning({"canary": {"ratio": 1.4}})


def test_a_tree_is_priced_by_the_tree_verifies_that_were_timed():
    from pipeline.decoding.cost import pass_speedup

    cost = {"c": 0.1, "verify_ratio": {3: 1.2}, "tree_verify_ratio": {3: 1.6}}
    chain, tree = pass_speedup(1.0, 3, 3, cost), pass_speedup(1.0, 3, 3, cost, tree=True)
    assert chain == pytest.approx(2 / (0.3 + 1.2)) and tree == pytest.approx(2 / (0.3 + 1.6))
    del cost["tree_verify_ratio"]  # an older profile without tree timings: the chain's price
    assert pass_speedup(1.0, 3, 3, cost, tree=True) == chain


def _synthetic(ratios: dict[int, float]) -> dict:
    entry = lambda r: {"ms": 10.0 * r, "p25": 10.0 * r, "p75": 10.0 * r, "ratio": r}  # noqa: E731
    return {"settings": {"contexts": [64]}, "target": {"64": {str(k): entry(r) for k, r in ratios.items()}},
            "draft": {"ms": 2.0}}


def test_verify_ratio_pools_dips_and_interpolates():
    p = _synthetic({1: 1.0, 2: 1.6, 4: 1.2, 8: 2.4})  # the dip at 4 tokens is noise: pooled with 2 tokens
    assert cp.verify_ratio(p, 1) == pytest.approx(1.4)  # 2 tokens
    assert cp.verify_ratio(p, 3) == pytest.approx(1.4)  # 4 tokens
    assert cp.verify_ratio(p, 5) == pytest.approx(1.4 + 1.0 * 2 / 4)  # 6 tokens, halfway from 4 to 8
    assert cp.verify_ratio(p, 11) == pytest.approx(2.4 + 0.25 * 4)  # beyond: along the last segment
    assert cp.c(p) == pytest.approx(0.2)
    assert cp.verify_ratio(_synthetic({1: 1.0, 2: 0.8}), 1) == 1.0  # never below 1


def test_write_read_round_trip(profile, pair, tmp_path):
    path = cp.write_profile(tmp_path / "sub" / cp.FILENAME, profile)
    assert cp.read_profile(path, *pair, vocab_rows=16) == json.loads(json.dumps(profile))
    assert not list(path.parent.glob(".*tmp*"))  # written atomically, nothing left behind


@pytest.mark.parametrize("role", ["target", "draft"])
def test_mismatched_shapes_raise_one_line(profile, pair, tmp_path, role):
    path = cp.write_profile(tmp_path / cp.FILENAME, profile)
    models = dict(zip(("target", "draft"), pair), vocab_rows=16)
    models[role] = tiny_llama(hidden_size=64)
    with pytest.raises(PipelineError) as e:
        cp.read_profile(path, **models)
    message = str(e.value)
    assert "\n" not in message and "hidden_size 32" in message and f"the {role} has 64" in message
    assert "python -m pipeline.tools cost-profile" in message


def test_other_head_rows_or_version_or_garbage_are_refused(profile, pair, tmp_path):
    path = cp.write_profile(tmp_path / cp.FILENAME, profile)
    with pytest.raises(PipelineError, match="head_rows 16, the draft has 32"):
        cp.read_profile(path, *pair)  # measured with a 16-row subset head, served with the full head
    path.write_text(json.dumps({**profile, "version": cp.VERSION + 1}))
    with pytest.raises(PipelineError, match=f"version {cp.VERSION + 1}"):
        cp.read_profile(path)
    path.write_text(json.dumps({**profile, "draft": {}}))
    with pytest.raises(PipelineError, match="incomplete"):
        cp.read_profile(path)
    path.write_text("{not json")
    with pytest.raises(PipelineError, match="cannot read"):
        cp.read_profile(path)


def _config_dir(tmp_path, name: str, layers: int):
    directory = tmp_path / name
    tiny_llama(layers=layers).config.save_pretrained(directory)
    return directory


def test_random_model_from_config_file_dir_and_preset(tmp_path):
    target_dir = _config_dir(tmp_path, "target", 3)
    assert cp.random_model(target_dir).config.num_hidden_layers == 3
    assert cp.random_model(target_dir / "config.json", "bf16").dtype == torch.bfloat16
    preset = tmp_path / "mine.yaml"
    preset.write_text(f"target: {{path: {target_dir}}}\ndraft: {{init: derive, derive: {{layers: [0, 2]}}}}\n")
    assert cp.model_config(preset).num_hidden_layers == 3
    draft = cp.model_config(f"{preset}:draft")
    assert (draft.num_hidden_layers, draft.hidden_size) == (2, 32)
    with pytest.raises(PipelineError, match="neither a config.json"):
        cp.model_config(tmp_path / "missing")


def _cli(*args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pipeline.tools", "cost-profile", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_measures_config_shapes_and_writes_a_valid_profile(tmp_path):
    target_dir, draft_dir = _config_dir(tmp_path, "target", 2), _config_dir(tmp_path, "draft", 1)
    out = tmp_path / "out" / cp.FILENAME
    done = _cli(f"tool.target_config={target_dir}", f"tool.draft_config={draft_dir / 'config.json'}",
                "tool.vocab_subset=8", "runtime.dtype=float32", "runtime.device=cpu", "runtime.threads=1",
                "tool.contexts=[8,16]", "tool.tokens_fed=[1,2,4]", "tool.repeats=2", "tool.warmup=0", f"tool.out={out}",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "c = " in done.stdout and "verify ratio" in done.stdout
    profile = cp.read_profile(out, cp.model_config(target_dir), cp.model_config(draft_dir), vocab_rows=8)
    assert profile["settings"]["contexts"] == [8, 16] and profile["machine"]["dtype"] == "float32"


def test_cli_bad_path_exits_2_with_one_line(tmp_path):
    done = _cli(f"tool.target_config={tmp_path / 'nowhere'}", f"tool.draft_config={tmp_path / 'nowhere'}", cwd=tmp_path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "nowhere" in done.stderr
