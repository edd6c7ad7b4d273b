"""A recipe that fits the draft brought (distill/training.py, distill/progress.py BestWeightsCallback): the
learning-rate probe trains a stub at the full rate and a draft equal to its target not at all, the stop rule ends a
run whose held-out acceptance keeps falling with its best weights (across a resume too), and the model card says
which rate was chosen and why. The tiny peaked target of conftest's `setup`; CPU; fixed seeds."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from pipeline.machine import release_freed_memory
from tests.conftest import read_spec, run_distill_stage as run_stage

EQUAL_DRAFT = "model.draft.derive.layers=[0,1,2,3]"  # every layer of the 4-layer tiny target, its head too
FIXED = ("distill.trainer.lr_probe=null", "distill.trainer.stop_patience=null")  # the stub's recipe: its rate, unprobed


# ---------------------------------------------------------------- the probe on whole stage runs
def test_a_draft_equal_to_its_target_keeps_its_heldout_acceptance_with_the_shipped_defaults(setup, tmp_path):
    """The shipped recipe (the default learning rate, a probe of three shares and the stop rule) leaves a draft equal
    to its target where it started: the probe finds no rate that beats the initial weights, so training takes no step,
    and the trained weights, not keep_best's fallback, keep held-out acceptance within 0.01."""
    result, _ = run_stage(setup, tmp_path, EQUAL_DRAFT)
    spec = read_spec(tmp_path / "draft")
    before, trained = spec["acceptance"]["before"]["overall"], spec["acceptance"]["after_training"]["overall"]
    assert before > 0.99, before  # the draft is the target
    assert abs(trained - before) <= 0.01 and abs(result["acceptance_after"] - before) <= 0.01, (before, trained)
    recipe = spec["training"]["recipe"]
    assert recipe["learning_rate"] == 0 and spec["training"]["steps"] == 0, recipe
    assert all(acceptance < recipe["probe"]["initial"] for name, acceptance in recipe["probe"].items()
               if name != "initial"), recipe  # every rate tried lost acceptance in its few steps
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "no training: no rate tried beat the initial weights" in card and "it was not trained" in card


def test_the_old_fixed_rate_wrecks_a_draft_equal_to_its_target(setup, tmp_path):
    """The deliberately wrong recipe (the stub's rate, unprobed, no stop rule: the default before the probe) drops the
    same draft's trained acceptance by far more than 0.01: the test above can fail. keep_best then ships the initial
    weights."""
    run_stage(setup, tmp_path, EQUAL_DRAFT, *FIXED)
    spec = read_spec(tmp_path / "draft")
    before, trained = spec["acceptance"]["before"]["overall"], spec["acceptance"]["after_training"]["overall"]
    assert before - trained > 0.01, (before, trained)
    assert spec["selected"] == "init" and spec["training"]["recipe"] == {"learning_rate": 3e-3}
    assert "keep_best" in (tmp_path / "draft" / "README.md").read_text()


def test_a_stub_draft_is_trained_at_the_largest_probed_rate_that_gains_and_gains(setup, tmp_path):
    """conftest's one-layer draft (the embedded default's kind): the probe tries the rates largest first and trains on
    at the first whose short run beats the initial weights (every larger one tried did not), the gain stays, and the
    card says which rate and why."""
    result, tracker = run_stage(setup, tmp_path)
    out = tmp_path
    recipe = read_spec(out / "draft")["training"]["recipe"]
    tried = [(float(name), acceptance) for name, acceptance in recipe["probe"].items() if name != "initial"]
    assert [rate for rate, _ in tried] == sorted((rate for rate, _ in tried), reverse=True), recipe
    assert tried[-1][0] == pytest.approx(recipe["learning_rate"]) and recipe["learning_rate"] > 0, recipe
    assert tried[-1][1] > recipe["probe"]["initial"] >= max([a for _, a in tried[:-1]], default=0), recipe
    assert tracker.metrics["train_learning_rate"] == recipe["learning_rate"]
    assert result["acceptance_after"] > result["acceptance_before"]
    card = (out / "draft" / "README.md").read_text()
    assert f"- learning rate: {recipe['learning_rate']:g}, the largest rate whose held-out acceptance" in card
    assert "- stop rule: " in card and "the distilled draft" in card
    verdict = read_spec(out / "draft")["training"]["keep_best"]  # shipped because the rows resolve the gain
    assert verdict["rule"] == "interval" and verdict["ci95"][0] > 0 and verdict["trained"] > verdict["initial"]
    assert "over the initial ones (interval rule)" in card


# ---------------------------------------------------------------- the stop rule
class Judge:
    """Held-out acceptance as a script: the i-th call returns scores[i]; records the weight seen."""

    def __init__(self, *scores: float):
        self.scores, self.calls = list(scores), 0

    def __call__(self, model) -> float:
        self.calls += 1
        return self.scores[self.calls - 1]


def step_to(model, value: float) -> None:
    """A training step that leaves every trained weight at `value` (so each step's weights are recognisable); frozen
    ones stay, as in training."""
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.fill_(value)


def run_steps(callback, model, steps: range, max_steps: int = 100, output_dir: str = "", saves=()):
    """Drives `callback` as Trainer would over `steps`; returns the step where it asked to stop (None: never)."""
    args = types.SimpleNamespace(device="cpu", output_dir=output_dir)
    for step in steps:
        step_to(model, float(step))
        state = types.SimpleNamespace(global_step=step, max_steps=max_steps)
        control = types.SimpleNamespace(should_training_stop=False)
        callback.on_step_end(args, state, control, model=model)
        if step in saves:
            callback.on_save(args, state, control)
        if control.should_training_stop:
            return step
    return None


def make_callback(judge, patience: int, progress=None, baseline: float = 0.45):
    from distill.progress import BestWeightsCallback, RunProgress

    return BestWeightsCallback(judge, 10, patience, baseline, progress or RunProgress(None), printer=lambda _: None)


@pytest.mark.parametrize("patience, stops_at", [(2, 30), (3, None)])
def test_training_stops_after_patience_evaluations_below_the_best_and_ends_with_the_best_weights(patience, stops_at):
    """Acceptance 0.5, 0.4, 0.3 at steps 10, 20, 30 over an initial 0.45: with patience 2 training stops at step 30
    and ends with step 10's weights; patience 3 (the wrong count for this data) does not stop there."""
    model = torch.nn.Linear(2, 2)
    callback = make_callback(Judge(0.5, 0.4, 0.3, 0.2), patience)
    assert run_steps(callback, model, range(1, 31)) == stops_at
    callback.on_train_end(types.SimpleNamespace(), types.SimpleNamespace(global_step=30), None, model=model)
    assert torch.all(model.weight == 10.0)  # the best weights evaluated: step 10's
    assert callback.state["kept_step"] == 10 and callback.state["stopped_at"] == stops_at


def test_a_run_that_never_beats_its_initial_weights_stops_after_patience_evaluations():
    """Below the initial weights' acceptance from the first evaluation: the initial weights count as the best."""
    callback = make_callback(Judge(0.4, 0.41, 0.42), 2, baseline=0.45)
    assert run_steps(callback, torch.nn.Linear(2, 2), range(1, 41)) == 20


def test_the_stop_rule_keeps_its_best_weights_across_a_resume(tmp_path):
    """A checkpoint saved after the best step holds the best weights (BEST_WEIGHTS) and the rule's counters; the
    resumed rule stops where the uninterrupted one would and puts the same weights back."""
    from distill.progress import BEST_WEIGHTS, PROGRESS_FILE, RunProgress

    model, progress = torch.nn.Linear(2, 2), RunProgress(None)
    callback = make_callback(Judge(0.5, 0.4), 2, progress)
    checkpoint = tmp_path / "checkpoint-20"
    checkpoint.mkdir()
    assert run_steps(callback, model, range(1, 21), output_dir=str(tmp_path), saves=(20,)) is None
    (checkpoint / PROGRESS_FILE).write_text(json.dumps(progress.record(20)))
    assert (checkpoint / BEST_WEIGHTS).exists()
    resumed = make_callback(Judge(0.3), 2, RunProgress(checkpoint), baseline=0.0)
    model = torch.nn.Linear(2, 2)
    assert run_steps(resumed, model, range(21, 31)) == 30
    resumed.on_train_end(types.SimpleNamespace(), types.SimpleNamespace(global_step=30), None, model=model)
    assert torch.all(model.weight == 10.0) and resumed.state["baseline"] == 0.45


def test_the_best_weights_copy_only_what_training_moves_and_put_back_restores_the_best_step():
    """A draft whose head is frozen (freeze_shared: a pretrained draft's embeddings and head): the stop rule's copy
    holds the trained weights alone, not the frozen ones (on the real pair 1.1 GB a copy), and putting it back gives
    the best step's trained weights with the frozen ones untouched. A copy naming a weight the model lacks is an
    error, not a silent skip (the wrong variant: load_state_dict(strict=False) alone would ignore it)."""
    from distill.progress import put_back

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].requires_grad_(False)
    frozen = model[1].weight.detach().clone()
    callback = make_callback(Judge(0.5, 0.4, 0.3), 2)
    assert run_steps(callback, model, range(1, 31)) == 30
    assert set(callback.weights) == {"0.weight", "0.bias"}
    callback.on_train_end(types.SimpleNamespace(), types.SimpleNamespace(global_step=30), None, model=model)
    assert torch.all(model[0].weight == 10.0) and torch.equal(model[1].weight, frozen)
    with pytest.raises(KeyError, match="2.weight"):
        put_back(model, {"2.weight": torch.zeros(2, 2)})


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or not release_freed_memory(),
                    reason="needs /proc and glibc's malloc_trim")
def test_the_heap_pages_training_freed_go_back_to_the_os():
    """Tensors of varying sizes, freed, stay in the process's RSS (glibc keeps them in its arenas once a freed large
    block has raised its mmap threshold: ≈ 3.7 GB of the real pair's training); release_freed_memory, which the stage
    runs when training ends (before keep_best and the export), hands them back. The wrong variant — no trim — keeps
    them: the first assertion is that variant, measured."""
    torch.empty(30 * 2**20 // 4)  # freeing a 30 MB block raises glibc's mmap threshold, as training's first steps do
    rng = torch.Generator().manual_seed(0)
    before = _rss_mb()
    held = []
    for size in torch.randint(100_000, 1_000_000, (400,), generator=rng).tolist():
        held.append((torch.ones(size), torch.ones(1000)))  # the small one stays, pinning the heap under the large
    small = [keep for _, keep in held]
    del held
    kept = _rss_mb() - before
    assert kept > 500, f"freed activations were returned without a trim ({kept:.0f} MB kept): nothing to test"
    release_freed_memory()
    assert _rss_mb() - before < kept / 4, f"{_rss_mb() - before:.0f} MB still held after the trim of {kept:.0f} MB"
    del small


def test_the_heap_is_trimmed_only_after_the_resident_set_outgrew_its_last_trim(monkeypatch):
    """HeapTrimCallback trims after the first step and then only once RSS exceeds its size after the last trim by the
    slack: a run whose heap does not grow pays no trim a step (20% of the real pair's training time), one whose freed
    heap grows (4 accumulated batches a step: ≈ 1 GB a step) is trimmed before it runs out. The wrong variants —
    trimming every step, or never after the first — give other trim steps."""
    import distill.progress as progress

    rss = iter([10, 10, 11, 11, 13, 10, 11, 12.5, 9])  # GB at each step's end, and after each trim
    trims = []
    monkeypatch.setattr(progress, "resident_bytes", lambda: next(rss) * 2**30)
    monkeypatch.setattr(progress, "release_freed_memory", lambda: trims.append(step))
    callback = progress.HeapTrimCallback(slack=2 * 2**30)
    for step in range(1, 7):
        callback.on_step_end(None, None, None)
    # step 1 trims (floor 10); steps 2, 3 at 11 stay; step 4 at 13 > 12 trims (floor 10); step 5 at 11 stays;
    # step 6 at 12.5 > 12 trims (floor 9)
    assert trims == [1, 4, 6]
