"""The documentation stands on its own: every link and path in README.md, docs/ and examples/ stays
inside the repository and names something that exists."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]


def test_docs_exist():
    for page in ("reference/methods.md", "concepts/run-folder.md", "development/architecture.md", "how-to/rewards.md"):
        assert (ROOT / "docs" / page).exists(), page
    assert (ROOT / "examples" / "slurm" / "stage-workers.sbatch").exists()


def test_links_stay_in_the_repository_and_resolve():
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), f"{doc.name}: link {target} leaves the repository"
            assert path.exists(), f"{doc.name}: link {target} names nothing"


def tracked(suffix: str) -> list[Path]:
    """The repository's files ending in ``suffix`` (what git tracks or would add)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in out.stdout.splitlines() if name.endswith(suffix)]


def test_no_path_points_outside():
    assert len(tracked(".py")) > 50
    for doc in DOCS + tracked(".py") + tracked(".sbatch") + [ROOT / "Makefile"]:
        if doc == Path(__file__).resolve() or not doc.exists():
            continue
        text = doc.read_text()
        for bad in ("../shared", "shared/DESIGN", "shared/ALGORITHMS", "shared/ENVIRONMENT", "/work/"):
            assert bad not in text, f"{doc.relative_to(ROOT)} mentions {bad}"


def test_the_rewards_page_lists_every_built_in_reward():
    """docs/how-to/rewards.md's table names every built-in a config can use, and nothing that is not one."""
    from gndpo.pipeline.tasks.rewards import REWARDS

    page = (ROOT / "docs" / "how-to" / "rewards.md").read_text()
    table = page[page.index("## Built-in rewards"):page.index("## Your own reward")]
    listed = set(re.findall(r"^\| `([a-z_]+)`(?:, `([a-z_]+)`)?", table, re.M))
    assert {name for pair in listed for name in pair if name} == set(REWARDS)
