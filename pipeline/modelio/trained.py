"""The training record: what the distill stage leaves beside the weights in ${paths.trained} (`training.json`) and
the calibrate stage and the tools read: the held-out rows, the FR-Spec subset, the selection and the learning curve.
In the core so that the two stages meet on disk, never through each other's code."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import PipelineError

RECORD = "training.json"  # in ${paths.trained}: what calibrate needs beside the weights (RECORD_VERSION's keys)
RECORD_VERSION = 1


def read_record(trained: str | Path) -> dict:
    """${paths.trained}/training.json, or a one-line error naming the fix."""
    path = Path(trained) / RECORD
    if not path.is_file():
        raise PipelineError(f"no trained draft at {trained} (no {RECORD}): run `python -m pipeline stage=distill` "
                            "first, or calibrate another draft with calibrate.draft=<dir>")
    record = json.loads(path.read_text())
    if record.get("version") != RECORD_VERSION:
        raise PipelineError(f"{path} has version {record.get('version')} (this code reads {RECORD_VERSION}): rerun "
                            "stage=distill")
    return record
