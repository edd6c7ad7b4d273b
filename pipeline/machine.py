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


def release_freed_memory() -> bool:
    """Returns the C heap's freed pages to the OS (glibc's malloc_trim; False where there is none): glibc keeps freed
    chunks in its arenas once freeing a large block has raised its mmap threshold. Once, where a phase ends: after
    every training step it cost the real pair 20% of its training time for 0.6 GB less peak (docs/results.md)."""
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
