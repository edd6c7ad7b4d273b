"""MLflow tracking: a local store by default, one run per stage, nested under a parent for stage=all."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf


def tracking_uri(cfg: DictConfig) -> str:
    uri = cfg.tracking.get("uri")
    if uri:
        return str(uri)
    # A local SQLite store: MLflow 3 deprecates the plain file store; sqlite needs no server.
    db = Path(cfg.paths.artifacts).resolve() / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = str(v)[:500]  # MLflow caps param values
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


class _NullRun:
    """Stands in for MLflow when tracking is disabled, so stage code never branches on it."""

    def log_metrics(self, metrics: dict, step: int | None = None) -> None: ...
    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...
    def log_artifacts(self, path: str, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict) -> None: ...


class _MlflowRun(_NullRun):
    def __init__(self, mlflow):
        self.mlflow = mlflow

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v == v}
        if clean:
            self.mlflow.log_metrics(clean, step=step)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if os.path.exists(path):
            self.mlflow.log_artifact(path, artifact_path)

    def log_artifacts(self, path: str, artifact_path: str | None = None) -> None:
        if os.path.isdir(path):
            self.mlflow.log_artifacts(path, artifact_path)

    def set_tags(self, tags: dict) -> None:
        self.mlflow.set_tags({k: str(v) for k, v in tags.items()})


@contextlib.contextmanager
def start_run(cfg: DictConfig, name: str, nested: bool = False) -> Iterator[_NullRun]:
    """Open an MLflow run (or a no-op stand-in when `tracking.enabled=false`)."""
    # Under `accelerate launch` every process runs the stage; only the main one (RANK 0) tracks,
    # so a run is recorded once and the SQLite store never sees concurrent writers.
    if not cfg.tracking.enabled or int(os.environ.get("RANK", "0")) != 0:
        yield _NullRun()
        return
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg))
    mlflow.set_experiment(cfg.tracking.experiment)
    with mlflow.start_run(run_name=name, nested=nested):
        mlflow.log_params(flatten(OmegaConf.to_container(cfg, resolve=True)))
        run = _MlflowRun(mlflow)
        run.set_tags({"stage": name, "git_commit": git_commit(), "model_preset": cfg.model.name,
                      "target": cfg.model.target.name, "draft": cfg.model.draft.name})
        yield run
