"""Runs side by side in one self-contained HTML page (``embedtrain report``).

The page holds, for the run directories (and the trials of ``embedtrain tune`` directories) it
is given: each evaluated metric's curve against steps, every run on the same axes (inline SVG, a
point's value on hover); the config keys whose values differ between the runs; the final metrics
side by side with the data set's oracle where the data set has one; throughput, start-up and
memory; the plan each run recorded; a search's trials. Nothing is fetched from the network when
the page opens, and nothing of the runs is written: their files are only read.

Example:
    >>> html = render_report([load_run("runs/a"), load_run("runs/b")])  # doctest: +SKIP
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from embedtrain.train.run_dir import SUMMARY_FILE, RunDir

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#17becf", "#7f7f7f", "#bcbd22")
NOT_METRICS = {"step", "examples", "split", "event", "epoch"}
# summary.json's figures of how the run went, in the order shown
RUN_FIGURES = ("steps", "examples", "train_examples_per_s", "train_time_s", "wall_time_s",
               "startup_s", "world_size", "threads_per_rank", "loader_threads_per_rank",
               "table_backward_threads_per_rank",
               "peak_rss_gb_per_rank",
               "stopped_early", "selected")
PLAN_FIGURES = ("step_estimate_ms", "imbalance", "embedding_weight_bytes",
                "embedding_optimizer_bytes", "peak_rank_memory_bytes", "memory_tier",
                "sharding_types")


@dataclass
class RunRecord:
    """What the page shows of one run directory, read once."""

    name: str
    path: Path
    config: dict[str, Any]  # dotted key -> value
    records: list[dict[str, Any]]  # metrics.jsonl's evaluation records in effect
    summary: Optional[dict[str, Any]] = None  # None: an unfinished run
    plan: Optional[dict[str, Any]] = None
    trials: list[dict[str, Any]] = field(default_factory=list)  # a search: trials.json


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def _json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None


def load_run(path: str | Path, name: Optional[str] = None) -> RunRecord:
    """Reads a run directory's config, records, summary and plan (writes nothing).

    Raises:
        ValueError: ``path`` holds no ``config.yaml``, or a file of it is not readable.
    """
    root = Path(path)
    config_file = root / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"{root}: not a run directory (no config.yaml) nor a search "
                         "directory (no trials.json)")
    try:
        config = yaml.safe_load(config_file.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{config_file}: not readable YAML ({str(e).splitlines()[0]})") from None
    return RunRecord(name or root.name, root, _flatten(config),
                     RunDir(root, create=False).read_metrics(), _json(root / SUMMARY_FILE),
                     _json(root / "plan.json"))


def load_runs(paths: Sequence[str | Path]) -> tuple[list[RunRecord], list[RunRecord]]:
    """The runs of ``paths`` and the searches among them: a ``tune`` directory (``trials.json``)
    gives its trials' runs (named ``SEARCH/trial_000``, ...) and itself as a search."""
    runs, searches = [], []
    for path in map(Path, paths):
        trials = _json(path / "trials.json")
        if trials is None:
            runs.append(load_run(path))
            continue
        search = RunRecord(path.name, path, {}, [], _json(path / "best.json"), trials=trials)
        searches.append(search)
        for trial in trials:  # where the search is now, else where trials.json says it was
            for run in (path / "trials" / trial["trial"], Path(trial.get("run_dir") or path)):
                if (run / "config.yaml").is_file():
                    runs.append(load_run(run, f"{path.name}/{trial['trial']}"))
                    break
    seen: dict[str, int] = {}
    for run in runs:  # the same name twice (runs/a/run, runs/b/run): named by their paths
        seen[run.name] = seen.get(run.name, 0) + 1
    for run in runs:
        run.name = str(run.path) if seen[run.name] > 1 else run.name
    return runs, searches


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return f"{max(value):.3g} (max of {len(value)})"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v) if not isinstance(v, str) else v)}"
                                     "</td>" for v in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _ticks(low: float, high: float, n: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    return [k * step for k in range(math.ceil(low / step), math.floor(high / step) + 1)]


def _chart(metric: str, runs: Sequence[RunRecord], colors: dict[str, str]) -> str:
    """One metric against steps, a polyline per run, on shared axes."""
    series = {r.name: [(rec["step"], rec[metric]) for rec in r.records
                       if isinstance(rec.get(metric), (int, float)) and "step" in rec
                       and math.isfinite(rec[metric])] for r in runs}
    points = [p for s in series.values() for p in s]
    if not points:
        return ""
    w, h, left, bottom, top, right = 460, 260, 58, 34, 26, 12
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + abs(y0) * 0.01 + 1e-9)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (w - left - right)

    def sy(y: float) -> float:
        return h - bottom - (y - y0) / (y1 - y0) * (h - bottom - top)

    out = [f'<svg class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{metric}">',
           f'<text x="{w / 2}" y="16" class="title">{html.escape(metric)}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" class="axis"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" class="axis"/>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" '
                   f'class="grid"/><text x="{left - 4}" y="{sy(t) + 4:.1f}" class="ytick">'
                   f'{t:.4g}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{h - bottom + 14}" class="xtick">{t:,.0f}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 4}" class="xtick">step</text>')
    for name, pts in series.items():
        if not pts:
            continue
        line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{line}" stroke="{colors[name]}" class="line"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colors[name]}">'
                f'<title>{html.escape(name)}: step {x}, {metric} {y:.6g}</title></circle>'
                for x, y in pts]
    return "".join(out) + "</svg>"


def _metric_names(runs: Sequence[RunRecord]) -> list[str]:
    names: dict[str, None] = {}
    for r in runs:
        for rec in r.records:
            names.update({k: None for k, v in rec.items() if k not in NOT_METRICS
                          and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return list(names)


def _config_differences(runs: Sequence[RunRecord]) -> list[list[Any]]:
    keys = sorted({k for r in runs for k in r.config})
    missing = object()
    rows = []
    for key in keys:
        values = [r.config.get(key, missing) for r in runs]
        if len({json.dumps(v, default=str) for v in values if v is not missing}) > 1 or \
                (missing in values and len(runs) > 1):
            rows.append([key, *("(not set)" if v is missing else _fmt(v) for v in values)])
    return rows


def _final_metrics(runs: Sequence[RunRecord], metrics: Sequence[str]) -> list[list[Any]]:
    rows = []
    for key in [*metrics, *sorted({k for r in runs for k in (r.summary or {})
                                   if k.startswith("oracle_")})]:
        values = [(r.summary or {}).get(key) for r in runs]
        if any(isinstance(v, (int, float)) for v in values):
            rows.append([f"test {key}" if not key.startswith("oracle") else key, *values])
    for key in metrics:
        values = [((r.summary or {}).get("valid") or {}).get(key) for r in runs]
        if any(isinstance(v, (int, float)) for v in values):
            rows.append([f"valid {key}", *values])
    return rows


def _figures(runs: Sequence[RunRecord], source, keys: Sequence[str]) -> list[list[Any]]:
    rows = []
    for key in keys:
        values = [(source(r) or {}).get(key) for r in runs]
        if any(v is not None for v in values):
            if key == "selected":
                values = [v.get("step") if isinstance(v, dict) else v for v in values]
                key = "selected step"
            elif key.endswith("_bytes"):
                values = [v / 2**30 if isinstance(v, (int, float)) else v for v in values]
                key = key[:-6] + " GiB"
            rows.append([key, *values])
    return rows


def _search_table(search: RunRecord) -> str:
    keys = sorted({k for t in search.trials for k in t.get("config", {})})
    best = (search.summary or {}).get("trial")
    rows = [[("★ " if t["trial"] == best else "") + t["trial"], t.get("status"),
             t.get("best_value"), t.get("step"),
             *(t.get("config", {}).get(k) for k in keys), t.get("error") or ""]
            for t in search.trials]
    failed = sum(t.get("status") == "error" for t in search.trials)
    note = (f"<p class=\"warn\">{failed} of {len(search.trials)} trials failed.</p>"
            if failed else "")
    return (f"<h3>{html.escape(search.name)} ({html.escape(str(search.path))})</h3>{note}"
            + _table(["trial", "status", "best valid", "step", *keys, "error"], rows))


STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}table{border-collapse:collapse;margin:8px 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}
td:first-child,th:first-child{text-align:left}.charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{width:460px;height:260px;border:1px solid #eee}.axis{stroke:#444}.grid{stroke:#eee}
.line{fill:none;stroke-width:1.8}.title{text-anchor:middle;font-size:13px;font-weight:600}
.ytick{text-anchor:end;font-size:10px;fill:#555}.xtick{text-anchor:middle;font-size:10px;fill:#555}
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}
.warn{color:#b00}"""


def render_report(runs: Sequence[RunRecord], searches: Sequence[RunRecord] = ()) -> str:
    """The page: one self-contained HTML document (inline CSS and SVG, no script)."""
    colors = {r.name: COLORS[i % len(COLORS)] for i, r in enumerate(runs)}
    names = [r.name for r in runs]
    metrics = _metric_names(runs)
    legend = "".join(f'<li><span class="swatch" style="background:{colors[r.name]}"></span>'
                     f"<b>{html.escape(r.name)}</b> {html.escape(str(r.path))}"
                     f"{'' if r.summary else ' (unfinished: no summary.json)'}</li>"
                     for r in runs)
    parts = [f"<h1>embedtrain report: {len(runs)} run(s)</h1><ul>{legend}</ul>",
             "<h2>Curves</h2><div class=\"charts\">",
             *(_chart(m, runs, colors) for m in ["train_loss", *(m for m in metrics
                                                                  if m != "train_loss")]),
             "</div>"]
    differences = _config_differences(runs)
    parts.append("<h2>Config differences</h2>" + (
        _table(["key", *names], differences) if differences else
        "<p>The runs' configs are the same.</p>" if len(runs) > 1 else
        "<p>One run: nothing to compare.</p>"))
    parts.append("<h2>Final metrics</h2>" + _table(["metric", *names],
                                                   _final_metrics(runs, metrics)))
    parts.append("<h2>Throughput and memory</h2>" + _table(
        ["", *names], _figures(runs, lambda r: r.summary, RUN_FIGURES)))
    plans = _figures(runs, lambda r: (r.plan or {}).get("summary"), PLAN_FIGURES)
    if plans:
        parts.append("<h2>Plan</h2>" + _table(["", *names], [
            ["cluster", *((r.plan or {}).get("cluster", {}).get("name") for r in runs)],
            *plans]))
    if searches:
        parts.append("<h2>Searches</h2>" + "".join(_search_table(s) for s in searches))
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>embedtrain report</title><style>{STYLE}</style></head><body>"
            + "".join(parts) + "</body></html>\n")
