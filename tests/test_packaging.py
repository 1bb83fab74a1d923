"""The four code folders install as gndpo.* in a regular (non-editable) wheel, with the console script."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_maps_folders_to_gndpo_packages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("gndpo-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("cli/app.py", "pipeline/units.py", "stages/train.py", "storage/runfs.py", "pipeline/demo.yaml"):
        assert f"gndpo/{module}" in names
    assert not any(n.startswith(("cli/", "storage/", "tests/", "gndpo/tests/")) for n in names)
    # Install it on its own and import from there, not from the source tree.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True, capture_output=True)
    out = subprocess.run(
        [sys.executable, "-c", "import gndpo.cli.app, gndpo.storage.runfs; print(gndpo.storage.runfs.__file__)"],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().startswith(str(target))
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gndpo = gndpo.cli.app:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
