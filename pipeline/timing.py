"""Wall-clock timing that means the same on CPU and CUDA."""
from __future__ import annotations

import time

import torch


def synced_clock(device: torch.device | str):
    """A `perf_counter` that first waits for the device's queued kernels (CUDA runs asynchronously, so an
    unsynced clock measures launches, not work). On CPU it is plain perf_counter.

    Use it to bracket whole runs; inside a decode loop a sync per forward would itself slow CUDA down
    (see eval/speculative.py, which times its parts only when asked to).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return now
