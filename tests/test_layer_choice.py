"""`pipeline.tools layer-choice`: the layers a shallow draft keeps, found by held-out acceptance. A target whose
layers 0 and 2 are planted as identities (their attention and MLP outputs zeroed) is exactly the model of layers
[1, 3]: the search must find that subset (acceptance 1) where the first two layers, the configured baseline, fall
short; a search that ignored the measurement would not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.errors import PipelineError
from pipeline.tools.__main__ import run
from tests.conftest import peaked_target, tiny_tokenizer, write_collect_output


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("layer_choice")
    target = peaked_target(seed=3)
    with torch.no_grad():
        for i in (0, 2):  # a residual layer with zero outputs passes its input through unchanged
            target.model.layers[i].self_attn.o_proj.weight.zero_()
            target.model.layers[i].mlp.down_proj.weight.zero_()
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    return {"target": root / "target", "collect": write_collect_output(target, root / "collect")}


def layer_choice(planted, tmp_path, *extra: str) -> dict:
    return run(["layer-choice", f"paths.artifacts={tmp_path}", f"model.target.path={planted['target']}",
                f"paths.collect={planted['collect']}", "runtime.device=cpu", "runtime.dtype=float32",
                "model.draft.derive.layers=[0,1]", "model.draft.vocab_subset=0", "distill.split.heldout_fraction=0.5",
                *extra])


def test_the_search_finds_the_layers_that_make_the_target(planted, tmp_path):
    result = layer_choice(planted, tmp_path, f"tool.json={tmp_path / 'choice.json'}")
    assert result["chosen"] == [1, 3] and result["baseline"] == [0, 1]
    assert result["path"][-1]["acceptance"] == pytest.approx(1.0, abs=1e-4)
    overall = result["reporting"]["overall"]
    chosen, baseline = "chosen", "baseline"
    assert overall["acceptance"][chosen] == pytest.approx(1.0, abs=1e-4)
    assert overall["acceptance"][baseline] < 0.9
    delta, (lo, _) = overall["difference"][chosen]
    assert delta > 0 and lo > 0  # the reporting rows, which did not choose, confirm it
    assert json.loads((tmp_path / "choice.json").read_text())["set_it"] == "model.draft.derive.layers=[1, 3]"


def test_keeping_most_layers_searches_downwards_and_drops_the_identities(planted, tmp_path):
    result = layer_choice(planted, tmp_path, "tool.keep=3")
    assert [step["layers"] for step in result["path"]][0] in ([1, 2, 3], [0, 1, 3])  # one identity dropped first
    assert 1 in result["chosen"] and 3 in result["chosen"]
    assert result["path"][-1]["acceptance"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("extra, message", [
    (["tool.keep=4"], r"tool\.keep=4 must be between 1 and 3 for a 4-layer source"),
    (["tool.source=teacher"], r"tool\.source='teacher': use target or draft"),
    (["tool.source=draft"], r"tool\.source=draft prunes a pretrained draft"),
])
def test_bad_settings_are_one_line(planted, tmp_path, extra, message):
    with pytest.raises(PipelineError, match=message) as e:
        layer_choice(planted, tmp_path, *extra)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("subset", [0, 48])  # 48 of 96 ids: the draft trains and is judged through distill's FR-Spec head
def test_steps_judge_each_subset_after_training_it_by_distills_recipe(planted, tmp_path, monkeypatch, subset):
    """tool.steps: every subset trains that many steps (counted here) before it is judged; the planted subset is
    still found, and the result says how it was judged."""
    from distill.trainer import DistillTrainer

    trained = []
    real_train = DistillTrainer.train
    monkeypatch.setattr(DistillTrainer, "train", lambda self, *a, **k: (trained.append(self.args.max_steps),
                                                                         real_train(self, *a, **k))[1])
    result = layer_choice(planted, tmp_path, "tool.steps=2", "distill.trainer.per_device_train_batch_size=4",
                          "distill.trainer.learning_rate=1e-4", f"model.draft.vocab_subset={subset}")
    assert result["chosen"] == [1, 3] and result["steps"] == 2
    assert trained == [2] * (4 + 3 + 2)  # 4 single layers, 3 pairs with the best, then baseline and choice reported
    delta, (lo, _) = result["reporting"]["overall"]["difference"]["chosen"]
    assert delta > 0 and lo > 0
    # two small steps barely move the exact subset (a draft trained without the FR-Spec head it is judged through
    # would not keep this)
    assert result["reporting"]["overall"]["acceptance"]["chosen"] > 0.8


def test_negative_steps_are_refused(planted, tmp_path):
    with pytest.raises(PipelineError, match=r"tool\.steps=-1 must be ≥ 0"):
        layer_choice(planted, tmp_path, "tool.steps=-1")


def test_the_block_search_judges_each_contiguous_block_dropped(planted, tmp_path):
    """tool.search=block: keep + 1 subsets, each without one contiguous block; one identity layer (0 or 2) dropped
    is the target exactly, and the best candidate is the choice."""
    result = layer_choice(planted, tmp_path, "tool.keep=3", "tool.search=block")
    assert sorted(step["layers"] for step in result["path"]) == [[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]]
    assert result["chosen"] in ([0, 1, 3], [1, 2, 3])  # either identity dropped: the target exactly
    assert result["path"][-1]["acceptance"] == pytest.approx(1.0, abs=1e-4)
    assert max(step["acceptance"] for step in result["path"][:-1]) <= result["path"][-1]["acceptance"]
    assert min(step["acceptance"] for step in result["path"]) < 0.9  # the candidates differ: the measurement chose


def test_an_unknown_search_is_one_line(planted, tmp_path):
    with pytest.raises(PipelineError, match=r"tool\.search='beam': use greedy or block"):
        layer_choice(planted, tmp_path, "tool.search=beam")
