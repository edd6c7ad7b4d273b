"""`python -m pipeline.tools <subcommand> [hydra overrides]`: what the pipeline's stages do not measure.

Comparisons the eval stage can make are eval runs (conf/experiment/compare-*.yaml); what is left lives here, one
module per subcommand, its settings declared once in conf/tools/<subcommand>.yaml (`tool.*`, beside the whole
pipeline config: paths, runtime.dtype, model). One argument convention, Hydra overrides, and the pipeline's rule
for bad input: one line on stderr, exit 2, nothing written. A subcommand whose result says `passed: false` exits 1.
"""
from __future__ import annotations

import importlib
import sys

from omegaconf import OmegaConf

import pipeline.__main__  # noqa: F401  (registers every group's structured config)
from pipeline.errors import PipelineError
from pipeline.control.params import compose_config

SUBCOMMANDS = {  # subcommand -> module with `run(cfg)` and its settings, registered as tools/<subcommand>
    "learning-curve": "pipeline.tools.learning_curve",
    "cost-profile": "pipeline.tools.cost_profile",
    "compare-drafts": "pipeline.tools.compare_drafts",
    "layer-choice": "pipeline.tools.layer_choice",
    "sources": "pipeline.tools.sources",
    "gpu-check": "pipeline.tools.gpu_check",
    "settings": "pipeline.tools.settings",
}


def compose(subcommand: str, overrides: list[str]):
    """conf/config.yaml with the subcommand's settings under `tool` (MLflow off: a tool makes no run)."""
    declared = set(_settings(subcommand).__dataclass_fields__)
    cfg = compose_config(["tracking.enabled=false", f"+tools={subcommand}", *overrides])
    undeclared = sorted(set(cfg.tool) - declared)
    if undeclared:  # `+tool.<key>=...` gets past Hydra's own check
        raise PipelineError(f"tool.{undeclared[0]} is not a setting of {subcommand}: {SUBCOMMANDS[subcommand]} "
                            f"declares {', '.join(sorted(declared))}")
    return cfg


def _settings(subcommand: str):
    """The subcommand's settings dataclass, registered by importing its module."""
    from hydra.core.config_store import ConfigStore

    importlib.import_module(SUBCOMMANDS[subcommand])
    return OmegaConf.get_type(ConfigStore.instance().load(f"tools/{subcommand}.yaml").node)


def run(argv: list[str]):
    """The subcommand's result; a PipelineError for bad input."""
    if not argv or argv[0] not in SUBCOMMANDS:
        given = repr(argv[0]) if argv else "none"
        raise PipelineError(f"subcommand {given} is not one of {', '.join(SUBCOMMANDS)}: "
                            "python -m pipeline.tools <subcommand> [hydra overrides]")
    cfg = compose(argv[0], argv[1:])
    if cfg.runtime.get("threads"):
        import torch

        torch.set_num_threads(int(cfg.runtime.threads))
    return importlib.import_module(SUBCOMMANDS[argv[0]]).run(cfg)


def usage() -> str:
    """The module docstring and each subcommand's first line of help (its settings' docstring)."""
    lines = [__doc__.strip(), "", "subcommands:"]
    for name in SUBCOMMANDS:
        first = _settings(name).__doc__.splitlines()[0].split(": ", 1)[1]
        lines.append(f"  {name:<20}{first}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    try:
        result = run(argv)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if isinstance(result, dict) and result.get("passed") is False else 0


if __name__ == "__main__":
    sys.exit(main())
