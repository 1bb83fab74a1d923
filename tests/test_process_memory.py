"""The bound on what a test leaves resident in its process (tests/process_memory.py): a test above it
fails at its teardown with its name, one below passes, and the run says the largest and which test."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TESTS = '''
import tests.process_memory as bound


def test_light():
    pass


def test_heavy():
    bound.RESIDENT_BOUND_GIB = 0.001  # every Python process holds more than this
'''


def test_a_test_leaving_its_process_above_the_bound_fails_by_name(tmp_path):
    (tmp_path / "test_leaving.py").write_text(TESTS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.process_memory", "-rE",
                           str(tmp_path / "test_leaving.py")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert "2 passed, 1 error" in proc.stdout, proc.stdout  # test_heavy itself passed; its teardown failed
    assert "test_leaving.py::test_heavy left its process at" in proc.stdout and "above the bound of 0.001 GiB" in proc.stdout
    assert "test_light left" not in proc.stdout
    assert "largest resident set after a test:" in proc.stdout and "test_leaving.py::test_" in proc.stdout
