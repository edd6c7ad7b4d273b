"""The distill stage's checkpoints: a crashed run resumes from its last checkpoint (learning curve, token count
and time budget continue), a resume with the time or step budget spent trains no further step, and the
checkpoint's fingerprint (its name) across config knobs added later and on-policy continuation lengths."""
from __future__ import annotations

import copy
import json
import time
import types
from pathlib import Path

import pytest
import torch

from tests.conftest import SHIPPED, read_spec, run_distill_stage as run_stage


# ---------------------------------------------------------------- resume
def crash_at_step_30(setup, out: Path, monkeypatch, *overrides: str):
    """Runs the stage until the loss computation of its step 31 raises, as a Ctrl-C would (checkpoint-20 is on disk);
    returns the real compute_loss to put back."""
    from distill.trainer import DistillTrainer

    compute = DistillTrainer.compute_loss

    def crashing(self, *args, **kwargs):
        if self.state.global_step >= 30:  # in step 31 (the learning-rate probe's short runs never get there)
            raise KeyboardInterrupt("simulated crash")
        return compute(self, *args, **kwargs)

    monkeypatch.setattr(DistillTrainer, "compute_loss", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_stage(setup, out, *overrides)
    return compute


def assert_same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in b.glob("*.safetensors"))
    for name in files:
        left, right = load_file(str(a / name)), load_file(str(b / name))
        assert left.keys() == right.keys()
        differ = {k: float((left[k].float() - right[k].float()).abs().max()) for k in left if not torch.equal(left[k], right[k])}
        assert not differ, f"{name}: resumed and uninterrupted weights differ (max |diff|): {differ}"


def test_resume_continues_from_the_last_checkpoint(setup, distilled, tmp_path, monkeypatch, capsys):
    from distill.trainer import DistillTrainer

    compute = crash_at_step_30(setup, tmp_path, monkeypatch)
    checkpoints = list((tmp_path / "distill_ckpt").glob("*/checkpoint-*"))
    assert [c.name for c in checkpoints] == ["checkpoint-20"]
    assert not (tmp_path / "draft").exists()  # nothing half-exported
    # a save cut short (a crash or a full disk while checkpoint-30 was written: weights, no trainer_state.json)
    partial = checkpoints[0].parent / "checkpoint-30"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setattr(DistillTrainer, "compute_loss", compute)
    capsys.readouterr()
    result, _ = run_stage(setup, tmp_path)
    out = capsys.readouterr().out
    assert "resuming from" in out and "checkpoint-20" in out and not partial.exists(), out[-2000:]
    uninterrupted = read_spec(distilled[2] / "draft")
    resumed = read_spec(tmp_path / "draft")
    # The resumed run trains the same steps to the same weights as the uninterrupted one (CPU, fp32, seed 0, the
    # data order and RNG restored from checkpoint-20: bit-identical here), so it measures the same acceptance.
    assert resumed["training"]["steps"] == uninterrupted["training"]["steps"] == 40
    assert_same_weights(tmp_path / "draft", distilled[2] / "draft")
    assert result["acceptance_after"] == uninterrupted["acceptance"]["after"]["overall"]
    # The run's counters continue from the checkpoint: the curve keeps its point from before the crash, the token
    # count is the whole run's, and the time budget counts the minutes trained before the crash.
    assert [p["step"] for p in resumed["learning_curve"]] == [p["step"] for p in uninterrupted["learning_curve"]] == [20, 40]
    assert resumed["training"]["train_tokens"] == uninterrupted["training"]["train_tokens"]
    assert resumed["learning_curve"][0]["train_tokens"] == uninterrupted["learning_curve"][0]["train_tokens"]
    assert 0 < resumed["learning_curve"][0]["train_minutes"] < resumed["learning_curve"][1]["train_minutes"]
    # ... and the CPU seconds of training (issue 52's budget) continue too: the record's total is the last point's
    assert 0 < resumed["learning_curve"][0]["train_cpu_s"] < resumed["learning_curve"][1]["train_cpu_s"]
    assert resumed["training"]["train_cpu_s"] == resumed["learning_curve"][1]["train_cpu_s"]
    assert set(resumed["learning_curve"][1]["by_domain"]) == set(uninterrupted["acceptance"]["after"]) - {"overall"}


def test_only_a_checkpoint_the_trainer_finished_is_resumed(tmp_path):
    from distill.training import last_complete_checkpoint

    assert last_complete_checkpoint(tmp_path / "none") is None
    for step, complete in ((10, True), (20, True), (30, False), (5, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-notes").mkdir()  # not a checkpoint: left alone
    assert last_complete_checkpoint(tmp_path, remove_partial=False) == str(tmp_path / "checkpoint-20")
    assert (tmp_path / "checkpoint-30").exists()  # only the main process removes
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-20")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-20", "checkpoint-5",
                                                          "checkpoint-notes"]
    (tmp_path / "checkpoint-10" / "trainer_state.json").unlink()
    (tmp_path / "checkpoint-20" / "trainer_state.json").unlink()
    assert last_complete_checkpoint(tmp_path) is None  # nothing finished: a fresh start, no half-written folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-notes"]


def test_a_resume_with_the_budget_spent_trains_no_further_step(setup, tmp_path, monkeypatch):
    from distill.progress import PROGRESS_FILE
    from distill.trainer import DistillTrainer

    # checkpoints every 12 steps: the last one before the crash (24) is mid-epoch (5 steps an epoch), where
    # Trainer.train would resume into one more step
    # (the stop rule off: it could end the run with the weights of step 20, its best, instead of the checkpoint's)
    compute = crash_at_step_30(setup, tmp_path, monkeypatch, "distill.checkpoint.save_steps=12",
                               "distill.trainer.stop_patience=null")
    checkpoint = max((tmp_path / "distill_ckpt").glob("*/checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoint.name == "checkpoint-24"
    saved = json.loads((checkpoint / PROGRESS_FILE).read_text())
    (checkpoint / PROGRESS_FILE).write_text(json.dumps(saved | {"train_seconds": 120.0}))  # 2 minutes spent
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint_weights = load_file(checkpoint / "model.safetensors")
    calls = []
    monkeypatch.setattr(DistillTrainer, "compute_loss", lambda *a, **k: calls.append(1) or compute(*a, **k))
    run_stage(setup, tmp_path, "distill.checkpoint.save_steps=12", "distill.trainer.stop_patience=null",
              "distill.checkpoint.max_train_minutes=1")
    spec = read_spec(tmp_path / "draft")
    assert not calls and spec["training"]["steps"] == 24 and spec["training"]["train_tokens"] == saved["train_tokens"]
    assert spec["learning_curve"][-1]["step"] == 24
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "draft").state_dict()
    layer = next(k for k in checkpoint_weights if "layers.0.mlp.up_proj" in k)
    assert torch.allclose(exported[layer].float(), checkpoint_weights[layer].float(), atol=1e-2)  # bf16 export


def test_the_time_budget_counts_minutes_trained_before_a_resume(tmp_path):
    from distill.progress import PROGRESS_FILE, RunProgress, TimeBudgetCallback

    checkpoint = tmp_path / "checkpoint-20"
    checkpoint.mkdir()
    (checkpoint / PROGRESS_FILE).write_text(json.dumps({"step": 20, "train_tokens": 500, "train_seconds": 59.0,
                                                        "curve": []}))
    progress = RunProgress(checkpoint)
    progress.started = time.time() - 2  # two more seconds trained after the resume
    control = types.SimpleNamespace(should_training_stop=False, should_save=False)
    TimeBudgetCallback(1.0, progress).on_step_end(types.SimpleNamespace(device="cpu"), None, control)
    assert control.should_training_stop and control.should_save  # 59 s + 2 s > 1 minute
    assert progress.tokens() == 500 and RunProgress(None).seconds() == 0.0


def test_a_knob_added_later_keeps_older_checkpoints_fingerprint_until_it_is_set():
    from omegaconf import OmegaConf, open_dict

    from distill.stage import ADDED_LATER, fingerprint

    cfg = OmegaConf.create({"seed": 0, "model": {"draft": {"layers": [0, 1]}},
                            "distill": OmegaConf.to_container(SHIPPED.distill)})
    older = copy.deepcopy(cfg)
    with open_dict(older):
        for (group, key), off in ADDED_LATER.items():
            del older.distill[group][key]  # the config as it was before the knob existed
            cfg.distill[group][key] = off  # and with the knob at its "off" value (a default may turn it on)
    args = ({"path": "t"}, {"fingerprint": "c"}, 10, 1.0)
    assert fingerprint(cfg, *args) == fingerprint(older, *args)
    for group, key, value in (("trainer", "lr_probe", {"factors": [1.0], "steps": 5}), ("trainer", "stop_patience", 2)):
        before = fingerprint(cfg, *args)
        cfg.distill[group][key] = value
        assert fingerprint(cfg, *args) != before


def test_a_rerun_collect_that_only_re_merges_its_shards_keeps_the_checkpoint_name():
    """`python -m pipeline` after a crash in distill reruns collect, which re-merges the finished shards and rewrites
    the manifest's measures of its own run (wall_s, ...): the distill checkpoint must keep its name, or the rerun
    trains from scratch (a real-pair run lost 80 steps that way). What the rows are still names it."""
    from omegaconf import OmegaConf

    from distill.stage import fingerprint

    cfg = OmegaConf.create({"seed": 0, "model": {"draft": {"layers": [0, 1]}},
                            "distill": SHIPPED.distill})
    manifest = {"fingerprint": "c", "rows": 10, "domains": {"chat": {"tokens": 500}}, "wall_s": 450.1,
                "generate_s": 440.0, "label_cost": {"target": {"cpu_s": 855.1}}, "disk_bytes": 1000}
    re_merged = {**manifest, "wall_s": 12.4}
    name = fingerprint(cfg, {"path": "t"}, manifest, 10, 1.0)
    assert fingerprint(cfg, {"path": "t"}, re_merged, 10, 1.0) == name
    assert fingerprint(cfg, {"path": "t"}, {**manifest, "domains": {"chat": {"tokens": 501}}}, 10, 1.0) != name


def test_on_policy_continuations_are_as_long_as_the_collected_ones_and_that_length_names_the_checkpoint():
    from omegaconf import OmegaConf

    from distill.stage import fingerprint
    from distill.trainer import DistillConfig
    from distill.training import generation_length

    cfg = OmegaConf.create({"seed": 0, "model": {"draft": {"layers": [0, 1]}},
                            "distill": SHIPPED.distill})
    manifest, ident = {"fingerprint": "c", "max_new_tokens": 96}, {"path": "t"}
    assert generation_length(cfg.distill.objective, manifest) == 96

    def print_with(**objective):
        c = cfg.copy()
        c.distill.objective.update(objective)
        return fingerprint(c, ident, manifest, 10, 1.0)

    # off-policy: nothing is generated, so the length names nothing (older checkpoints keep their name)
    assert print_with(max_new_tokens=64) == print_with()
    # on-policy: the resolved length is what counts: null and an explicit 96 train alike, 64 does not
    assert print_with(lmbda=0.5) == print_with(lmbda=0.5, max_new_tokens=96) != print_with(lmbda=0.5, max_new_tokens=64)
    assert print_with(lmbda=0.5, max_new_tokens=400) == print_with(lmbda=0.5, max_new_tokens=256)  # capped
    objective = {**OmegaConf.to_container(cfg.distill.objective), "max_new_tokens": 96}
    assert DistillConfig(output_dir="unused", report_to="none", **objective).max_new_tokens == 96
    objective["max_new_tokens"] = None
    assert DistillConfig(output_dir="unused", report_to="none", **objective).max_new_tokens == 256


def test_a_resume_from_the_last_step_trains_no_further_step(setup, tmp_path, monkeypatch):
    """A crash after the final checkpoint (or a rerun to calibrate for other serving): the step budget is spent."""
    import shutil

    from distill.trainer import DistillTrainer

    compute = crash_at_step_30(setup, tmp_path, monkeypatch, "distill.checkpoint.save_steps=12")
    checkpoint = max((tmp_path / "distill_ckpt").glob("*/checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    shutil.move(checkpoint, checkpoint.with_name("checkpoint-40"))  # as if saved at the last step (max_steps=40)
    calls = []
    monkeypatch.setattr(DistillTrainer, "compute_loss", lambda *a, **k: calls.append(1) or compute(*a, **k))
    run_stage(setup, tmp_path, "distill.checkpoint.save_steps=12")
    spec = read_spec(tmp_path / "draft")
    assert not calls and spec["training"]["steps"] == 40


def test_loss_temperature_serving_resolves_to_the_serving_temperature_and_names_the_checkpoint_by_it():
    from omegaconf import OmegaConf

    from distill.settings import DistillSettings, loss_temperature
    from distill.stage import fingerprint

    conf = SHIPPED.distill
    conf.objective.loss_temperature = "serving"
    objective = DistillSettings.from_config(OmegaConf.create(
        {"distill": conf, "calibrate": SHIPPED.calibrate}), "distill").objective
    assert loss_temperature(objective, 0.7) == 0.7
    assert loss_temperature(objective, 0.0) == 1.0  # greedy: argmax agreement has no temperature to match
    cfg = OmegaConf.create({"seed": 0, "model": {"draft": {"layers": [0, 1]}}, "distill": conf})
    args = ({"path": "t"}, {"fingerprint": "c"}, 10)
    assert fingerprint(cfg, *args, 0.7) != fingerprint(cfg, *args, 1.0)
    cfg.distill.objective.loss_temperature = 1.0  # an explicit 1.0 trains as `serving` at greedy serving does
    assert fingerprint(cfg, *args, 1.0) == fingerprint(OmegaConf.merge(cfg, {"distill": {"objective": {
        "loss_temperature": "serving"}}}), *args, 1.0)
