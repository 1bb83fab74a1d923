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


def test_readme_stays_short():
    """README.md is the front page: the two commands, the demo, a first config, the node, the links; the rest
    lives in the docs (under 170 lines)."""
    assert len((ROOT / "README.md").read_text().splitlines()) < 170


# -- dates and CPU types only where results live ---------------------------------------------------------------------
# A measurement carries its date and machine on the page that records it: docs/benchmarks/ (what ran, when, on what),
# docs/development/ (the suite's own timings) and CHANGELOG.md. Every other page states what is true now and links there.
MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|Oct(?:ober)?"
         r"|Nov(?:ember)?|Dec(?:ember)?)")
YEAR = r"20\d\d"
TIME_OF_DAY = r"(?:[ T]\d{1,2}:\d\d)"
DATE = re.compile("|".join([
    rf"\b{YEAR}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b(?!{TIME_OF_DAY})",  # 2026-11-29, not a log line's 2026-11-29 12:00:01
    rf"\b{YEAR}-(?:0[1-9]|1[0-2])\b(?![-\d])",  # 2026-11
    rf"\b{YEAR}/\d{{1,2}}/\d{{1,2}}\b|\b\d{{1,2}}/\d{{1,2}}/{YEAR}\b",  # 2026/11/29, 11/29/2026
    rf"\b{MONTH}\.?\s+(?:\d{{1,2}}(?:st|nd|rd|th)?,?\s+)?{YEAR}\b",  # November 2026, Nov 2026, November 29, 2026 (and 29 November 2026)
    rf"\b(?!May\b){MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?\b(?!\s*(?:[KMGT]i?B|%|x)\b)",  # November 29, Nov 29th (not "May 2 ranks")
    rf"\b(?:[Ii]n|[Ss]ince|[Uu]ntil|[Tt]ill|[Bb]efore|[Aa]fter|[Dd]uring|[Aa]s of|[Oo]n|[Ee]arly|[Ll]ate|[Mm]id-?)\s+{YEAR}\b"
    r"(?![.\d])(?!\s*(?:ms|s|min|h|[KMGT]i?B|tokens?|steps?|rows?|%|x)\b)",  # since 2026; not "in 2026 ms", a number
    rf"\bQ[1-4]\s+{YEAR}\b",  # Q4 2026
]))
# CPU families and the vector units that tell them apart here (not GPU names: an H200 is no CPU type).
CPU_TYPE = re.compile(r"\b(?:EPYC|Ryzen|Threadripper|Xeon|Core i[3579]|Graviton|Apple M[1-9]|AVX2|AVX-512|AMX|(?:AMD|Intel|Arm|ARM) (?:CPU|processor)s?)\b")
# The pages that show the demo's table: each may say once which CPU type the table came from.
CPU_NAMED_ONCE = {ROOT / "README.md", ROOT / "docs" / "getting-started" / "demo.md"}


def undated_pages() -> list[Path]:
    """README.md and every docs/ page outside docs/benchmarks/ and docs/development/."""
    docs = ROOT / "docs"
    return [ROOT / "README.md", *(p for p in sorted(docs.rglob("*.md")) if p.relative_to(docs).parts[0] not in ("benchmarks", "development"))]


def dated_lines(text: str) -> list[str]:
    """The lines of ``text`` that carry a date (DATE). What counts as a date:

    * ISO dates, 2026-11-29, and year-months, 2026-11, unless a time of day follows (``2026-11-29 12:00:01
      INFO ...``, ``2026-11-29T12:00``): a log line's timestamp in an example is not a measurement's date;
    * slash dates, 2026/11/29 and 11/29/2026;
    * a month's name or abbreviation (capitalized) with a year or a day: November 2026, Nov 2026, November 29,
      2026, 29 November 2026, Nov 29 (not "Mar 3 GiB"; May only with a year, as "May 2 ranks" is a sentence);
    * a bare year after a word that makes it a time: in, since, until, till, before, after, during, as of, on,
      early, late, mid (since 2026; not "since 2026.1", a version), and Q4 2026.

    A bare year anywhere else is not a date: a citation (Boizard et al., 2024), a version (s3fs 2024.6), a
    number. Times of day alone (``[12:00:01]``) are log lines, not dates. A link's target is an address, not a
    statement: ``[What ran on GPUs](gpu.md#the-device-check-2026-11-28)`` links to a dated heading, and its
    text is what is checked."""
    return [line for line in text.splitlines() if DATE.search(re.sub(r"\]\([^)\s]*\)", "]()", line))]


def test_the_date_pattern_finds_dates_and_spares_log_lines_citations_and_versions():
    dated = ("Measured 2026-11-29 on 2 cores.", "(2026-11-27, AMD EPYC)", "fixed on 2026-11-28", "in November 2026",
             "Nov 2026: the suite", "November 29, 2026", "29 November 2026", "on Nov 29th", "since 2026, before it",
             "until 2026 it did", "2026/11/29", "11/29/2026", "the 2026-11 run", "as of 2026", "Q4 2026",
             "[the 2026-11-28 check](gpu.md#the-device-check)")
    undated = ("2026-11-29 12:00:01 INFO host=node17 rollout r3: committed", "2026-11-23 10:42:07,114 INFO gndpo",
               "2026-11-29T12:00:01Z", "[12:00:01] score r0", "(Boizard et al., 2024): the L1 distance",
               "s3fs 2024.6 or later", "since 2024.6", "2,048 tokens in 2026 ms", "May 2 ranks share it?",
               "the Mar 3 GiB", "a 2048-token response", "gemma3-270m", "vllm==0.32.0",
               "[the check](gpu.md#the-device-check-2026-11-28)")
    for line in dated:
        assert dated_lines(line), line
    for line in undated:
        assert not dated_lines(line), line


def test_no_page_outside_the_results_pages_carries_a_date():
    """README.md and docs/ outside benchmarks/ and development/ say what is true now, without dates: a dated
    measurement or status goes to docs/benchmarks/ (or CHANGELOG.md), and the page links there."""
    found = [f"{page.relative_to(ROOT)}: {line.strip()}" for page in undated_pages() for line in dated_lines(page.read_text())]
    assert not found, "dated lines outside docs/benchmarks/ and docs/development/ (move them there and link):\n" + "\n".join(found)


def test_no_page_outside_the_results_pages_names_cpu_types():
    """A result measured on one CPU type (a table per CPU type, a figure from one machine) belongs in docs/benchmarks/.
    Elsewhere only the pages that show the demo's table, README.md and getting-started/demo.md, name the CPU type it
    came from, once; no other page names a CPU type."""
    found = []
    for page in undated_pages():
        lines = [line.strip() for line in page.read_text().splitlines() if CPU_TYPE.search(line)]
        names = sum(len(CPU_TYPE.findall(line)) for line in lines)
        if names > (1 if page in CPU_NAMED_ONCE else 0):
            found += [f"{page.relative_to(ROOT)}: {line}" for line in lines]
    assert not found, "CPU types named outside docs/benchmarks/ and docs/development/:\n" + "\n".join(found)


# -- measured figures come from their results files ----------------------------------------------------------------
# A block of a page (a paragraph, a list or a table) that quotes measured figures names where they come from on the
# line before it: <!-- figures: bench/results/A.md bench/results/B.json -->. Every decimal number in the block must
# be a number of those files, at the block's precision; a figure the results do not hold (worked out on paper) is
# not quoted in such a block. So a figure edited on a page away from its results file fails here.
FIGURES = re.compile(r"^<!-- figures: (.+?) -->\n", re.M)
DECIMAL = re.compile(r"(?<![\w.\-/])\d+\.\d+(?![\w.])")


def figure_blocks(text: str) -> list[tuple[list[str], str]]:
    """Each marked block of ``text``: (its results files, its text up to the first blank line after it starts)."""
    blocks = []
    for m in FIGURES.finditer(text):
        rest = text[m.end():]
        end = re.search(r"\n\s*\n", rest)
        blocks.append((m.group(1).split(), rest[: end.start() if end else len(rest)]))
    return blocks


def numbers_of(path: Path) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+(?:[eE][-+]?\d+)?", path.read_text())]


def unsourced_figures(text: str) -> list[str]:
    """The decimal numbers of ``text``'s marked blocks that none of the block's results files holds (rounded
    to the number of decimals the page shows), as "file-list: number"."""
    missing = []
    for sources, block in figure_blocks(text):
        held = [n for source in sources for n in numbers_of(ROOT / source)]
        for shown in DECIMAL.findall(block):
            places = len(shown.split(".")[1])
            if not any(round(abs(n), places) == float(shown) for n in held):
                missing.append(f"{' '.join(sources)}: {shown}")
    return missing


def test_quoted_figures_are_their_results_files_figures():
    marked = {doc: figure_blocks(doc.read_text()) for doc in DOCS}
    assert sum(len(blocks) for blocks in marked.values()) >= 5, "too few pages mark where their figures come from"
    for doc, blocks in marked.items():
        for sources, _ in blocks:
            assert all((ROOT / s).is_file() for s in sources), f"{doc.relative_to(ROOT)}: {sources}"
        missing = unsourced_figures(doc.read_text())
        assert not missing, f"{doc.relative_to(ROOT)}: figures not in their results files: {missing}"


def test_a_figure_edited_away_from_its_results_file_is_found():
    readme = (ROOT / "README.md").read_text()
    sources, block = figure_blocks(readme)[0]
    shown = DECIMAL.findall(block)[0]
    edited = readme.replace(block, block.replace(shown, f"{float(shown) + 0.111:.{len(shown.split('.')[1])}f}", 1), 1)
    assert unsourced_figures(readme) == [] and len(unsourced_figures(edited)) == 1


# -- the method a config names is the one the advice gives ---------------------------------------------------------
REWARD_METHODS = {"grpo", "gdpo", "paced"}  # Which method: "they train on a reward" (point 5), not distillation


def advised_methods() -> set[str]:
    """The methods docs/concepts/which-method.md's "In short" gives for distillation from prompts alone:
    the one to start with and the one to run beside it."""
    page = (ROOT / "docs" / "concepts" / "which-method.md").read_text()
    short = page[page.index("## In short"):page.index("\n## ", page.index("## In short") + 1)]
    return set(re.findall(r"\*\*(?:Start with|Run) `(\w+)`", short))


def shown_configs() -> list[tuple[str, dict]]:
    """(where, config) of every example config and every config README shows."""
    import yaml

    configs = [(f"examples/{p.name}", yaml.safe_load(p.read_text())) for p in sorted((ROOT / "examples").glob("*.yaml"))]
    readme = (ROOT / "README.md").read_text()
    configs += [("README.md", yaml.safe_load(block)) for block in re.findall(r"```yaml\n(.*?)```", readme, re.S)]
    return [(where, cfg) for where, cfg in configs if isinstance(cfg, dict) and "method" in cfg]


def test_configs_shown_name_the_method_the_advice_gives():
    """A distillation config in examples/ or README is one of the methods Which method starts with; a
    config that trains on a reward (GRPO, GDPO, PACED) names the reward and the answers it reads."""
    advised = advised_methods()
    assert advised == {"forward_kl", "reverse_kl"}, advised
    shown = shown_configs()
    assert len(shown) >= 5
    for where, cfg in shown:
        name = cfg["method"]["name"]
        if name in REWARD_METHODS:
            assert cfg.get("reward") and cfg.get("data", {}).get("answer_key"), f"{where}: {name} trains on a reward it must name"
        else:
            assert name in advised, f"{where}: method {name}, where Which method gives {sorted(advised)} for distillation"
