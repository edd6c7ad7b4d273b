"""Every stage's settings are checked before the first stage runs: a bad value for a later stage fails `stage=all` in
one line, exit 2, before anything is written (not after minutes of collecting), and every shipped preset passes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from pipeline.__main__ import STAGES, check_settings
from pipeline.errors import PipelineError
from tests.conftest import REPO

# (stage whose settings are bad, override, a phrase the one line must hold); every stage of STAGES has one
BAD = [
    ("prepare", "data.domains=[poetry]", "unknown domain 'poetry'"),
    ("prepare", "data.extra_eval_fraction=2", "data.extra_eval_fraction=2"),
    ("collect", "collect.batch_size=0", "collect.batch_size=0"),
    ("distill", "distill.objective.loss=nope", "unknown distillation loss 'nope'"),
    ("distill", "distill.objective.loss_temperature=hot", "loss_temperature='hot'"),
    ("calibrate", "calibrate.engines=[nope]", "names unknown engines"),
    ("eval", "eval.temperature=-1", "eval.temperature"),
    ("all", "deadline.minutes=-1", "deadline.minutes=-1"),
    # values TrainingArguments and the model loader took without a word, once (issue 54)
    ("distill", "distill.trainer.learning_rate=-1", "distill.trainer.learning_rate=-1.0 is out of range"),
    ("distill", "distill.trainer.per_device_train_batch_size=0", "per_device_train_batch_size=0 is out of range"),
    ("distill", "distill.trainer.max_steps=-5", "distill.trainer.max_steps=-5 is out of range"),
    ("distill", "distill.objective.hidden_weight=-1", "hidden_weight=-1.0 is negative"),
    ("collect", "model.draft.derive.layers=[0,99]", "names layers [99] outside the 30 of model.target"),
    ("collect", "model.draft.derive.layers=[1,1]", "names a layer twice"),
    ("collect", "model.target.path=/nonexistent", "model path /nonexistent does not exist"),
    ("prepare", "data.text.python_source.modules=[json]", "modules ['json'] are code prompts' modules too"),
    # a value of the wrong type: the group's structured config refuses it while composing
    ("collect", "collect.text.prepared=maybe", "Value 'maybe' is not a valid bool"),
    ("distill", "distill.trainer.learning_rate=fast", "Value 'fast' of type 'str' could not be converted to Float"),
    ("eval", "eval.max_new_tokens=many", "Value 'many' of type 'str' could not be converted to Integer"),
    ("all", "runtime.threads=all", "Value 'all' of type 'str' could not be converted to Integer"),
    # a key no group declares
    ("calibrate", "calibrate.gamma=4", "Key 'gamma' not in 'CalibrationSettings'"),
]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m pipeline` run from an empty folder of tmp_path (`args` put the artifacts under it too)."""
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)


def test_every_stage_has_a_bad_setting_case():
    assert {stage for stage, _, _ in BAD} >= set(STAGES)


@pytest.mark.parametrize("stage, override, needle", BAD, ids=[override for _, override, _ in BAD])
def test_a_bad_setting_of_any_stage_fails_stage_all_in_one_line_before_anything_is_written(tmp_path, stage, override,
                                                                                            needle):
    done = _cli(tmp_path, "stage=all", override, f"paths.artifacts={tmp_path}/artifacts")
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, err[-2000:], done.stdout[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert needle in err, err
    assert not done.stdout.strip(), done.stdout[-2000:]  # no stage started
    assert [p.name for p in tmp_path.rglob("*")] == ["work"] and not any((tmp_path / "work").iterdir())


@pytest.mark.parametrize("stage, override, needle", [case for case in BAD if case[0] != "all"],
                         ids=[override for stage, override, _ in BAD if stage != "all"])
def test_the_stage_itself_refuses_its_bad_setting(stage, override, needle):
    with pytest.raises((PipelineError, ConfigCompositionException)) as refused:
        check_settings(_compose(f"stage={stage}", override))
    assert needle in f"{refused.value} {refused.value.__cause__}"


def test_a_stage_run_alone_checks_only_its_own_settings():
    check_settings(_compose("stage=prepare", "eval.temperature=-1"))  # eval does not run: its settings wait
    with pytest.raises(PipelineError, match="eval.temperature"):
        check_settings(_compose("stage=eval", "eval.temperature=-1"))


def test_the_calibrate_stage_reads_no_training_setting_and_a_run_of_both_checks_them():
    from distill.settings import DistillSettings

    settings = DistillSettings.from_config(_compose("stage=calibrate"), "calibrate")
    assert settings.trainer is None and settings.checkpoint is None and settings.split.calibration_share > 0
    check_settings(_compose("stage=calibrate", "distill.trainer.learning_rate=-1"))  # calibration trains nothing
    with pytest.raises(PipelineError, match="learning_rate=-1.0 is out of range"):
        check_settings(_compose("stage=all", "distill.trainer.learning_rate=-1"))
    with pytest.raises(PipelineError, match="calibration_share"):
        check_settings(_compose("stage=calibrate", "distill.split.calibration_share=2"))


def test_an_unknown_stage_is_refused_by_the_check():
    with pytest.raises(PipelineError, match="unknown stage 'bogus'"):
        check_settings(_compose("stage=bogus"))


PRESETS = ([f"experiment={p.stem}" for p in sorted((REPO / "conf/experiment").glob("*.yaml"))]
           + [f"model={p.stem}" for p in sorted((REPO / "conf/model").glob("[!_]*.yaml"))]
           + [f"data={p.stem}" for p in sorted((REPO / "conf/data").glob("*.yaml"))])


@pytest.mark.parametrize("preset", PRESETS)
def test_every_shipped_preset_passes_the_check_of_every_stage(preset):
    check_settings(_compose("stage=all", preset))
    check_settings(_compose("stage=params", preset))


def test_a_bad_setting_in_a_params_file_fails_its_stage_in_one_line(tmp_path):
    """DVC runs each stage from params.yaml: the file's values are checked once loaded, before the stage starts."""
    from omegaconf import OmegaConf

    params = OmegaConf.load(REPO / "params.yaml")
    params.eval.temperature = -1
    params.paths = {key: str(tmp_path / "artifacts" / key) for key in params.paths}  # were anything written
    OmegaConf.save(params, tmp_path / "params.yaml")
    done = _cli(tmp_path, "stage=eval", f"params_file={tmp_path}/params.yaml")
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1 and "eval.temperature" in err, err[-2000:]
    assert not done.stdout.strip(), done.stdout[-2000:]
    assert not (tmp_path / "artifacts" / "eval").exists()


def test_a_value_of_the_wrong_type_in_a_params_file_is_one_line(tmp_path):
    from omegaconf import OmegaConf

    params = OmegaConf.load(REPO / "params.yaml")
    params.distill.trainer.learning_rate = "fast"
    params.paths = {key: str(tmp_path / "artifacts" / key) for key in params.paths}
    OmegaConf.save(params, tmp_path / "params.yaml")
    done = _cli(tmp_path, "stage=distill", f"params_file={tmp_path}/params.yaml")
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err[-2000:]
    assert "Value 'fast' of type 'str' could not be converted to Float (at distill.trainer.learning_rate)" in err, err


def test_paths_an_earlier_stage_will_write_are_not_checked_before_it_runs(tmp_path):
    """The draft and the prompts of a fresh run exist only once distill and prepare have run: their checks stay where
    those load (eval/drafts.py, pipeline/control/prompts.py), not in the settings check."""
    check_settings(_compose("stage=all", f"eval.draft={tmp_path}/not-yet", f"eval.draft_init={tmp_path}/not-yet-either",
                            f"paths.prompts={tmp_path}/none"))


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device"),
    RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })"
                 "\n  while writing model.safetensors"),  # a library's message over two lines: still one line out
])
def test_a_full_disk_is_one_line_and_exit_2(monkeypatch, capsys, error):
    """A stage that runs out of disk mid-write (an OSError, or safetensors' own error naming it, as the 2026-12-06
    run that filled this machine's disk raised) ends in one line that says what to do; other errors propagate."""
    import pipeline.__main__ as entry

    def full(cfg):
        try:
            raise error
        except Exception as inner:  # as a library re-raises: the full disk is the cause, not the error itself
            raise ValueError("writing the checkpoint failed") from inner

    monkeypatch.setattr(entry, "_main", full)
    with pytest.raises(SystemExit) as exit_info:
        entry.main.__wrapped__(None)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "disk is full" in err, err
    monkeypatch.setattr(entry, "_main", lambda cfg: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        entry.main.__wrapped__(None)


# ---------------------------------------------------------------- each setting declared once, in its dataclass

def untyped_groups(cfg) -> set[str]:
    """The groups of a composed config that no dataclass declares (plain YAML)."""
    from dataclasses import is_dataclass

    from omegaconf import OmegaConf

    return {name for name in cfg if OmegaConf.is_dict(cfg[name]) and not is_dataclass(OmegaConf.get_type(cfg[name]))}


def test_the_typed_group_check_sees_a_group_declared_in_yaml_alone(tmp_path):
    conf = tmp_path / "conf"
    (conf / "extra").mkdir(parents=True)
    (conf / "extra" / "default.yaml").write_text("knob: 1\n")
    (conf / "config.yaml").write_text((REPO / "conf/config.yaml").read_text().replace(
        "  - experiment: null", "  - experiment: null\n  - extra: default"))
    for preset in ("model", "data", "experiment"):
        (conf / preset).symlink_to(REPO / "conf" / preset)
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        assert untyped_groups(compose("config")) == {"data", "extra"}


def test_every_group_is_its_registered_dataclass_with_a_default_and_a_help_per_key():
    """Settings declared once: each group of the composed config is the structured config of the dataclass that
    declares it (default, type, help; `data`, a list of pinned sources, is a preset), every key of it has help, and
    conf/ holds no YAML for a registered group."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    from pipeline.settings import help_lines
    from pipeline.tools.settings import registered

    cfg = _compose()
    typed = {name: OmegaConf.get_type(cfg[name]) for name in cfg if OmegaConf.is_dict(cfg[name])}
    assert untyped_groups(cfg) == {"data"}, typed
    groups = registered()
    assert all(typed[name] is groups[f"{name}/{'_base' if name == 'model' else 'default'}"] for name in typed if name != "data")
    for name, kind in groups.items():
        assert all(f.metadata.get("help") for f in fields(kind)), name
        assert len(help_lines(kind, "")) >= len(fields(kind))
        group, option = name.split("/")
        assert not (REPO / "conf" / group / f"{option}.yaml").exists(), f"{name} is declared twice"


def test_the_settings_tool_lists_every_key_with_its_default_and_help(capsys):
    from pipeline.tools.__main__ import main

    assert main(["settings", "tool.group=distill"]) == 0
    out = capsys.readouterr().out
    assert "distill.trainer.learning_rate = 0.003: " in out and "distill.objective.loss = 'fkl': " in out
    assert main(["settings", "tool.group=nope"]) == 2
