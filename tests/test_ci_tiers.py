"""A tier whose component is missing skips with its reason where a person runs the suite and fails the
run, in one line, under ``CI=true`` (tests/conftest.py ``missing_component``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

NEEDS_A_TOOL = """\
from tests.conftest import missing_component


def test_needs_the_frobnicator():
    missing_component("frobnicator is not installed (make frobnicate installs it)")
"""


def run_pytest(folder: Path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(ROOT)}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", "-p", "no:xdist", str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci, fails", [(None, False), ("true", True)])
def test_a_missing_component_skips_locally_and_fails_under_ci(tmp_path, ci, fails):
    (tmp_path / "test_tool.py").write_text(NEEDS_A_TOOL)
    result = run_pytest(tmp_path, ci)
    reason = "frobnicator is not installed (make frobnicate installs it)"
    if fails:
        assert result.returncode == 1, result.stdout
        failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
        assert failed == [f"FAILED test_tool.py::test_needs_the_frobnicator - Failed: CI=true and {reason}"], result.stdout
        assert "Traceback" not in result.stdout and "def test_needs" not in result.stdout  # the line, no trace
    else:
        assert result.returncode == 0 and "1 skipped" in result.stdout and reason in result.stdout, result.stdout
