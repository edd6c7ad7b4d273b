"""Training progress that survives a resume: completion tokens and training seconds of the whole run, the
held-out learning curve, and the time budget, all counted across interruptions.

Each checkpoint carries `progress.json` ({step, train_tokens, train_seconds, curve}); a resumed run starts its
counters from the checkpoint it resumes, so the curve and the budget continue instead of restarting. Training
seconds exclude the held-out evaluations (they watch training; they are not part of it)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from pipeline.atomic import write_json

PROGRESS_FILE = "progress.json"


class RunProgress:
    """Counters of the whole run. `trainer` (set once built) counts this process's completion tokens."""

    def __init__(self, checkpoint: str | Path | None = None, num_processes: int = 1):
        saved = read_progress(checkpoint)
        self.tokens0, self.seconds0 = saved["train_tokens"], saved["train_seconds"]
        self.curve: list[dict] = saved["curve"]
        self.num_processes, self.trainer = num_processes, None
        self.started: float | None = None
        self.excluded = 0.0  # seconds of held-out evaluation since `started`

    def tokens(self) -> int:
        """Completion tokens the loss saw; other processes are assumed to see as many as this one."""
        local = getattr(self.trainer, "train_tokens", 0) if self.trainer is not None else 0
        return self.tokens0 + local * self.num_processes

    def seconds(self) -> float:
        if self.started is None:
            return self.seconds0
        return self.seconds0 + time.time() - self.started - self.excluded

    def record(self, step: int) -> dict:
        return {"step": step, "train_tokens": self.tokens(), "train_seconds": round(self.seconds(), 2),
                "curve": self.curve}


def read_progress(checkpoint: str | Path | None) -> dict:
    """The progress saved with a checkpoint; zeros for a fresh run (or a checkpoint from before this record)."""
    path = Path(checkpoint) / PROGRESS_FILE if checkpoint else None
    if path is None or not path.exists():
        return {"step": 0, "train_tokens": 0, "train_seconds": 0.0, "curve": []}
    return json.loads(path.read_text())


class ProgressCallback(TrainerCallback):
    """Starts the run clock and writes progress.json into every checkpoint the Trainer saves."""

    def __init__(self, progress: RunProgress, is_main: bool = True):
        self.progress, self.is_main = progress, is_main

    def on_train_begin(self, args, state, control, **kwargs):
        self.progress.started = time.time()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.is_main and folder.is_dir():
            write_json(folder / PROGRESS_FILE, self.progress.record(state.global_step))


class AcceptanceCallback(TrainerCallback):
    """Every `eval_steps`, runs `evaluate(model) -> {metric: value}` (the held-out acceptance simulator) on
    the main process, logs it with the stage's tracker and appends a point to the learning curve; also
    forwards the Trainer's own logs."""

    def __init__(self, evaluate, tracker, eval_steps: int, progress: RunProgress, is_main: bool = True,
                 printer=print):
        self.evaluate, self.tracker, self.eval_steps = evaluate, tracker, max(1, int(eval_steps))
        self.progress, self.is_main, self.printer = progress, is_main, printer

    @property
    def curve(self) -> list[dict]:
        return self.progress.curve

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.eval_steps == 0 and state.global_step < state.max_steps:
            self._run(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.curve or self.curve[-1]["step"] != state.global_step:
            self._run(state, model)

    def _run(self, state, model):
        if not self.is_main or model is None:
            return
        started, was_training = time.time(), model.training
        metrics = self.evaluate(model)
        model.train(was_training)
        self.curve.append({"step": state.global_step, "train_tokens": self.progress.tokens(),
                           "train_minutes": round(self.progress.seconds() / 60, 3), **_curve_metrics(metrics)})
        self.progress.excluded += time.time() - started
        self.tracker.log_metrics(metrics, step=state.global_step)
        overall = metrics.get("heldout/acceptance/overall")
        if overall is not None:
            self.printer(f"step {state.global_step}: held-out acceptance {overall:.3f}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.is_main and logs:
            self.tracker.log_metrics({f"train/{k}": v for k, v in logs.items()}, step=state.global_step)


def _curve_metrics(metrics: dict) -> dict:
    """{"acceptance": overall, "by_domain": {domain: acceptance}} from the simulator's tracker keys."""
    prefix = "heldout/acceptance/"
    by_domain = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
    return {"acceptance": by_domain.pop("overall", None), "by_domain": by_domain}


class TimeBudgetCallback(TrainerCallback):
    """Stops training (with a final checkpoint) once `minutes` of training have passed, resumes included."""

    def __init__(self, minutes: float | None, progress: RunProgress):
        self.minutes, self.progress = minutes, progress

    def on_step_end(self, args, state, control, **kwargs):
        if not self.minutes:
            return
        stop = torch.tensor(float(self.progress.seconds() > 60 * self.minutes), device=args.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast(stop, src=0)  # every process stops at the same step (rank 0's clock)
        if stop.item():
            control.should_training_stop = True
            control.should_save = True
