"""Wall-clock timing that means the same on CPU and CUDA."""
from __future__ import annotations

import time

import torch


def synced_clock(device: torch.device | str):
    """A `perf_counter` that first waits for the device's queued kernels (CUDA runs asynchronously, so an
    unsynced clock measures launches, not work). On CPU it is plain perf_counter.

    Use it to bracket whole runs; inside a decode loop a sync per forward would itself slow CUDA down
    (the decoder marks its parts with `Stopwatch` instead).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


class Stopwatch:
    """Marks inside a loop whose intervals are read once, after the loop.

    On CPU a mark is a perf_counter reading. On CUDA it is a recorded event: recording does not wait for
    the GPU, so a decode loop can be profiled per forward without the per-forward synchronisations that
    would slow the very run being timed; `elapsed` waits for the events only when the numbers are read.
    """

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
