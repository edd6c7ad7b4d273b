"""Every subcommand of `python -m pipeline.tools` refuses bad input the same way: exit code 2, one line on stderr, no traceback, and
nothing written (or half-written) under its output path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def run_tool(subcommand: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m pipeline.tools <subcommand> <args>` in a fresh process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pipeline.tools", subcommand, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def config_only_model(path: Path) -> Path:
    """A directory with an HF config.json (enough for argument checks; the tools fail before loading weights)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def empty_export(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# (subcommand, Hydra overrides (formatted with {tmp}, {model}, {out}), a phrase the one line must hold)
CASES = [
    ("nope", [], "is not one of"),
    ("cost-profile", [], "give one of tool.target"),
    ("cost-profile", ["tool.target_config={tmp}/nowhere", "tool.draft_config={tmp}/nowhere", "tool.out={out}"],
     "nowhere"),
    ("cost-profile", ["tool.target={tmp}/nowhere", "tool.draft_config={tmp}/nowhere", "tool.out={out}"],
     "not a model directory"),
    ("learning-curve", ["tool.out={out}"], "tool.drafts"),
    ("learning-curve", ["tool.drafts=[{tmp}/nowhere]", "tool.out={out}"], "no speculative.json"),
    ("learning-curve", ["tool.drafts=[{tmp}/export]", "tool.out={out}", "--bogus"], "bad configuration"),
    ("sources", ["tool.faq_dir={tmp}"], "holds no *.rst.txt"),
]


@pytest.mark.parametrize("subcommand, args, needle", CASES, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(CASES)])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, subcommand, args, needle):
    model, out = config_only_model(tmp_path / "model"), tmp_path / "out" / "result"
    empty_export(tmp_path / "export")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = run_tool(subcommand, *[a.format(tmp=tmp_path, model=model, out=out) for a in args], cwd=tmp_path)
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert needle in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    assert not out.parent.exists()


@pytest.mark.parametrize("subcommand", ["learning-curve"])
def test_an_out_path_that_is_a_file_is_refused(tmp_path, subcommand):
    out = tmp_path / "report.md"
    out.write_text("mine")
    done = run_tool(subcommand, f"tool.drafts=[{tmp_path / 'nowhere'}]", f"tool.out={out}", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "is a file" in done.stderr and out.read_text() == "mine"
