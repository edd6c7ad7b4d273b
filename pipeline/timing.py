"""Wall-clock timing that means the same on CPU and CUDA."""
from __future__ import annotations

import time

import torch


def synced_clock(device: torch.device | str):
    """A `perf_counter` that first waits for the device's queued kernels (an unsynced CUDA clock measures launches);
    for whole runs: inside a decode loop the decoder marks its parts with `Stopwatch` instead."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


class Stopwatch:
    """Marks inside a loop whose intervals are read once, after it: perf_counter readings on CPU, recorded events on
    CUDA (recording does not wait for the GPU, so profiling adds no per-forward synchronisation)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, start, end) -> float:
        """Seconds between two marks."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class Laps:
    """Wall-clock seconds per step of a stage body: `laps.lap("training")` closes the step that began at the
    previous lap. A stage prints `laps.summary()` at its end, so a user sees where a run's minutes went."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self._last
        self._last = now
        return self.parts[name]

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.0f}s" for name, seconds in self.parts.items())
