"""The name of the processor measurements ran on: every cost profile, dtype choice and eval report carries it."""
from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, where platform.processor() is usually empty)."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def resident_bytes() -> int | None:
    """This process's resident set (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_freed_memory() -> bool:
    """Returns the C heap's freed pages to the OS (glibc's malloc_trim; False where there is none): glibc keeps freed
    chunks in its arenas once freeing a large block has raised its mmap threshold, and tensors of varying lengths
    fragment them (docs/journal.md, "The real pair's training memory")."""
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
