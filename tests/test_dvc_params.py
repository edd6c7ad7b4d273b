"""Each dvc.yaml stage's params are exactly the settings its code reads: every stage of the quick preset runs in this
process on the embedded model with every config read recorded, and the reads are held against the stage's params
(a param covers the keys under it). A read no param covers would not rerun the stage when it changes; a param
nothing reads would rerun it for nothing."""
from __future__ import annotations

import pytest
import yaml
from omegaconf import Container, DictConfig, OmegaConf

from tests.conftest import REPO

# Keys that say where and how a stage runs, never what it computes: DVC tracks the artifacts, not these.
RUN_LOCATION = ("paths", "tracking", "hydra", "runtime.threads", "runtime.device", "runtime.output_dir",
                "model.name")  # the preset's name: an MLflow tag
# Params read only under a setting the quick preset leaves off: (stage, param) -> when the stage reads it.
CONDITIONAL = {("collect", "distill.split.heldout_fraction"): "collect.onpolicy.share > 0 (the held-out prompts stay "
               "the target's)",
               ("collect", "distill.split.heldout_max_prompts_per_domain"): "collect.onpolicy.share > 0",
               ("calibrate", "engines"): "calibrate.engines names llamacpp (its build, threads and server)"}


def covered(key: str, params) -> bool:
    return any(key == p or key.startswith(p + ".") for p in params)


def params_mismatch(dvc_yaml, reads: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Per stage: the keys it read that no param covers (`unlisted`) and the params under which it read nothing
    (`unread`)."""
    declared = yaml.safe_load(open(dvc_yaml))["stages"]
    report = {}
    for stage, keys in reads.items():
        params = [p for p in declared[stage].get("params", []) if isinstance(p, str)]
        keys = {k for k in keys if not covered(k, RUN_LOCATION)}
        problems = {"unlisted": sorted(k for k in keys if not covered(k, params)),
                    "unread": sorted(p for p in params if not any(covered(k, [p]) for k in keys)
                                     and (stage, p) not in CONDITIONAL)}
        if any(problems.values()):
            report[stage] = {k: v for k, v in problems.items() if v}
    return report


def test_the_params_check_sees_an_unlisted_read_and_an_unread_param(tmp_path):
    dvc = tmp_path / "dvc.yaml"
    dvc.write_text(yaml.safe_dump({"stages": {"collect": {"params": ["seed", "collect", "model.draft"]}}}))
    reads = {"collect": {"seed", "collect.batch_size", "model.target.name", "paths.collect"}}
    assert params_mismatch(dvc, reads) == {"collect": {"unlisted": ["model.target.name"], "unread": ["model.draft"]}}


@pytest.fixture(scope="module")
def reads_per_stage(tmp_path_factory) -> dict[str, set[str]]:
    """{stage: the config leaves it read}, each stage checked and run alone, as `dvc repro` runs it: from the resolved
    config (params.yaml holds values, no interpolations)."""
    from pipeline.__main__ import STAGES, _configure, check_settings, run_stage
    from pipeline.control.params import compose_config

    artifacts = tmp_path_factory.mktemp("dvc_params") / "artifacts"
    composed = compose_config(["experiment=quick", f"paths.artifacts={artifacts}", "tracking.enabled=false",
                               f"paths.models={REPO / 'artifacts/models'}", f"paths.cache={REPO / 'artifacts/cache'}",
                               f"paths.engines={REPO / 'artifacts/engines'}"])
    _configure(composed)
    reads, original, inside = set(), DictConfig._get_node, []

    def recording(self, key, *args, **kwargs):
        node = original(self, key, *args, **kwargs)
        if node is not None and not isinstance(node, Container) and not inside:
            inside.append(True)  # naming the key reads the parents' nodes again
            try:
                reads.add(self._get_full_key(key))
            finally:
                inside.pop()
        return node

    out = {}
    for name in STAGES:
        cfg = OmegaConf.create(OmegaConf.to_container(composed, resolve=True) | {"stage": name})
        reads.clear()
        DictConfig._get_node = recording
        try:
            check_settings(cfg)
            run_stage(name, cfg)
        finally:
            DictConfig._get_node = original
        out[name] = set(reads) - {"stage"}
    return out


@pytest.mark.slow
def test_each_dvc_stage_lists_exactly_the_settings_its_code_reads(reads_per_stage):
    mismatch = params_mismatch(REPO / "dvc.yaml", reads_per_stage)
    assert mismatch == {}, "\n".join(f"{stage} {kind}: {keys}" for stage, problems in mismatch.items()
                                      for kind, keys in problems.items())
