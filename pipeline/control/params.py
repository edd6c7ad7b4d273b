"""params.yaml: the composed config as one file, so DVC tracks the parameters that actually ran.

`python -m pipeline stage=params experiment=real` writes it (resolved: interpolations such as eval's
`${collect.temperature}` become values, so each stage's params are explicit); dvc.yaml runs every stage with
`params_file=params.yaml`, and `dvc exp run -S distill.objective.loss=tvd` edits it.
"""
from __future__ import annotations

import itertools
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from pipeline.atomic import atomic_file
from pipeline.errors import PipelineError

RUN_KEYS = ("stage", "params_file", "params_out")  # how to run, not what: never written to the file
CONF = Path(__file__).resolve().parents[2] / "conf"


def compose_config(overrides: list[str]) -> DictConfig:
    """conf/config.yaml composed with `overrides`; Hydra's errors as one line naming the options a group offers."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=overrides)
    except Exception as e:
        lines = str(e).strip().splitlines()
        first = next((line.strip() for line in lines if line.strip()), type(e).__name__)
        cause = str(e.__cause__ or "").strip().splitlines()
        first += f": {cause[0]}" if cause else ""  # the schema's reason, e.g. a value of the wrong type
        start = next((i + 1 for i, line in enumerate(lines) if line.startswith("Available options")), len(lines))
        options = [line.strip() for line in itertools.takewhile(lambda line: line.startswith("\t"), lines[start:])]
        hint = f" (available: {', '.join(options)})" if options else " (see --help)"
        raise PipelineError(f"bad configuration: {first}{hint}") from None


def params_of(cfg: DictConfig) -> dict:
    """The composed config without the keys that only say how this process runs."""
    container = OmegaConf.to_container(cfg, resolve=True)
    return {k: v for k, v in container.items() if k not in RUN_KEYS}


def write_params(cfg: DictConfig, overrides: list[str]) -> Path:
    path = Path(cfg.get("params_out") or "params.yaml")
    shown = " ".join(o for o in overrides if o.split("=", 1)[0] not in RUN_KEYS)
    header = (f"# Written by `python -m pipeline stage=params{' ' + shown if shown else ''}` from conf/.\n"
              "# DVC runs every stage from this file (dvc.yaml); change it with `dvc exp run -S key=value`.\n")
    with atomic_file(path) as f:
        f.write(header + OmegaConf.to_yaml(OmegaConf.create(params_of(cfg))))
    return path


def _leaves(tree: dict, prefix: str = "") -> set[str]:
    """Dotted keys of the leaves; a model's `package` is one leaf (single-file and chunked packages differ)."""
    keys = set()
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "package":
            keys |= _leaves(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def from_params_file(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config in cfg.params_file, with this process's stage. Refuses other overrides (the file is the
    whole config) and a file whose keys no longer match conf/ (written by another version of the code)."""
    path = Path(cfg.params_file)
    extra = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in RUN_KEYS]
    if extra:
        raise PipelineError(f"params_file={path} is the whole config, so {extra} would be ignored: edit the file "
                            "(e.g. `dvc exp run -S key=value`) or rewrite it with `python -m pipeline stage=params ...`")
    if not path.is_file():
        raise PipelineError(f"params file {path} not found: write it with `python -m pipeline stage=params [overrides]`")
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    expected, found = _leaves(params_of(cfg)), _leaves(loaded or {})
    unknown, missing = sorted(found - expected), sorted(expected - found)
    if unknown or missing:
        problem = "; ".join(filter(None, [f"unknown keys {unknown[:5]}" if unknown else "",
                                          f"missing keys {missing[:5]}" if missing else ""]))
        raise PipelineError(f"{path} does not match this code's config ({problem}): rewrite it with "
                            "`python -m pipeline stage=params [overrides]`")
    try:  # into the composed schema: a value of the wrong type fails as it would on the command line
        return OmegaConf.merge(cfg, loaded, {k: cfg.get(k) for k in RUN_KEYS})
    except ValidationError as e:
        raise PipelineError(f"{path}: {str(e).strip().splitlines()[0]} (at {e.full_key}): fix the value or rewrite "
                            "the file with `python -m pipeline stage=params [overrides]`") from None
