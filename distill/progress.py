"""Training progress that survives a resume: completion tokens, training seconds (held-out evaluations excluded),
the held-out learning curve, the chosen step size and the stop rule's state, carried in each checkpoint's
`progress.json` ({step, train_tokens, train_seconds, curve, recipe, best}), with the best weights (BEST_WEIGHTS).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from pipeline.atomic import write_json
from pipeline.machine import release_freed_memory, resident_bytes

PROGRESS_FILE = "progress.json"
BEST_WEIGHTS = "best_weights.pt"  # in a checkpoint whose best weights are not its own


class RunProgress:
    """Counters of the whole run. `trainer` (set once built) counts this process's completion tokens."""

    def __init__(self, checkpoint: str | Path | None = None, num_processes: int = 1):
        path = Path(checkpoint) / PROGRESS_FILE if checkpoint else None
        saved = json.loads(path.read_text()) if path is not None and path.exists() else {}  # {}: a fresh run
        self.tokens0, self.seconds0 = saved.get("train_tokens", 0), saved.get("train_seconds", 0.0)
        self.cpu_seconds0 = saved.get("train_cpu_s", 0.0)
        self.curve: list[dict] = saved.get("curve", [])
        self.recipe: dict | None = saved.get("recipe")  # the step size chosen (distill/training.py), None until then
        self.best: dict | None = saved.get("best")  # the stop rule's state (BestWeightsCallback)
        self.checkpoint = Path(checkpoint) if checkpoint else None
        self.num_processes, self.trainer = num_processes, None
        self.started: float | None = None
        self.excluded = 0.0  # seconds of held-out evaluation since `started`
        self.cpu_started: float | None = None
        self.cpu_excluded = 0.0  # this process's CPU seconds of held-out evaluation since `cpu_started`

    def tokens(self) -> int:
        """Completion tokens the loss saw; other processes are assumed to see as many as this one."""
        return self.tokens0 + getattr(self.trainer, "train_tokens", 0) * self.num_processes

    def seconds(self) -> float:
        if self.started is None:
            return self.seconds0
        return self.seconds0 + time.time() - self.started - self.excluded

    def cpu_seconds(self) -> float:
        """This process's CPU seconds of training (every thread: both cores count), held-out evaluation excluded: the
        training half of a label-and-training CPU budget (issue 52's measure)."""
        if self.cpu_started is None:
            return self.cpu_seconds0
        return self.cpu_seconds0 + time.process_time() - self.cpu_started - self.cpu_excluded

    def record(self, step: int) -> dict:
        return {"step": step, "train_tokens": self.tokens(), "train_seconds": round(self.seconds(), 2),
                "train_cpu_s": round(self.cpu_seconds(), 2),
                "curve": self.curve, "recipe": self.recipe, "best": self.best}


def from_main(value: float, device) -> float:
    """`value` as the main process has it, on every process (so every process stops or chooses alike)."""
    tensor = torch.tensor(float(value), device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast(tensor, src=0)
    return tensor.item()


class ProgressCallback(TrainerCallback):
    """Starts the run clock and writes progress.json into every checkpoint the Trainer saves."""

    def __init__(self, progress: RunProgress, is_main: bool = True):
        self.progress, self.is_main = progress, is_main

    def on_train_begin(self, args, state, control, **kwargs):
        self.progress.started, self.progress.cpu_started = time.time(), time.process_time()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.is_main and folder.is_dir():
            write_json(folder / PROGRESS_FILE, self.progress.record(state.global_step))


class AcceptanceCallback(TrainerCallback):
    """Every `eval_steps`, runs `evaluate(model) -> {metric: value}` on the main process, logs it and appends a point
    to the learning curve; also forwards the Trainer's own logs."""

    def __init__(self, evaluate, tracker, eval_steps: int, progress: RunProgress, is_main: bool = True,
                 printer=print):
        self.evaluate, self.tracker, self.eval_steps = evaluate, tracker, max(1, int(eval_steps))
        self.progress, self.is_main, self.printer = progress, is_main, printer

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.eval_steps == 0 and state.global_step < state.max_steps:
            self._run(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        curve = self.progress.curve
        if not curve or curve[-1]["step"] != state.global_step:
            self._run(state, model)

    def _run(self, state, model):
        if not self.is_main or model is None:
            return
        started, cpu, was_training = time.time(), time.process_time(), model.training
        metrics = self.evaluate(model)
        model.train(was_training)
        self.progress.curve.append({"step": state.global_step, "train_tokens": self.progress.tokens(),
                                    "train_minutes": round(self.progress.seconds() / 60, 3),
                                    "train_cpu_s": round(self.progress.cpu_seconds(), 1), **_curve_metrics(metrics)})
        self.progress.excluded += time.time() - started
        self.progress.cpu_excluded += time.process_time() - cpu
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


class HeapTrimCallback(TrainerCallback):
    """Trims the C heap after a step once the resident set has grown `slack` bytes past its size after the last trim:
    freed activations of varying lengths fragment glibc's arenas, and trimming after every step would cost time (the
    trimmed pages fault back in; docs/journal.md)."""

    def __init__(self, slack: int = 2 * 2**30):
        self.slack, self.floor = slack, None

    def on_step_end(self, args, state, control, **kwargs):
        now = resident_bytes()
        if now is None:
            return
        if self.floor is None or now > self.floor + self.slack:
            release_freed_memory()
            self.floor = resident_bytes()


class TimeBudgetCallback(TrainerCallback):
    """Stops training (with a final checkpoint) once `minutes` of training have passed, resumes included."""

    def __init__(self, minutes: float | None, progress: RunProgress):
        self.minutes, self.progress = minutes, progress

    def on_step_end(self, args, state, control, **kwargs):
        if not self.minutes:
            return
        if from_main(self.progress.seconds() > 60 * self.minutes, args.device):  # rank 0's clock
            control.should_training_stop = True
            control.should_save = True


class BestWeightsCallback(TrainerCallback):
    """The stop rule: every `eval_steps`, `judge(model) -> acceptance` on the calibration part (the rows keep_best and
    τ are chosen on; the curve's reporting part stays free of the choice); training stops after `patience`
    evaluations in a row below the best so far, the initial weights' `baseline` included, and ends with the best
    weights it evaluated. Only trained weights are put back: whether the initial ones beat them is keep_best's call
    (distill/stage.py select_weights), so the record says which of the two shipped."""

    def __init__(self, judge, eval_steps: int, patience: int, baseline: float, progress: RunProgress,
                 is_main: bool = True, printer=print):
        self.judge, self.eval_steps, self.patience = judge, max(1, int(eval_steps)), int(patience)
        self.progress, self.is_main, self.printer = progress, is_main, printer
        # best: the best acceptance so far (step 0: the initial weights); kept: the best trained step's; drops:
        # evaluations in a row below best; judged: the last step evaluated
        self.state = progress.best or {"baseline": float(baseline), "best": float(baseline), "best_step": 0,
                                       "kept": None, "kept_step": None, "drops": 0, "judged": 0, "stopped_at": None}
        progress.best = self.state
        saved = progress.checkpoint / BEST_WEIGHTS if progress.checkpoint else None
        self.weights = torch.load(saved, weights_only=True) if saved and saved.exists() else None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.weights is None and self.state["kept_step"] == state.global_step and model is not None:
            self.weights = trained_weights(model)  # resumed at the kept step: the checkpoint's own weights are the best

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.eval_steps or state.global_step >= state.max_steps:
            return
        if from_main(self.is_main and self._evaluate(state.global_step, model), args.device):
            self.state["stopped_at"] = state.global_step
            self.printer(f"step {state.global_step}: held-out acceptance (calibration part) below its best "
                         f"{self.state['best']:.3f} for {self.patience} evaluations: training stops")
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.is_main and self.weights is not None and self.state["kept_step"] != state.global_step \
                and folder.is_dir():
            torch.save(self.weights, folder / BEST_WEIGHTS)  # a resume can still put them back

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.is_main or model is None:
            return
        if self.state["judged"] != state.global_step:
            self._evaluate(state.global_step, model)
        if self.weights is not None and self.state["kept_step"] != state.global_step:
            put_back(model, self.weights)
            self.printer(f"kept the weights of step {self.state['kept_step']} (held-out acceptance "
                         f"{self.state['kept']:.3f} on the calibration part), the best evaluated in training")

    def _evaluate(self, step: int, model) -> bool:
        """Judges the model at `step`; True when the drops reach the patience."""
        was_training, started = model.training, time.time()
        acceptance = float(self.judge(model))
        model.train(was_training)
        self.progress.excluded += time.time() - started
        state = self.state
        state["judged"] = step
        if state["kept"] is None or acceptance > state["kept"]:
            state["kept"], state["kept_step"] = acceptance, step
            self.weights = None  # the old copy goes before the new one is made: one copy's memory, not two
            self.weights = trained_weights(model)
        if acceptance > state["best"]:
            state["best"], state["best_step"], state["drops"] = acceptance, step, 0
        else:
            state["drops"] += 1
        return state["drops"] >= self.patience


def trained_weights(model) -> dict:
    """A CPU copy of the weights training moves (those that take a gradient; the draft trains on in place): frozen
    ones never change, and a pretrained draft's shared embeddings and head are a large share of its memory."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def put_back(model, weights: dict) -> None:
    """Loads trained_weights (or a whole state dict, which older checkpoints saved) into the model; a name the model
    does not have is an error, not a silent skip."""
    unexpected = model.load_state_dict(weights, strict=False).unexpected_keys
    if unexpected:
        raise KeyError(f"weights for parameters the draft does not have: {unexpected[:3]}")
