"""The name of the processor measurements ran on: every cost profile, dtype choice and eval report carries it."""
from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, where platform.processor() is usually empty)."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()
