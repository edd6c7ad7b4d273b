"""Every command-line tool refuses bad input the same way: exit code 2, one line on stderr, no traceback, and
nothing written (or half-written) under its output path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def run_tool(module: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def config_only_model(path: Path) -> Path:
    """A directory with an HF config.json (enough for argument checks; the tools fail before loading weights)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def empty_export(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


# (module, arguments (formatted with {tmp}, {model}, {out}), a phrase the one line must hold)
CASES = [
    ("eval.bench", [], "--target"),
    ("eval.bench", ["--target", "{tmp}/nowhere", "--json", "{out}"], "not an HF model directory"),
    ("eval.bench", ["--target", "{model}", "--prompts", "{tmp}/none.jsonl", "--json", "{out}"], "no prompt file"),
    ("eval.bench", ["--target", "{model}", "--n-prompts", "0", "--json", "{out}"], "--n-prompts 0"),
    ("eval.bench", ["--target", "{model}", "--gamma", "x"], "invalid int value"),
    ("eval.bench", ["--target", "{model}", "--device", "tpu", "--json", "{out}"], "--device tpu"),
    ("eval.cost_profile", [], "required"),
    ("eval.cost_profile", ["--target-config", "{tmp}/nowhere", "--draft-config", "{tmp}/nowhere", "--out", "{out}"],
     "nowhere"),
    ("eval.learning_curve", ["--out", "{out}"], "drafts"),
    ("eval.learning_curve", ["{tmp}/nowhere", "--out", "{out}"], "no speculative.json"),
    ("eval.learning_curve", ["{tmp}/export", "--out", "{out}", "--bogus"], "unrecognized arguments"),
    ("eval.arms", ["{tmp}/nowhere"], "--out"),
    ("eval.arms", ["{tmp}/export", "--out", "{out}"], "no speculative.json"),
    ("data.bench_collect", ["--prompts", "0"], "--prompts 0"),
    ("data.bench_collect", ["--prompts-file", "{tmp}/none.jsonl"], "is not a file"),
    ("data.bench_collect", ["collect.batch_size=[oops"], "bad configuration"),
    ("data.bench_collect", ["no_such_key=1"], "bad configuration"),
    ("data.bench_collect", ["collect.batch_size=0"], "batch_size"),
]


@pytest.mark.parametrize("module, args, needle", CASES, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(CASES)])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, module, args, needle):
    model, out = config_only_model(tmp_path / "model"), tmp_path / "out" / "result"
    empty_export(tmp_path / "export")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = run_tool(module, *[a.format(tmp=tmp_path, model=model, out=out) for a in args], cwd=tmp_path)
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert needle in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written anywhere
    assert not out.parent.exists()


@pytest.mark.parametrize("module", ["eval.learning_curve", "eval.arms"])
def test_an_out_path_that_is_a_file_is_refused(tmp_path, module):
    out = tmp_path / "report.md"
    out.write_text("mine")
    done = run_tool(module, tmp_path / "nowhere", "--out", out, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "is a file" in done.stderr and out.read_text() == "mine"
