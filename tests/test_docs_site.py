"""The docs site (mkdocs.yml, docs/), tested with the code.

* The generated reference pages (docs/generate.py: config keys, commands, shard schemas, metrics) are
  what the code gives now; ``python docs/generate.py`` rewrites them.
* ``mkdocs build --strict`` succeeds (a broken link, anchor or nav entry fails it), and the built pages
  hold no raw Markdown; headless Chromium draws the built index and a reference page (not blank).
* Every ```yaml block of README.md and docs/ loads through the config loader (a whole config or a
  fragment of one: the sections it names over the defaults), unless the line before its fence is
  ``<!-- not-a-config -->`` (run.yaml records, manifests, other files' YAML): then it need only parse.
* Every ```bash (or sh, shell) block whose fence follows a ``<!-- runnable -->`` line runs, under
  ``bash -euo pipefail``, in a scratch folder holding the toy models and prompts: ``config.yaml`` (the
  tests' tiny config), ``student/``, ``teacher/``, ``train.jsonl``, ``heldout.jsonl``; one folder per page,
  the page's blocks in order, each within two minutes. Mark only fast commands runnable.
* The metrics page's table (gndpo.pipeline.observe.metrics.METRICS) is the metrics the stages write: a toy
  round's manifests, every stage's summary with every optional branch taken, and every method's
  normalize statistics write only documented keys, and every documented key is written by one of them.
"""

from __future__ import annotations

import html.parser
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import ARTIFACTS, open_in_chromium, tiny_config_dict, write_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNABLE, NOT_A_CONFIG = "<!-- runnable -->", "<!-- not-a-config -->"
SHELLS = ("bash", "sh", "shell")


def generator():
    """docs/generate.py as a module (docs/ is not a package; no __pycache__ is left in docs/)."""
    spec = importlib.util.spec_from_file_location("gndpo_docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    was, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = was
    return module


# -- fenced blocks of the Markdown sources ------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str  # the HTML comment on the line before the fence, or ""
    body: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_sources() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced code block of ``path`` (``` or ~~~, indented ones inside admonitions too)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end])
        blocks.append(Block(path, i + 1, lang.lower(), before if before.startswith("<!--") else "", body + "\n"))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in markdown_sources() for b in fenced_blocks(path)]


def test_the_block_reader_sees_markers_and_indented_fences(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- runnable -->\n```bash\ngndpo --version\n```\n\n!!! note\n    <!-- not-a-config -->\n"
                    "    ```yaml\n    a: 1\n    ```\n\n```\n```yaml\nnot a block\n```\n")
    blocks = fenced_blocks(page)
    assert [(b.lang, b.marker, b.body) for b in blocks] == [
        ("bash", RUNNABLE, "gndpo --version\n"), ("yaml", NOT_A_CONFIG, "a: 1\n"), ("", "", "```yaml\nnot a block\n")]


# -- generated pages -----------------------------------------------------------------------------------------------
def test_generated_reference_pages_are_fresh():
    stale = generator().stale_pages()
    assert not stale, f"stale generated pages {['docs/' + s for s in stale]}: run python docs/generate.py"


def test_the_check_names_a_stale_page(tmp_path, capsys, monkeypatch):
    gen = generator()
    for name in gen.PAGES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DOCS / name, tmp_path / name)
    (tmp_path / "reference" / "metrics.md").write_text("# Metrics\n\nedited by hand\n")
    monkeypatch.setattr(gen, "DOCS", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "stale: docs/reference/metrics.md" in capsys.readouterr().err
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def test_every_shard_column_is_on_the_page():
    from gndpo.stages.text.heldout_eval import EVAL_SCHEMA
    from gndpo.storage.shards import ROLLOUTS, SCORES, STATS

    page = (DOCS / "reference" / "shards.md").read_text()
    for schema in (ROLLOUTS, SCORES, STATS, EVAL_SCHEMA):
        for name in schema.names:
            assert f"| `{name}` |" in page, name
    assert "| `loss_mask` | `list<int8>` | 1 = a token the student generated" in page  # the comment beside the column


# -- the built site ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built by ``mkdocs build --strict`` (into a temporary folder)."""
    out = tmp_path_factory.mktemp("docs-site") / "site"
    mkdocs = Path(sys.executable).with_name("mkdocs")
    assert mkdocs.exists(), "mkdocs is not installed: pip install -e '.[docs]' (make test installs it)"
    proc = subprocess.run([str(mkdocs), "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    problems = [line for line in proc.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not problems, "\n".join(problems) or proc.stderr[-4000:]
    return out


class PageText(html.parser.HTMLParser):
    """The text a reader sees in a built page's article, code, scripts and styles left out."""

    SKIP = ("pre", "code", "script", "style")

    def __init__(self):
        super().__init__()
        self.depth, self.parts, self.headings = 0, [], []

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.depth += 1
        elif tag == "br" or tag in ("p", "li", "td", "th", "h1", "h2", "h3", "h4", "div", "tr"):
            self.parts.append("\n")
        if re.fullmatch(r"h[1-6]", tag):
            self.headings.append(dict(attrs).get("id", ""))

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.depth -= 1

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)

    @classmethod
    def of(cls, path: Path) -> "PageText":
        page = cls()
        page.feed(path.read_text())
        return page

    def text(self) -> str:
        return "".join(self.parts)


def test_mkdocs_build_strict(site):
    for page in ("index.html", "reference/config-keys/index.html", "reference/cli/index.html", "reference/shards/index.html",
                 "reference/metrics/index.html"):
        assert (site / page).is_file(), page
    assert not (site / "generate.py").exists()  # exclude_docs


def test_built_pages_hold_no_raw_markdown(site):
    pages = sorted(site.rglob("index.html"))
    assert len(pages) > 10
    for page in pages:
        text = PageText.of(page).text()
        assert "{%" not in text, f"{page.relative_to(site)}: an include that was not expanded"
        raw = [line for line in text.splitlines() if re.match(r"\s*#{1,6} \S", line) or line.strip().startswith(("```", "|---", "| ---"))]
        assert not raw, f"{page.relative_to(site)}: Markdown left as text: {raw[:3]}"


def test_built_reference_pages_show_every_key_and_command(site):
    import typer.main

    from gndpo.cli.app import app, register
    from gndpo.pipeline.config.schema import config_keys

    keys_page = (site / "reference" / "config-keys" / "index.html").read_text()
    missing = [d.key for d in config_keys() if f"<td><code>{d.key}</code></td>" not in keys_page]
    assert not missing, f"config keys not in a table cell of the built page: {missing[:5]}"
    register()
    headings = set(PageText.of(site / "reference" / "cli" / "index.html").headings)
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        assert command.hidden or f"gndpo-{name}" in headings, name


def not_blank(png: Path) -> None:
    """The screenshot shows a page: many colours, and a good share of pixels unlike the background."""
    import matplotlib.image
    import numpy as np

    pixels = (matplotlib.image.imread(str(png))[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    assert len(colours) > 50, f"{png.name}: {len(colours)} colours (a blank page?)"
    assert 1 - counts.max() / counts.sum() > 0.02, f"{png.name}: {counts.max() / counts.sum():.1%} of the page is one colour"


def test_chromium_draws_the_built_index_and_a_reference_page(site, tmp_path):
    for page, png in (("index.html", "docs-index.png"), ("reference/config-keys/index.html", "docs-config-keys.png")):
        shot = ARTIFACTS / png
        open_in_chromium(site / page, shot)
        not_blank(shot)


# -- YAML blocks ---------------------------------------------------------------------------------------------------
YAML_BLOCKS = [b for b in all_blocks() if b.lang in ("yaml", "yml")]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where() for b in YAML_BLOCKS])
def test_yaml_block_loads_as_a_config(block, tmp_path, monkeypatch):
    from gndpo.pipeline.config.load import load_config

    try:
        data = yaml.safe_load(block.body)
    except yaml.YAMLError as exc:
        pytest.fail(f"{block.where()}: not YAML: {exc}")
    if block.marker == NOT_A_CONFIG:
        return
    assert isinstance(data, dict), f"{block.where()}: a config is a mapping (mark other YAML {NOT_A_CONFIG})"
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the plugin folders to it
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(block.body)
    try:
        load_config(str(tmp_path / "config.yaml"))
    except Exception as exc:  # noqa: BLE001 - the message names the block
        pytest.fail(f"{block.where()}: the config loader refuses it ({exc}); mark YAML that is not a config {NOT_A_CONFIG}")


def test_the_docs_have_yaml_configs():
    assert sum(b.marker != NOT_A_CONFIG for b in YAML_BLOCKS) >= 1


# -- runnable shell blocks -----------------------------------------------------------------------------------------
def runnable_pages() -> dict[Path, list[Block]]:
    pages: dict[Path, list[Block]] = {}
    for b in all_blocks():
        if b.marker == RUNNABLE:
            assert b.lang in SHELLS, f"{b.where()}: only {', '.join(SHELLS)} blocks can be runnable, not {b.lang or 'a bare fence'}"
            pages.setdefault(b.path, []).append(b)
    return pages


def test_runnable_shell_blocks_run_on_the_toy(tmp_path, tiny_assets):
    pages = runnable_pages()
    assert pages, f"no block is marked {RUNNABLE}"
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "gndpo").exists(), "the gndpo console script is not installed beside this Python"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "GNDPO_PROGRESS": "none"}
    for page, blocks in pages.items():
        scratch = tmp_path / page.relative_to(ROOT).with_suffix("").as_posix().replace("/", "-")
        scratch.mkdir()
        for name in ("student", "teacher", "train.jsonl", "heldout.jsonl"):
            (scratch / name).symlink_to(tiny_assets / name)
        cfg = tiny_config_dict(tiny_assets)
        cfg.update(student="student", teacher="teacher", data={"train": "train.jsonl", "heldout": "heldout.jsonl"})
        write_config(scratch, cfg)
        for block in blocks:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.body], cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, f"{block.where()} failed ({proc.returncode}):\n{block.body}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


# -- metrics -------------------------------------------------------------------------------------------------------
def undocumented(stage: str, keys) -> list[str]:
    from gndpo.pipeline.observe.metrics import metric_doc

    return [k for k in keys if metric_doc(stage, k) is None]


def method_configs() -> list[dict]:
    """A method section per method, and the settings that add statistics (modifiers, GDPO's token mode,
    TrOPD's quantile)."""
    from gndpo.pipeline.methods import METHODS

    return [*({"name": n} for n in METHODS), {"name": "gdpo", "outcome": {"gdpo_batch_norm": "token"}},
            {"name": "tropd", "tropd": {"tau_quantile": 0.5}},
            {"name": "gndpo", "tip": {"enabled": True}, "reward_beta": 1.0, "paced": {"enabled": True}, "outcome": {"coef": 0.5}}]


def normalize_metrics(method: dict) -> dict:
    """Normalize's metrics for ``method`` over a small synthetic round (shards of the real schemas), the
    statistics composed as NormalizeJob.run_unit composes them."""
    import duckdb
    import pyarrow as pa

    from gndpo.pipeline.config.schema import config_from_dict
    from gndpo.pipeline.methods import method_statistics
    from gndpo.pipeline.methods.base import StatsQuery
    from gndpo.stages.normalize import NormalizeJob, create_views, rollout_figures, score_moments
    from gndpo.storage.shards import ROLLOUTS, scores_schema

    cfg = config_from_dict({"method": method})
    rollouts, scores = [], []
    for i in range(8):
        rid, pid, n = f"r{i}", f"p{i // 2}", 3 + i % 2
        reward = float(i % 3 == 0)
        rollouts.append({"rollout_id": rid, "prompt_id": pid, "sample_idx": i % 2, "round": 0, "policy_version": 0, "prompt_token_ids": [1, 2],
                         "response_token_ids": list(range(n)), "loss_mask": [1] * n, "teacher_prefix_len": 0, "sampler_logprobs": [-1.0] * n,
                         "finish_reason": "length" if i % 4 == 0 else "stop", "num_turns": 1, "tool_calls": [], "reward": reward,
                         "rewards": [("exact_match", reward)], "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4, "seed": i,
                         "logprobs_mode": "raw", "prompt": "1+1=", "response": "2"})
        lp_t, lp_s = [-0.5 - 0.1 * t - 0.05 * i for t in range(n)], [-0.7 + 0.05 * t for t in range(n)]
        c = [max(min(a - b, 5.0), -5.0) for a, b in zip(lp_t, lp_s)]
        scores.append({"rollout_id": rid, "prompt_id": pid, "teacher_logprobs": lp_t, "student_logprobs": lp_s, "n_valid": n, "c_sum": sum(c),
                       "c_sq_sum": sum(x * x for x in c), "c_min": min(c), "c_max": max(c), "teacher": "t",
                       "teacher_topk_ids": [[0, 1]] * n, "teacher_topk_logprobs": [[-0.5, -1.5]] * n, "teacher_rest_logprob": [-2.0] * n,
                       "teacher_entropy": [0.5 + 0.1 * t for t in range(n)], "student_entropy": [0.3 + 0.2 * t + 0.01 * i for t in range(n)],
                       "token_kl": [0.1 * t + 0.02 * i for t in range(n)], "aligned": None})
    con = duckdb.connect()
    con.register("rollout_rows", pa.Table.from_pylist(rollouts, schema=ROLLOUTS))
    con.register("score_rows", pa.Table.from_pylist(scores, schema=scores_schema(2)))
    kept_rollouts, kept_scores = create_views(con, "rollout_rows", "score_rows", cfg)
    stats = score_moments(con, kept_scores)
    stats.update(rollout_figures(con, "rollout_rows"))
    stats.update(method_statistics(StatsQuery(con), cfg.method, 0)[0])
    return NormalizeJob.summarize(None, [{"stats": stats, "seconds": 1.0}])


def every_branch_metrics() -> dict[str, set[str]]:
    """{stage: the keys its summarize writes} with every optional figure present in the commits (an
    evaluated held-out unit, tools, the engine probe, entropies, cross-tokenizer counts, an EMA teacher)
    and, for normalize, every method's statistics."""
    from gndpo.stages.rollout import RolloutJob
    from gndpo.stages.score import ScoreJob
    from gndpo.stages.train import TrainJob
    from gndpo.storage.records import EVAL_UNIT

    conversation = {"llm_tokens": 10, "tool_tokens": 2, "turns_sum": 4, "turns_min": 1, "turns_max": 2, "tool_calls": 1, "tool_errors": 0}
    probe = {"engine_probe_gap_max": 0.0, "engine_probe_gap_mean": 0.0, "engine_reloaded": 1, "engine_restarted": 0, "engine_adapters": 1}
    rollout = RolloutJob.summarize(types.SimpleNamespace(round=0), [
        {"unit": "u00000", "prompts": 2, "responses": 4, "tokens": 12, "reward_sum": 1.0, "seconds": 1.0, "engine_dtype_bits": 32,
         **conversation, **probe},
        {"unit": EVAL_UNIT, "seconds": 1.0, "eval": {"accuracy": 0.5, "n": 2}}])
    score_commit = {"unit": "u00000", "tokens": 12, "seconds": 1.0, "student_tokens": 10, "student_from_engine": 0, "student_entropy_sum": 3.0,
                    "teacher_entropy_sum": 2.0, "logprob_diff_sum": 0.1, "logprob_diff_max": 0.05, "unaligned_tokens": 1, "split_span_tokens": 1}
    score = ScoreJob.summarize(types.SimpleNamespace(cfg=types.SimpleNamespace(score=types.SimpleNamespace(cross_tokenizer=True))), [
        score_commit, {"unit": EVAL_UNIT, "seconds": 1.0, "eval": {"reverse_kl": 0.1, "teacher_logprob": -1.0, "prompts": 2}}])
    step = {"loss": 0.1, "grad_norm": 1.0, "clip_fraction": 0.0, "ratio_mean": 1.0, "lr": 1e-3}
    train = TrainJob.summarize(types.SimpleNamespace(round=0), [
        {"steps": [step, step], "model_dir": "rounds/r0000/train/data/update/a001/model", "ema_dir": "rounds/r0000/train/data/update/a001/ema",
         "adv_min": -1.0, "adv_max": 1.0, "adv_mean": 0.0, "adv_std": 1.0, "divergence": "forward_kl", "tokens": 12, "seconds": 2.0}])
    normalize = set().union(*(normalize_metrics(m) for m in method_configs()))
    return {"rollout": set(rollout), "score": set(score), "normalize": normalize, "train": set(train)}


def test_every_metric_a_stage_can_write_is_documented():
    for stage, keys in every_branch_metrics().items():
        assert not undocumented(stage, keys), f"{stage} writes metrics METRICS (pipeline/observe/metrics.py) does not document: " \
                                              f"{undocumented(stage, keys)}; then run python docs/generate.py"


def test_every_documented_metric_is_written():
    from gndpo.pipeline.observe.metrics import METRICS

    written = every_branch_metrics()
    stale = [(m.stage, m.name) for m in METRICS if m.stage != "every" and m.name not in written[m.stage]]
    assert not stale, f"METRICS documents metrics no stage writes: {stale}"


def test_the_documented_phases_are_the_phases_in_the_code():
    from gndpo.pipeline.observe.metrics import PHASES
    from gndpo.storage.meter import COMPUTE, WRITE

    used = {COMPUTE, WRITE}
    for folder in ("storage", "pipeline", "stages", "apps"):
        for path in (ROOT / folder).rglob("*.py"):
            used |= set(re.findall(r"\bphase\(\"(\w+)\"\)", path.read_text()))
    assert used == set(PHASES)


@pytest.mark.slow
def test_a_toy_round_writes_only_documented_metrics(tmp_path, tiny_assets):
    """A whole toy round (`gndpo run`, in this process): every key of every manifest is on the metrics page."""
    from gndpo.pipeline.run.run import open_run
    from gndpo.storage.records import STAGES
    from tests.conftest import invoke_ok

    run = tmp_path / "run"
    invoke_ok("init", run, "--config", write_config(tmp_path, tiny_config_dict(tiny_assets)))
    invoke_ok("--quiet", "run", run, "--rounds", 1)
    page = (DOCS / "reference" / "metrics.md").read_text()
    opened = open_run(str(run))
    for stage in STAGES:
        metrics = opened.records(0, stage).require_manifest()["metrics"]
        assert metrics and not undocumented(stage, metrics), f"{stage}: {undocumented(stage, metrics)}"
        for key in metrics:
            name = re.sub(r"^phase_\w+?_(seconds|bytes)$", r"phase_<phase>_\1", key)
            assert f"| `{name}` |" in page, f"{stage} metric {key} is not on docs/reference/metrics.md"
