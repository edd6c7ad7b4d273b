"""The house rules a new reader relies on: stages meet on disk and share only the core (pipeline/), the
committed params.yaml is the default composition DVC runs from, and every model preset has the same keys."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import REPO

STAGES = ("data", "distill", "eval")


def imported_packages(path: Path) -> set[str]:
    """Top-level package of every import in a file, lazy imports inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_no_other_stage(stage):
    offenders = {str(path.relative_to(REPO)): sorted(imported_packages(path) & (set(STAGES) - {stage}))
                 for path in (REPO / stage).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_core_imports_no_stage():
    offenders = {str(path.relative_to(REPO)): sorted(imported_packages(path) & set(STAGES))
                 for path in (REPO / "pipeline").rglob("*.py") if path.name != "__main__.py"}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_boundary_check_sees_a_cross_stage_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from eval.speculative import speculative_generate\n")
    assert "eval" in imported_packages(bad)


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_committed_params_yaml_is_the_default_composition():
    from pipeline.params import params_of

    committed = OmegaConf.to_container(OmegaConf.load(REPO / "params.yaml"))
    assert committed == params_of(_compose()), "conf/ changed: rerun `python -m pipeline stage=params`"


def test_a_params_file_of_another_version_is_refused(tmp_path):
    from pipeline.errors import PipelineError
    from pipeline.params import from_params_file

    stale = OmegaConf.load(REPO / "params.yaml")
    stale.distill.objective.no_such_knob = 1
    path = tmp_path / "params.yaml"
    OmegaConf.save(stale, path)
    cfg = _compose("stage=distill", f"params_file={path}")
    with pytest.raises(PipelineError, match="no_such_knob"):
        from_params_file(cfg, ["stage=distill", f"params_file={path}"])
    with pytest.raises(PipelineError, match="whole config"):
        from_params_file(cfg, ["stage=distill", f"params_file={path}", "seed=1"])


def test_every_model_preset_has_the_same_keys():
    def keys(tree, prefix=""):
        out = set()
        for key, value in tree.items():
            out |= keys(value, f"{prefix}{key}.") if isinstance(value, dict) and key != "package" else {prefix + key}
        return out

    presets = [p.stem for p in (REPO / "conf/model").glob("*.yaml") if not p.stem.startswith("_")]
    shapes = {p: keys(OmegaConf.to_container(_compose(f"model={p}").model)) for p in presets}
    reference = shapes.pop("smollm2-135m")
    assert all(shape == reference for shape in shapes.values()), {p: s ^ reference for p, s in shapes.items()}
