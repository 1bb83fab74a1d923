"""The docs site (mkdocs.yml, docs/), tested with the code.

* The generated reference pages (docs/generate.py: config keys, commands, shard schemas, metrics) are
  what the code gives now; ``python docs/generate.py`` rewrites them.
* ``mkdocs build --strict`` succeeds (a broken link, anchor or nav entry fails it), and the built pages
  hold no raw Markdown; headless Chromium draws the built index and a reference page (not blank).
* The built site works opened from disk (file://, as README says: ``make docs``, then site/index.html):
  in headless Chromium a click on a nav link opens the page it names, and the config-keys table keeps
  every key on one line.
* Every ```yaml block of README.md and docs/ loads through the config loader (a whole config or a
  fragment of one: the sections it names over the defaults), unless the line before its fence is
  ``<!-- not-a-config -->`` (run.yaml records, manifests, other files' YAML): then it need only parse.
* Every ```bash (or sh, shell) block whose fence follows a ``<!-- runnable -->`` line runs, under
  ``bash -euo pipefail``, in a scratch folder holding the toy models and prompts: ``config.yaml`` (the
  tests' tiny config), ``student/``, ``teacher/``, ``train.jsonl``, ``heldout.jsonl``, and the page's
  blocks marked ``<!-- file: NAME -->`` as files; one folder per page, the page's blocks in order, each
  within three minutes. ``<!-- runnable: ITEMS -->`` runs a block written for real models and sizes
  with the toy's swapped in (:func:`on_the_toy`). Mark only fast commands runnable.
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

from gndpo.pipeline.run.products import RolloutNumbers, ScoreNumbers, StatsNumbers, TrainNumbers
from gndpo.storage.products import Commit, UnitKind, UnitNumbers
from tests.conftest import ARTIFACTS, open_in_chromium, tiny_config_dict, write_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNABLE, RUNNABLE_WITH, NOT_A_CONFIG = "<!-- runnable -->", "<!-- runnable:", "<!-- not-a-config -->"
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


def built_pages(site: Path) -> list[Path]:
    """Every page built from docs/ (one NAME.html per NAME.md: use_directory_urls is off), the theme's
    404 page and its assets left out."""
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html" and p.relative_to(site).parts[0] != "assets")


def test_mkdocs_build_strict(site):
    for page in ("index.html", "reference/config-keys.html", "reference/cli.html", "reference/shards.html", "reference/metrics.html"):
        assert (site / page).is_file(), page
    assert not (site / "reference" / "config-keys").exists()  # NAME.html, not NAME/index.html
    # Search from disk: the offline plugin writes the index as a script too, which a page opened from
    # file:// reads (its worker through docs/javascripts/iframe-worker.js).
    assert (site / "search" / "search_index.js").read_text().startswith("var __index = ")
    assert not (site / "generate.py").exists()  # exclude_docs


def test_no_page_loads_a_script_from_another_host(site):
    for page in built_pages(site):
        remote = re.findall(r'<script[^>]*\ssrc="((?:https?:)?//[^"]*)"', page.read_text())
        assert not remote, f"{page.relative_to(site)} loads {remote}"


SEARCH_PROBE = """<pre id="search-answer"></pre><script>
window.addEventListener("load", () => {
  const input = document.querySelector("input.md-search__input"), answer = document.getElementById("search-answer");
  let tries = 0;
  const look = () => {
    const hits = document.querySelectorAll(".md-search-result__item").length;
    if (hits || ++tries > 60) {
      answer.textContent = JSON.stringify({hits: hits, first: (document.querySelector(".md-search-result__item") || {}).textContent || ""});
      return;
    }
    input.focus();
    input.value = "%s";  // typed again until the search worker is up
    input.dispatchEvent(new Event("input", {bubbles: true}));
    input.dispatchEvent(new KeyboardEvent("keyup", {bubbles: true, key: "e"}));
    setTimeout(look, 150);
  };
  look();
});
</script></body>"""


@pytest.mark.parametrize("shim", [True, False], ids=["as-built", "without-the-worker-shim"])
def test_search_finds_a_page_in_the_site_opened_from_disk(site, tmp_path, shim):
    """A query typed into the search box of the built index opened from file:// (no server, no network,
    no flag that relaxes file:// in Chromium) lists pages; without docs/javascripts/iframe-worker.js the
    same page lists none: a browser starts no Web Worker from file://."""
    import json

    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    index = copy / "index.html"
    text = index.read_text().replace("</body>", SEARCH_PROBE % "staleness", 1)
    if not shim:
        text = re.sub(r'<script src="[^"]*iframe-worker\.js"></script>', "", text)
    index.write_text(text)
    dom = chromium_dom(index.as_uri(), tmp_path)
    found = json.loads(html.unescape(re.search(r'<pre id="search-answer">(.*?)</pre>', dom, re.S).group(1)))
    if shim:
        assert found["hits"] > 0 and "staleness" in found["first"].lower(), found
    else:
        assert found["hits"] == 0, found


def test_built_pages_hold_no_raw_markdown(site):
    pages = built_pages(site)
    assert len(pages) > 10
    for page in pages:
        text = PageText.of(page).text()
        assert "{%" not in text, f"{page.relative_to(site)}: an include that was not expanded"
        raw = [line for line in text.splitlines() if re.match(r"\s*#{1,6} \S", line) or line.strip().startswith(("```", "|---", "| ---"))]
        assert not raw, f"{page.relative_to(site)}: Markdown left as text: {raw[:3]}"


def test_built_reference_pages_show_every_key_and_command(site):
    import typer.main

    from gndpo.cli.app import app, register
    from gndpo.pipeline.config.keys import config_keys

    keys_page = (site / "reference" / "config-keys.html").read_text()
    missing = [d.key for d in config_keys() if f"<td><code>{d.key}</code></td>" not in keys_page]
    assert not missing, f"config keys not in a table cell of the built page: {missing[:5]}"
    register()
    headings = set(PageText.of(site / "reference" / "cli.html").headings)
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        assert command.hidden or f"gndpo-{name}" in headings, name


def not_blank(png: Path) -> None:
    """The screenshot shows a page: many colours, and a good share of pixels unlike the background."""
    import matplotlib.image
    import numpy as np

    rgb = (matplotlib.image.imread(str(png))[..., :3] * 255).astype(np.uint8).reshape(-1, 3).astype(np.uint32)
    # One integer per pixel: np.unique over rows sorts millions of 3-byte rows (6 s a screenshot).
    colours, counts = np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2], return_counts=True)
    assert len(colours) > 50, f"{png.name}: {len(colours)} colours (a blank page?)"
    assert 1 - counts.max() / counts.sum() > 0.02, f"{png.name}: {counts.max() / counts.sum():.1%} of the page is one colour"


def test_chromium_draws_the_built_index_and_a_reference_page(site, tmp_path):
    for page, png in (("index.html", "docs-index.png"), ("reference/config-keys.html", "docs-config-keys.png")):
        shot = ARTIFACTS / png
        open_in_chromium(site / page, shot)
        not_blank(shot)


def chromium_dom(url: str, scratch: Path, *flags: str) -> str:
    """The DOM of ``url`` in headless Chromium (``--dump-dom``) once its scripts have run for up to 10 s of
    virtual time. Skips where Chromium is absent, or fails under CI, as :func:`open_in_chromium` does."""
    from tests.conftest import missing_component

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        missing_component("chromium is not installed (make test installs Debian's package)")
    profile = scratch / f".chromium-{os.getpid()}"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=10000", *flags, "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )
    shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0 and "<body" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


HARNESS = """<!doctype html><html><body><pre id="out">no answer</pre>
<iframe id="page" src="{src}" style="width:1280px;height:2000px;border:0"></iframe>
<script>
const frame = document.getElementById("page"), out = document.getElementById("out");
let loads = 0, state = {{}};
frame.addEventListener("load", () => {{ const d = frame.contentDocument, w = frame.contentWindow; loads += 1; {body} }});
</script></body></html>
"""


def in_a_frame(page: Path, body: str, scratch: Path) -> dict:
    """Open ``page`` from disk in a 1280-pixel-wide iframe of a harness page in headless Chromium and run
    ``body`` (JavaScript) on each load of the frame, with the frame's document as ``d``, its window as
    ``w``, the load's number as ``loads`` and ``state``, an object kept across loads; the answer is the
    JSON ``body`` writes into ``out.textContent``. The harness, a file itself, reads the framed file:// page by Chromium's
    ``--allow-file-access-from-files``."""
    import json

    harness = scratch / "harness.html"
    harness.write_text(HARNESS.format(src=page.resolve().as_uri(), body=body))
    dom = chromium_dom(harness.as_uri(), scratch, "--allow-file-access-from-files")
    answer = html.unescape(re.search(r'<pre id="out"[^>]*>(.*?)</pre>', dom, re.S).group(1))
    assert answer != "no answer", f"the harness got no answer from {page.name}"
    return json.loads(answer)


class Links(html.parser.HTMLParser):
    """The href of every ``<a>`` whose class holds ``css_class``."""

    def __init__(self, css_class: str):
        super().__init__()
        self.css_class, self.hrefs = css_class, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "a" and self.css_class in (attrs.get("class") or "").split() and attrs.get("href"):
            self.hrefs.append(attrs["href"])


def test_the_site_opened_from_disk_follows_a_nav_link_to_its_page(site, tmp_path):
    """The built site works from disk, where README sends a reader (site/index.html, file://). From
    Chromium's DOM of index.html: every nav link is a relative link to a NAME.html file that exists (a
    link to a folder, as mkdocs' directory URLs write, opens a directory listing from disk). Then a real
    click: index.html in a frame, a click on its "Config keys" nav link, and the page that loads must be
    reference/config-keys.html rendered (its H1, its table of keys), not a listing."""
    from urllib.parse import urlsplit

    index = site / "index.html"
    links = Links("md-nav__link")
    links.feed(chromium_dom(index.resolve().as_uri(), tmp_path))
    pages = {href.split("#")[0] for href in links.hrefs} - {""}  # a page's own headings link as #anchor
    for href in pages:
        assert not urlsplit(href).scheme and not href.startswith("/"), f"nav link {href} is not relative"
        assert href.endswith(".html") and (site / href).is_file(), f"nav link {href} names no page file"
    assert pages == {p.relative_to(site).as_posix() for p in built_pages(site)}  # every page is in the nav
    opened = in_a_frame(index, """
        if (loads === 1) {
          const link = [...d.querySelectorAll("a.md-nav__link")].find(a => a.textContent.trim() === "Config keys");
          if (!link) { out.textContent = JSON.stringify({error: "no Config keys nav link"}); return; }
          state.href = link.getAttribute("href");
          link.click();
          return;
        }
        out.textContent = JSON.stringify({href: state.href, url: w.location.href, h1: (d.querySelector("h1") || {}).textContent || "",
                                          keys: d.querySelectorAll("td:first-child code").length});""", tmp_path)
    assert opened.get("href") == "reference/config-keys.html", opened
    assert opened["url"] == (site / "reference" / "config-keys.html").resolve().as_uri(), opened
    assert opened["h1"].startswith("Config keys") and opened["keys"] > 100, opened


def test_config_key_names_stay_whole_in_the_table(site, tmp_path):
    """docs/stylesheets/extra.css: the theme breaks code anywhere, and a narrow first column cut keys
    mid-word ("self_teache" / "r.weights"); at a 1280-pixel window no key of the config-keys table
    takes more than one line."""
    keys = in_a_frame(site / "reference" / "config-keys.html", """
        const names = [...d.querySelectorAll(".md-typeset td:first-child code")];
        out.textContent = JSON.stringify({names: names.length, broken: names.filter(c => c.getClientRects().length > 1).map(c => c.textContent)});""",
        tmp_path)
    assert keys["names"] > 100 and not keys["broken"], keys


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
        if b.marker == RUNNABLE or b.marker.startswith(RUNNABLE_WITH):
            assert b.lang in SHELLS, f"{b.where()}: only {', '.join(SHELLS)} blocks can be runnable, not {b.lang or 'a bare fence'}"
            pages.setdefault(b.path, []).append(b)
    return pages


def page_files(page: Path) -> dict[str, str]:
    """{name: text} of the page's blocks marked ``<!-- file: NAME -->``: written where its runnable blocks run."""
    marked = [(re.fullmatch(r"<!-- file: (\S+) -->", b.marker), b.body) for b in fenced_blocks(page)]
    return {m.group(1): body for m, body in marked if m}


def on_the_toy(block: Block) -> str:
    """``block``'s commands as the test runs them: a ``<!-- runnable: ITEMS -->`` marker swaps models and
    sizes for the toy's. An item ``key=value`` is a setting added to every ``gndpo init`` line (a later
    setting of a key wins); ``--opt=value`` sets the value of a ``gndpo`` line's ``--opt``, and a bare
    ``--opt`` removes that option and its value."""
    if not block.marker.startswith(RUNNABLE_WITH):
        return block.body
    items = block.marker[len(RUNNABLE_WITH):].removesuffix("-->").split()
    settings = [i for i in items if not i.startswith("--")]
    lines = []
    for line in block.body.splitlines():
        if line.lstrip().startswith("gndpo "):
            line = re.sub(r"\s+#.*$", "", line)
            for item in (i for i in items if i.startswith("--")):
                option, _, value = item.partition("=")
                line = re.sub(rf"\s{re.escape(option)}\s+\S+", f" {option} {value}" if value else "", line)
            if line.lstrip().startswith("gndpo init "):
                line = " ".join([line, *settings])
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_a_runnable_marker_swaps_models_and_sizes(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- file: a.yaml -->\n```yaml\nstudent: x\n```\n\n"
                    "<!-- runnable: student=s rollout.n=2 --rounds=1 --gpus -->\n```bash\n"
                    "gndpo init runs/a --config a.yaml   # checks\ngndpo run runs/a --rounds 10 --gpus 8\necho --rounds 3\n```\n")
    assert page_files(page) == {"a.yaml": "student: x\n"}
    assert on_the_toy(fenced_blocks(page)[1]) == ("gndpo init runs/a --config a.yaml student=s rollout.n=2\n"
                                                  "gndpo run runs/a --rounds 1\necho --rounds 3\n")


def test_a_page_copy_of_a_repository_file_is_that_file():
    """A page block marked ``<!-- file: NAME -->`` whose NAME is a file of the repository (an example
    config the page walks through) is that file's text, so the page shows what the suite runs."""
    copies = [(page, name, text) for page in (ROOT / "docs").rglob("*.md") for name, text in page_files(page).items() if (ROOT / name).is_file()]
    assert copies, "no page shows a repository file"
    for page, name, text in copies:
        assert text == (ROOT / name).read_text(), f"{page.relative_to(ROOT)}: its copy of {name} differs from the file"


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
        for name, text in page_files(page).items():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            (scratch / name).write_text(text)
        for block in blocks:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", on_the_toy(block)], cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=180)
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

    from gndpo.pipeline.config.load import config_from_dict
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
    return NormalizeJob.summarize(None, [unit_commit("stats", StatsNumbers, stats=stats, seconds=1.0)])


def unit_commit(unit: str, numbers: type[UnitNumbers], heldout: bool = False, **values) -> Commit:
    """A committed unit (a held-out evaluation's with ``heldout``) whose own numbers, of type
    ``numbers``, are ``values`` (what a stage's summarize reads)."""
    return Commit(unit, 1, [], 0, 0, 0.0, numbers.of(values), UnitKind.HELDOUT_EVAL if heldout else UnitKind.WORK)


def every_branch_metrics() -> dict[str, set[str]]:
    """{stage: the keys its summarize writes} with every optional figure present in the commits (an
    evaluated held-out unit, tools, the engine probe, entropies, cross-tokenizer counts, an EMA teacher)
    and, for normalize, every method's statistics."""
    from gndpo.stages.rollout import RolloutJob
    from gndpo.stages.score import ScoreJob
    from gndpo.stages.train import TrainJob
    conversation = {"llm_tokens": 10, "tool_tokens": 2, "turns_sum": 4, "turns_min": 1, "turns_max": 2, "tool_calls": 1, "tool_errors": 0}
    probe = {"engine_probe_gap_max": 0.0, "engine_probe_gap_mean": 0.0, "engine_reloaded": 1, "engine_restarted": 0, "engine_adapters": 1}
    rollout = RolloutJob.summarize(types.SimpleNamespace(round=0, version=0), [
        unit_commit("u00000", RolloutNumbers, prompts=2, responses=4, tokens=12, reward_sum=1.0, seconds=1.0, engine_dtype_bits=32, **conversation, **probe),
        unit_commit("eval-heldout", RolloutNumbers, heldout=True, seconds=1.0, eval={"accuracy": 0.5, "n": 2})])
    score_commit = unit_commit("u00000", ScoreNumbers, tokens=12, seconds=1.0, student_tokens=10, student_from_engine=0, student_entropy_sum=3.0,
                               teacher_entropy_sum=2.0, logprob_diff_sum=0.1, logprob_diff_max=0.05, unaligned_tokens=1, split_span_tokens=1,
                               server_retries=2, server_cooldowns=1)
    score = ScoreJob.summarize(types.SimpleNamespace(cfg=types.SimpleNamespace(score=types.SimpleNamespace(cross_tokenizer=True))), [
        score_commit, unit_commit("eval-heldout", ScoreNumbers, heldout=True, seconds=1.0, eval={"reverse_kl": 0.1, "teacher_logprob": -1.0, "prompts": 2})])
    step = {"loss": 0.1, "grad_norm": 1.0, "clip_fraction": 0.0, "ratio_mean": 1.0, "lr": 1e-3}
    train = TrainJob.summarize(types.SimpleNamespace(round=0, run=types.SimpleNamespace(sampling_version=lambda r: r)), [
        unit_commit("update", TrainNumbers, steps=[step, step], model_dir="rounds/r0000/train/data/update/a001/model",
                    ema_dir="rounds/r0000/train/data/update/a001/ema",
                    adv_min=-1.0, adv_max=1.0, adv_mean=0.0, adv_std=1.0, divergence="forward_kl", tokens=12, seconds=2.0)])
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
    from gndpo.stages.registry import STAGE_REGISTRY
    from tests.conftest import invoke_ok

    run = tmp_path / "run"
    invoke_ok("init", run, "--config", write_config(tmp_path, tiny_config_dict(tiny_assets)))
    invoke_ok("--quiet", "run", run, "--rounds", 1)
    page = (DOCS / "reference" / "metrics.md").read_text()
    opened = open_run(str(run))
    for stage in STAGE_REGISTRY:
        metrics = opened.records(0, stage).require_manifest().metrics
        assert metrics and not undocumented(stage, metrics), f"{stage}: {undocumented(stage, metrics)}"
        for key in metrics:
            name = re.sub(r"^phase_\w+?_(seconds|bytes)$", r"phase_<phase>_\1", key)
            assert f"| `{name}` |" in page, f"{stage} metric {key} is not on docs/reference/metrics.md"
