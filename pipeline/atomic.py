"""Write-then-rename helpers so a crash never leaves a half-written artifact in place."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

# mkdtemp/mkstemp create private (0700/0600) paths; artifacts should get the usual umask modes.
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` in one rename, on an exception it is
    removed and `final` is left untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_UMASK)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


@contextlib.contextmanager
def atomic_file(final: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary sibling file for writing; rename it over `final` only on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | Path, obj) -> None:
    with atomic_file(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


@contextlib.contextmanager
def exclusive(path: str | Path) -> Iterator[None]:
    """Holds an exclusive lock on the folder that holds `path` for the duration: processes that fetch or convert into
    the same cache folder (two runs, or test workers, on one artifacts folder) take turns instead of racing. The
    folder itself is locked, so nothing is left beside the files; never nest two locks on one folder."""
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock
