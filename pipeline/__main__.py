"""Entry point: `python -m pipeline stage=prepare|collect|distill|calibrate|eval|all|params` (Hydra over conf/).

Thin on purpose: compose the config, check the settings of every stage that will run, open the MLflow run, call the
stage's `run(cfg, tracker)`; bad input is one line and exit 2. `stage=params` writes params.yaml, from which
`params_file=params.yaml` runs a stage (dvc.yaml does).
"""
from __future__ import annotations

import errno
import importlib
import logging
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.control.deadline import (BUDGET_KEYS, DeadlineSettings, RunDeadline, describe, machine_line,
                                       verify_pass_seconds)
from pipeline.errors import PipelineError
from pipeline.control.params import compose_config, from_params_file, write_params
from pipeline.control.tracking import start_run

# One line per stage, in run order: (module with `run(cfg, tracker) -> dict`, module with `check_settings(cfg)`,
# which checks the stage's settings without loading a model or data, so every stage's are checked before any runs).
STAGES = {
    "prepare": ("data.prepare", "data.prepare"),
    "collect": ("data.collect", "data.collect"),
    "distill": ("distill.stage", "distill.settings"),
    "calibrate": ("distill.calibrate_stage", "distill.settings"),
    "eval": ("eval.stage", "eval.settings"),
}



def register_settings() -> None:
    """Every group's structured config (pipeline/settings.py): importing its settings module registers it."""
    for module in ("pipeline.control.root", "pipeline.control.deadline", "pipeline.modelio.settings", *dict.fromkeys(settings for _, settings in STAGES.values())):
        importlib.import_module(module)


register_settings()

def check_settings(cfg: DictConfig) -> None:
    """The settings of every stage `cfg.stage` runs (params: every stage, whose settings the file will hold),
    checked before the first one starts: a bad value for a later stage fails in one line before the earlier ones
    spend minutes. What needs files or models is checked where those load."""
    if cfg.stage not in (*STAGES, "all", "params"):
        raise PipelineError(f"unknown stage {cfg.stage!r}: use stage={'|'.join(STAGES)}|all|params")
    if cfg.stage == "all":
        DeadlineSettings.from_cfg(cfg)
    names = list(STAGES) if cfg.stage in ("all", "params") else [cfg.stage]
    if set(names) - {"prepare"}:  # every later stage loads the models
        from pipeline.modelio.models import check_model_settings
        check_model_settings(cfg)
    for name in names:
        importlib.import_module(STAGES[name][1]).check_settings(cfg)


def run_stage(name: str, cfg: DictConfig, nested: bool = False) -> dict:
    module = importlib.import_module(STAGES[name][0])
    t0 = time.time()
    with start_run(cfg, name, nested=nested) as tracker:
        result = module.run(cfg, tracker) or {}
        tracker.log_metrics({f"{name}_wall_s": time.time() - t0})
    print(f"[pipeline] stage {name} finished in {time.time() - t0:.1f}s")
    return result


def _configure(cfg: DictConfig) -> None:
    import torch

    if cfg.runtime.get("threads"):
        torch.set_num_threads(int(cfg.runtime.threads))
    # Third-party chatter (HF, MLflow, datasets) hides our own progress output.
    for name in ("transformers", "datasets", "mlflow", "alembic", "urllib3", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _verbose() -> bool:
    return any(a.startswith("hydra.verbose") for a in sys.argv[1:])


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    # Hydra would print its own multi-line report for any exception; keep bad input to one line.
    try:
        return _main(cfg)
    except PipelineError as e:
        if _verbose():
            raise
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - only a full disk is turned into a line; anything else propagates
        full = None if _verbose() else _disk_full(e)
        if full is None:
            raise
        _fail(f"the disk is full ({(str(full).strip().splitlines() or ['no space left'])[0]}): free space under paths.artifacts and rerun the "
              "same command; collect and distill resume from their last complete shard and checkpoint")


def _disk_full(error: BaseException) -> BaseException | None:
    """The error in `error`'s chain that says a write ran out of space: an OSError (ENOSPC, EDQUOT) or a library's own
    error that names it (safetensors raises SafetensorError with the OS message); None when none does."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(error):
            return error
        error = error.__cause__ or error.__context__
    return None


def _main(cfg: DictConfig) -> dict:
    stage = cfg.stage
    if stage != "params" and cfg.get("params_file"):
        cfg = from_params_file(cfg, _task_overrides())
    check_settings(cfg)  # again here: a params file, a sweep's job or hydra.verbose skip the check in cli()
    if stage == "params":
        print(f"[pipeline] wrote {write_params(cfg, _task_overrides())}: run stages from it with params_file=<that file> (dvc.yaml does)")
        return {}
    _configure(cfg)
    if stage != "all":
        return run_stage(stage, cfg)
    return run_all(cfg)


def run_all(cfg: DictConfig) -> dict:
    """Every stage in order; with `deadline.minutes`, the run is first sized to the machine (pipeline/control/sizing.py)
    and each budgeted stage gets its share of the time left (pipeline/control/deadline.py)."""
    settings = DeadlineSettings.from_cfg(cfg)
    clock, unit_s, results = None, None, {}
    if settings.minutes is not None:
        cfg, clock, unit_s = size_to_machine(cfg, settings)
    with start_run(cfg, "all") as tracker:
        if clock is not None:
            tracker.log_metrics({"deadline/scale": clock.scale, "deadline/planned_min": clock.minutes,
                                 "deadline/verify_pass_ms": 1e3 * unit_s})
        for name in STAGES:
            stage_cfg = cfg
            if clock is not None and name in BUDGET_KEYS:
                stage_cfg, plan = clock.apply(cfg, name, unit_s)
                print(describe(plan))
                tracker.log_metrics({f"deadline/{name}_budget_min": plan["minutes"],
                                     f"deadline/{name}_left_min": plan["left_s"] / 60})
            results[name] = run_stage(name, stage_cfg, nested=True)
        if clock is not None:
            wall = 60 * clock.minutes - clock.left_s()
            print(f"[pipeline] run finished in {wall / 60:.1f} min (planned {clock.minutes:.1f}, "
                  f"deadline.minutes={settings.minutes:g})")
            tracker.log_metrics({"deadline/wall_min": wall / 60})
    return results


def size_to_machine(cfg: DictConfig, settings: DeadlineSettings) -> tuple[DictConfig, RunDeadline, float]:
    """The machine's pass timed (once: off a CPU it loads the target), the run's plan printed first and applied."""
    from pipeline.control.sizing import apply_sizes, describe_run, plan_run

    started = time.time()
    unit_s = verify_pass_seconds(cfg)
    plan = plan_run(settings, cfg, unit_s, time.time() - started)  # stops here (exit 2) where it cannot fit
    for line in describe_run(plan, settings, machine_line(cfg)):
        print(line, flush=True)
    return apply_sizes(cfg, plan), RunDeadline(settings, plan.scale, plan.minutes, started), unit_s


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task)


def _is_sweep(override: str) -> bool:
    """A multirun sweep (`key=a,b`, `key=range(1,3)`) as Hydra's own parser reads it; `key=[0,1]` is one list value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(override).is_sweep_override()
    except Exception:  # noqa: BLE001  (composing it next names what is wrong, in one line)
        return False


def _precheck_overrides(argv: list[str]) -> None:
    """Compose once before Hydra does, so an unknown preset, a bad override or a bad setting of any stage that will
    run is one line and nothing is written (Hydra makes its run directory before main); Hydra's own flags skip it."""
    if any(a.startswith("-") or _is_sweep(a) for a in argv) or _verbose():
        return
    try:
        cfg = compose_config(argv)
        if not cfg.get("params_file"):  # the file is the config: _main checks it once loaded
            check_settings(cfg)
    except PipelineError as e:
        _fail(str(e))


def cli() -> None:
    _precheck_overrides(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
