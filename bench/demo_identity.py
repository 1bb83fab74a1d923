"""Whether a change kept every row and weight: the demo (`gndpo -q demo`, the toy from the user's cache)
run with REV's code and with this checkout's, every committed Parquet shard and exported model compared
by sha256. A refactor that claims to change no computation must leave them equal on one machine.

    .venv/bin/python bench/demo_identity.py --before 6262a7f    # results/demo_identity.{json,md}

REV's code runs from a temporary worktree put first on PYTHONPATH as the package ``gndpo``; both demos
use this checkout's environment and the same cached toy.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, save_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def demo(folder: Path, pythonpath: str | None) -> float:
    """Seconds `gndpo -q demo folder` took, with ``pythonpath`` first on the path (another revision's code)."""
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    start = time.time()
    subprocess.run([sys.executable, "-m", "gndpo", "-q", "demo", str(folder)], check=True, env=env, cwd=folder.parent,
                   stdout=subprocess.DEVNULL)
    return time.time() - start


def digests(run: Path) -> dict[str, str]:
    """{run-relative path: sha256} of every Parquet shard and exported weight file of the run's rounds."""
    files = sorted([*run.glob("rounds/**/*.parquet"), *run.glob("rounds/**/model/*.safetensors")])
    return {str(f.relative_to(run)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def compare(before: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tmp / "tree"), before], check=True)
        try:
            (tmp / "pkg").mkdir()
            (tmp / "pkg" / "gndpo").symlink_to(tmp / "tree")
            seconds = {"before": demo(tmp / "before", str(tmp / "pkg")), "after": demo(tmp / "after", None)}
            old, new = digests(tmp / "before" / "run"), digests(tmp / "after" / "run")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "tree")], check=True)
    differ = sorted(p for p in old.keys() | new.keys() if old.get(p) != new.get(p))
    exports = {p: new[p] for p in new if p.endswith(".safetensors")}
    return {"before": before, "files": len(new), "shards": sum(p.endswith(".parquet") for p in new), "exports": exports,
            "differ": differ, "seconds": seconds, "machine": machine(), "date": time.strftime("%Y-%m-%d")}


def markdown(result: dict) -> str:
    verdict = "every file equal" if not result["differ"] else f"{len(result['differ'])} files differ: {', '.join(result['differ'][:5])}"
    rows = [f"| `{path.split('/')[1]}` export | `{digest[:16]}` |" for path, digest in result["exports"].items()]
    return "\n".join([
        f"The demo with {result['before'][:7]}'s code and with this checkout's, {result['date']}, {result['machine']}: "
        f"{result['shards']} Parquet shards and {len(result['exports'])} exported models compared by sha256, {verdict}.",
        "", "| round | sha256 (both) |", "|---|---|", *rows, "",
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision to compare with")
    result = compare(parser.parse_args().before)
    save_json(RESULTS / "demo_identity.json", result)
    (RESULTS / "demo_identity.md").write_text(markdown(result))
    print(markdown(result))
    sys.exit(1 if result["differ"] else 0)
