"""``gndpo report``: one self-contained HTML page (plus its PNGs) on how a run, or a comparison, went.

The page holds per-round curves (held-out accuracy, reward, the teacher KL estimate, grad norm, clip
fraction, response length, entropies, stage times, the timeline of the stages' spans and waits), a token-level view of a few rollouts of the newest
scored round coloured by the teacher-student log-ratio lpT - lpS (red where the teacher finds the
student's token unlikely: where the student goes wrong), and the config. Every figure is embedded in the
HTML (base64), so the one file can be mailed or attached; the same PNGs are written beside it.

It reads a run folder, a demo folder (``gndpo demo DIR``: DIR/run, and DIR/eval for the final student's
accuracy) or a comparison folder (``gndpo compare --out DIR``: one line per method in every plot; with
``--seeds``, the mean over seeds with a band from the lowest to the highest seed).
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gndpo.apps.recipe import recipe_stages
from gndpo.errors import GndpoError
from gndpo.pipeline.exec.status import phase_rows, round_seconds, stage_table
from gndpo.pipeline.observe.metrics import collect_metrics, committed_rounds
from gndpo.pipeline.run.images import RunImages, image_ids
from gndpo.pipeline.run.products import POLICY, ROLLOUTS, ROUND, SCORES
from gndpo.pipeline.run.run import open_run
from gndpo.stages.models.loading import load_tokenizer
from gndpo.storage.duck import connect, parquet_source
from gndpo.storage.tables import write_file

# (file name, title, y label, [(stage, metric, legend suffix)]): one figure each.
CURVES = [
    # The y label is the run's reward (see heldout_label): "exact match" only where that is the reward.
    ("accuracy", "Held-out score (greedy) per policy version", None, [("rollout", "heldout_accuracy", "")]),
    # Prompts without answers: the label-free held-out measure score computes for each policy version.
    ("heldout_kl", "Held-out KL(student || teacher) estimate per token (sampled responses)", "nats", [("score", "heldout_reverse_kl", "")]),
    ("heldout_teacher_logprob", "Teacher log-prob of the greedy held-out responses", "nats per token",
     [("score", "heldout_teacher_logprob", "")]),
    ("reward", "Sampled reward", "mean reward", [("normalize", "reward_mean", "")]),
    ("teacher_kl", "Teacher KL estimate, KL(student || teacher) per token", "nats", [("normalize", "reverse_kl_estimate", "")]),
    ("grad_norm", "Gradient norm (pre-clip)", "norm", [("train", "grad_norm_mean", " mean"), ("train", "grad_norm_max", " max")]),
    ("clip_fraction", "Clip fraction", "fraction of loss tokens", [("train", "clip_fraction", "")]),
    ("response_length", "Response length", "tokens", [("normalize", "response_length_mean", " mean"), ("normalize", "response_length_max", " max")]),
    ("engine_probe", "Rollout engine vs the exported student (probe batch log-probs)", "|log-prob gap|",
     [("rollout", "engine_probe_gap_max", " max"), ("rollout", "engine_probe_gap_mean", " mean")]),
    ("entropy", "Entropy of sampled tokens", "nats", [("score", "student_entropy_mean", " student"), ("score", "teacher_entropy_mean", " teacher")]),
]
STAGE_ORDER = tuple(product.stage for product in ROUND)
TOKEN_VIEW_ROWS = 4
RATIO_SCALE = 3.0  # |lpT - lpS| at which a token's colour is fully saturated


@dataclass
class Series:
    """One run's metrics, as the report draws them; or, with ``members`` (one method's runs over several
    seeds), their mean per round and stage, the config and token view of the first seed."""

    label: str
    url: str
    rows: list[dict]
    final_accuracy: float | None = None
    by: dict = field(default_factory=dict)
    members: list[Series] = field(default_factory=list)

    def __post_init__(self):
        self.by = {(m["round"], m["stage"]): m for m in self.rows}

    def values(self, stage: str, metric: str) -> tuple[list[int], list[float]]:
        if self.members:
            x, per_member = self._member_values(stage, metric)
            return x, [float(np.mean(v)) for v in per_member]
        points = [(r, m[metric]) for (r, s), m in sorted(self.by.items()) if s == stage and isinstance(m.get(metric), (int, float))]
        if stage == ROLLOUTS.stage and metric == "heldout_accuracy" and self.final_accuracy is not None and points:
            points.append((max(r for r, s in self.by if s == POLICY.stage) + 1, self.final_accuracy))
        return [p[0] for p in points], [float(p[1]) for p in points]

    def spread(self, stage: str, metric: str) -> tuple[list[int], list[float], list[float]]:
        """(rounds, lowest, highest) over the members; empty for a single run."""
        x, per_member = self._member_values(stage, metric)
        return x, [min(v) for v in per_member], [max(v) for v in per_member]

    def _member_values(self, stage: str, metric: str) -> tuple[list[int], list[list[float]]]:
        """The rounds every member has a value at, and the members' values there."""
        curves = [dict(zip(*m.values(stage, metric))) for m in self.members]
        x = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        return x, [[c[r] for c in curves] for r in x]


def seed_group(label: str, members: list[Series]) -> Series:
    """One method's runs over several seeds as one series: each metric's mean over the members at every
    (round, stage) all of them committed."""
    keys = set.intersection(*(set(m.by) for m in members))
    rows = []
    for r, stage in sorted(keys):
        metrics = [m.by[(r, stage)] for m in members]
        shared = [k for k, v in metrics[0].items() if isinstance(v, (int, float)) and all(isinstance(x.get(k), (int, float)) for x in metrics)]
        rows.append({"round": r, "stage": stage, **{k: float(np.mean([x[k] for x in metrics])) for k in shared if k != "round"}})
    finals = [m.final_accuracy for m in members]
    final = float(np.mean(finals)) if all(f is not None for f in finals) else None
    return Series(label=label, url=members[0].url, rows=rows, final_accuracy=final, members=members)


def find_runs(folder: str) -> list[Series]:
    """The runs a folder holds: itself, a demo folder's run, each method of a comparison, or each stage
    of a recipe (`gndpo recipe`)."""
    root = Path(folder)
    if (root / "compare.json").exists():
        series = []
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            label = sub.name.split("-", 1)[-1]
            seeds = sorted((p for p in sub.glob("seed-*") if (p / "run" / "run.yaml").exists()), key=lambda p: int(p.name[5:]))
            if (sub / "run" / "run.yaml").exists():
                series.append(_demo_series(sub, label=label))
            elif seeds:
                series.append(seed_group(label, [_demo_series(p, label=f"{label} {p.name}") for p in seeds]))
        labels = [r["method"] for r in json.loads((root / "compare.json").read_text())["rows"]]
        for s, label in zip(series, labels):
            s.label = label
        if not series:
            raise GndpoError(f"{folder}: a comparison folder without method runs")
        return series
    if stages := recipe_stages(folder):
        return [Series(label=s["name"], url=str(root / s["run"]), rows=collect_metrics(open_run(str(root / s["run"])))) for s in stages]
    if (root / "run" / "run.yaml").exists():
        return [_demo_series(root, label=root.name)]
    run = open_run(folder)
    return [Series(label=Path(run.fs.url).name or run.fs.url, url=run.fs.url, rows=collect_metrics(run))]


def _demo_series(folder: Path, label: str) -> Series:
    run = open_run(str(folder / "run"))
    summary = folder / "eval" / "summary.json"
    final = json.loads(summary.read_text()).get("pass@1") if summary.exists() else None
    return Series(label=label, url=run.fs.url, rows=collect_metrics(run), final_accuracy=final)


def curve_figure(series: list[Series], title: str, ylabel: str, lines: list[tuple]) -> bytes | None:
    """A PNG of ``lines`` per series over rounds; None when no series has any of them."""
    fig, ax = _figure()
    drawn = 0
    for s in series:
        for stage, metric, suffix in lines:
            x, y = s.values(stage, metric)
            if x:
                line, = ax.plot(x, y, marker="o", label=(s.label if len(series) > 1 else "") + suffix or metric)
                if s.members:  # the band from the lowest to the highest seed
                    xs, lo, hi = s.spread(stage, metric)
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
                drawn += 1
    if not drawn:
        return None
    ax.set_title(title)
    ax.set_xlabel("round (policy version for accuracy)")
    ax.set_ylabel(ylabel)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if drawn > 1:
        ax.legend(fontsize=8)
    return _png(fig)


def stage_time_figure(series: list[Series]) -> bytes | None:
    """Stacked bars of each stage's worker-seconds per round (the first series: one run's timeline)."""
    s = series[0]
    rounds = sorted({r for r, _ in s.by})
    if not rounds:
        return None
    fig, ax = _figure()
    bottom = np.zeros(len(rounds))
    for stage in STAGE_ORDER:
        secs = np.array([float(s.by.get((r, stage), {}).get("seconds") or 0.0) for r in rounds])
        ax.bar(rounds, secs, bottom=bottom, label=stage)
        bottom += secs
    ax.set_title("Stage time per round" + (f" ({s.label})" if len(series) > 1 else ""))
    ax.set_xlabel("round")
    ax.set_ylabel("seconds (summed over workers)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)
    return _png(fig)


def timeline_figure(url: str) -> bytes | None:
    """One run's timeline: each stage's span per round (first claim to last commit) in a lane of its
    own, so stages that ran side by side (overlapped rounds) are seen to, with the round's waits
    (``wait_input_seconds`` + ``wait_held_seconds`` over its stages) beside its label."""
    run = open_run(url)
    spans = {key: span for key, span in stage_table(run)[1].items() if span is not None}
    if not spans:
        return None
    waits = round_waits(run)
    start = min(a for a, _ in spans.values())
    lanes = list(reversed(STAGE_ORDER))  # rollout on top
    fig, ax = _figure()
    for (r, stage), (a, b) in sorted(spans.items()):
        if stage not in lanes:
            continue
        lane = lanes.index(stage)
        ax.barh(lane, b - a, left=a - start, color=f"C{STAGE_ORDER.index(stage)}", edgecolor="white", height=0.8)
        ax.text((a + b) / 2 - start, lane, f"r{r}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(lanes)), lanes)
    waited = ", ".join(f"r{r} {w['input'] + w['held']:.0f}s" for r, w in sorted(waits.items()) if w["input"] + w["held"] > 0)
    ax.set_title("Timeline" + (f" (waited: {waited})" if waited else ""), fontsize=9)
    ax.set_xlabel("seconds since the first stage started")
    return _png(fig)


def round_waits(run) -> dict[int, dict[str, float]]:
    """{round: {"input": s, "held": s}}: the seconds the round's stages' workers waited for their input,
    and held back by the actor's bound ahead of the learner (their metrics summed over stages)."""
    waits: dict[int, dict[str, float]] = {}
    for row in collect_metrics(run):
        w = waits.setdefault(row["round"], {"input": 0.0, "held": 0.0})
        w["input"] += float(row.get("wait_input_seconds") or 0.0)
        w["held"] += float(row.get("wait_held_seconds") or 0.0)
    return waits


def _figure():
    """A figure and its axes, made without pyplot: no GUI backend, nothing a notebook would notice."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    return fig, fig.add_subplot()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def token_view(url: str, rows: int = TOKEN_VIEW_ROWS) -> str:
    """HTML of a few rollouts of the newest scored round, each token coloured by lpT - lpS: the
    responses with the lowest summed log-ratio (where the student strays most from the teacher), and the
    one with the highest. Tokens outside the loss mask (tool turns, template) are grey."""
    run = open_run(url)
    r = max((k for k in range(committed_rounds(run)) if run.records(k, SCORES).manifest() is not None), default=None)
    if r is None:
        return "<p>No scored round yet.</p>"
    picked = strayed_rollouts(run, r, rows)
    if not picked:
        return "<p>No scored rollouts.</p>"
    tok = load_tokenizer(run.policy_path(0))  # the student's tokenizer (every policy version keeps it)
    shown = {p["prompt_id"]: image_ids(p) for p in run.prompts("train")}
    pictures = RunImages(run.fs)
    parts = [f"<p>Round {r} (policy version {r}); lpT - lpS per token: "
             '<span class="tok" style="background:rgba(220,40,40,0.8)">teacher finds it unlikely</span> '
             '<span class="tok" style="background:rgba(40,160,60,0.8)">teacher prefers it</span> '
             '<span class="tok masked">not trained on</span>. Hover a token for its numbers.</p>']
    for rid, reward, finish, prompt, token_ids, mask, lp_t, lp_s, pid in picked:
        ratio = np.asarray(lp_t, np.float64) - np.asarray(lp_s, np.float64)
        mask = np.asarray(mask, np.float64)
        parts.append(
            f'<div class="rollout"><div class="meta">{html.escape(rid)}: {"" if reward is None else f"reward {reward:.3f}, "}'
            f'sum of lpT - lpS {float((ratio * mask).sum()):+.2f} over {int(mask.sum())} tokens, {html.escape(str(finish))}</div>'
            f'{picture_tags(pictures, shown.get(pid, []))}'
            f'<pre class="prompt">{html.escape(prompt)}</pre><div class="response">{token_spans(tok, token_ids, ratio, mask)}</div></div>'
        )
    return "\n".join(parts)


def strayed_rollouts(run, round_idx: int, rows: int) -> list[tuple]:
    """Round ``round_idx``'s ``rows - 1`` responses with the lowest summed lpT - lpS over the loss mask
    and the one with the highest, in that order: (rollout_id, reward, finish_reason, prompt, token ids,
    loss mask, teacher log-probs, student log-probs, prompt_id). DuckDB ranks the round's responses
    over the shards; only the chosen ones are read into Python."""
    con = connect(run.fs)
    rollouts = parquet_source(run.fs, run.records(round_idx, ROLLOUTS).require_manifest().row_files())
    scores = parquet_source(run.fs, run.records(round_idx, SCORES).require_manifest().row_files())
    con.sql(f"""CREATE VIEW ranked AS
        SELECT r.rollout_id, list_sum(list_transform(list_zip(s.teacher_logprobs, s.student_logprobs, r.loss_mask),
                                                     lambda x: (x[1] - x[2]) * x[3])) AS total
        FROM {rollouts} r JOIN {scores} s USING (rollout_id)""")
    chosen = con.sql(f"""(SELECT rollout_id, total FROM ranked ORDER BY total, rollout_id LIMIT {rows - 1})
                         UNION ALL (SELECT rollout_id, total FROM ranked ORDER BY total DESC, rollout_id LIMIT 1)""").fetchall()
    ids = list(dict.fromkeys(rid for rid, _ in chosen))
    picked = con.execute(
        f"""SELECT r.rollout_id, r.reward, r.finish_reason, r.prompt, r.response_token_ids, r.loss_mask,
                   s.teacher_logprobs, s.student_logprobs, r.prompt_id
            FROM {rollouts} r JOIN {scores} s USING (rollout_id) WHERE r.rollout_id IN (SELECT unnest(?))""", [ids]
    ).fetchall()
    by_id = {row[0]: row for row in picked}
    return [by_id[rid] for rid in ids]


def token_spans(tok, token_ids, ratio: np.ndarray, mask: np.ndarray) -> str:
    """One HTML span per response token, red where the teacher finds it less likely than the student
    does and green where more (opacity: |lpT - lpS| / RATIO_SCALE), grey outside the loss mask."""
    spans = []
    for t, (token_id, d, m) in enumerate(zip(token_ids, ratio, mask)):
        text = html.escape(tok.decode([token_id])) or "&#8203;"
        tip = f"t={t} id={token_id} lpT-lpS={d:+.3f}"
        if m == 0:
            spans.append(f'<span class="tok masked" title="{tip} (mask 0)">{text}</span>')
            continue
        alpha = min(abs(d) / RATIO_SCALE, 1.0)
        rgb = "220,40,40" if d < 0 else "40,160,60"
        spans.append(f'<span class="tok" style="background:rgba({rgb},{alpha:.2f})" title="{tip}">{text}</span>')
    return "".join(spans)


def picture_tags(pictures: RunImages, ids: list[str], edge: int = 256) -> str:
    """The prompt's pictures as inline PNG thumbnails (at most ``edge`` pixels a side), in placeholder order."""
    tags = []
    for image in ids:
        thumbnail = pictures.get(image).copy()
        thumbnail.thumbnail((edge, edge))
        buf = io.BytesIO()
        thumbnail.save(buf, format="PNG")
        data = base64.b64encode(buf.getvalue()).decode()
        tags.append(f'<img class="picture" alt="image {image[:12]}" src="data:image/png;base64,{data}">')
    return "".join(tags)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gndpo report: {title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(540px, 1fr)); gap: 1em; }}
img {{ width: 100%; border: 1px solid #ddd; }} img.picture {{ width: auto; max-width: 256px; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ border: 1px solid #ccc; padding: 2px 6px; text-align: right; }}
.rollout {{ border: 1px solid #ddd; margin: 0.8em 0; padding: 0.5em; }}
.meta {{ font-size: 0.85em; color: #555; }} .prompt {{ color: #666; margin: 0.3em 0; white-space: pre-wrap; }}
.response {{ font-family: monospace; white-space: pre-wrap; line-height: 1.7; }}
.tok {{ border-radius: 2px; }} .masked {{ color: #999; background: #eee; }}
pre.config {{ background: #f6f6f6; padding: 1em; font-size: 0.85em; }}
</style></head><body>
<h1>gndpo report: {title}</h1>
<p>{subtitle}</p>
<h2>Per round</h2>
<div class="grid">{figures}</div>
<h2>Round table</h2>
{table}
<h2>Where the time went</h2>
<p>Seconds of work per phase of each stage (summed over its units) and the MB each phase wrote to the run folder{phase_note}.</p>
{phases}
<h2>Where the student goes wrong</h2>
{tokens}
<h2>Config</h2>
{configs}
<script>
// A figure that did not decode is a console error, so a headless browser check catches it.
window.addEventListener("load", () => {{
  for (const img of document.images) {{ if (!img.naturalWidth) console.error("figure failed to load: " + img.alt); }}
}});
</script>
</body></html>
"""


def heldout_label(series: list[Series]) -> str:
    """The held-out score's unit: the first run's reward ("exact match" for the default)."""
    reward = open_run(series[0].url).cfg.reward
    return "exact match" if reward == "exact_match" else f"mean {reward} reward"


def round_table(series: list[Series]) -> str:
    """The main metrics as an HTML table, one row per (series, round); ``round_seconds`` is the round's
    wall time: the union of its stages' spans from first claim to last commit, stages that ran side by
    side counted once, and the seconds its workers waited for input and were held (:func:`round_waits`)
    (of the first run of a series)."""
    cols = [("rollout", "heldout_accuracy"), ("rollout", "staleness"), ("score", "heldout_reverse_kl"), ("normalize", "reward_mean"),
            ("normalize", "reverse_kl_estimate"), ("train", "grad_norm_mean"), ("train", "clip_fraction"), ("normalize", "response_length_mean")]
    head = ("<tr><th>run</th><th>round</th>" + "".join(f"<th>{html.escape(m)}</th>" for _, m in cols)
            + "<th>round_seconds</th><th>waited_input_s</th><th>held_s</th></tr>")
    body = []
    for s in series:
        run = open_run(s.url)
        walls, waits = round_seconds(run), round_waits(run)
        for r in sorted({r for r, _ in s.by}):
            waited = waits.get(r, {})
            values = [s.by.get((r, stage), {}).get(m) for stage, m in cols] + [walls.get(r), waited.get("input"), waited.get("held")]
            cells = "".join(f"<td>{v:.4g}</td>" if isinstance(v, (int, float)) else "<td>-</td>" for v in values)
            body.append(f"<tr><td>{html.escape(s.label)}</td><td>{r}</td>{cells}</tr>")
    return f"<table>{head}{''.join(body)}</table>"


def rows_table(rows: list[dict]) -> str:
    """``rows`` (dicts with the same keys) as an HTML table."""
    if not rows:
        return "<p>-</p>"
    head = "<tr>" + "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0]) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{v:.4g}</td>" if isinstance(v, float) else f"<td>{html.escape(str(v))}</td>"
                                    for v in row.values()) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def build_report(folder: str, out: str) -> dict:
    """Write ``out/report.html`` and ``out/<figure>.png`` (any fsspec URL); returns their paths. The HTML
    is written last, so a finished report.html means its figures are there."""
    series = find_runs(folder)
    if not any(s.rows for s in series):
        raise GndpoError(f"{folder}: no committed stage yet, nothing to report")
    out = out.rstrip("/")
    figures, written = [], []
    pngs = [(name, curve_figure(series, title, ylabel or heldout_label(series), lines)) for name, title, ylabel, lines in CURVES]
    pngs.append(("stage_seconds", stage_time_figure(series)))
    pngs.append(("timeline", timeline_figure(series[0].url)))
    for name, png in pngs:
        if png is None:
            continue
        write_file(f"{out}/{name}.png", png)
        written.append(f"{out}/{name}.png")
        figures.append(f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(png).decode()}">')
    configs = "".join(
        f"<h3>{html.escape(s.label)}</h3><pre class=\"config\">{html.escape(open_run(s.url).fs.read_bytes('run.yaml').decode())}</pre>"
        for s in series
    )
    subtitle = ", ".join(f"{html.escape(s.label)}: {html.escape(s.url)}" for s in series)
    page = PAGE.format(
        title=html.escape(Path(folder).name or folder), subtitle=subtitle, figures="\n".join(figures),
        table=round_table(series), tokens=token_view(series[0].url), configs=configs,
        phases=rows_table(phase_rows(open_run(series[0].url))),
        phase_note=f" ({html.escape(series[0].label)})" if len(series) > 1 else "",
    )
    write_file(f"{out}/report.html", page.encode())
    return {"html": f"{out}/report.html", "figures": written}
