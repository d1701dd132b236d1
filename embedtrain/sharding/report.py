"""Writes a sharding plan's report as ``plan.json``, ``plan.md`` and self-contained ``plan.html``.

The report is the :class:`~embedtrain.sharding.report_types.PlanReport`
:func:`~embedtrain.sharding.planner.plan_sharding` returns as ``PlanResult.report`` (or one read
back from a ``plan.json`` with ``PlanReport.from_dict``). The JSON is ``PlanReport.to_dict()``.
The Markdown is for terminals and code review (one row per table and per rank, so it greps well);
the HTML adds two inline-SVG charts (memory and estimated time per rank) and needs no network,
JavaScript or external files, so it can be attached to a ticket as is.

Example:
    >>> result = plan_sharding(model, load_cluster("configs/clusters/h100-16x8.yaml"))
    >>> [p.name for p in write_report(result.report, "runs/plan")]
    ['plan.json', 'plan.md', 'plan.html']
    >>> compress_ranks(result.report.tables[0].ranks)
    '8-15'
"""

from __future__ import annotations

import html
import json
import math
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

from embedtrain.sharding.cluster import GIB
from embedtrain.sharding.report_types import PlanReport, RankLoad
from embedtrain.sharding.types import MemoryTier
from embedtrain.utils import write_atomic

MIB = 1024**2
FORMATS = ("json", "md", "html")

# Stack order (bottom-up) and colours (Tableau 10). "reserved" is a safety margin rather than use,
# so it is grey and on top, where it reads as "taken but not by us".
MEMORY_PARTS = {
    "embedding_params": "#4e79a7", "embedding_optimizer": "#a0cbe8", "embedding_remap": "#76b7b2",
    "io_and_cache": "#f28e2b",
    "dense_model": "#59a14f", "dense_gradients": "#8cd17d", "dense_optimizer": "#b6992d",
    "kjt_buffers": "#e15759", "reserved": "#cfcfcf",
}
TIME_PARTS = {
    "fwd_compute": "#4e79a7", "fwd_comms": "#f28e2b", "bwd_compute": "#a0cbe8",
    "bwd_comms": "#ffbe7d", "prefetch": "#b07aa1", "sharding_groups": "#e15759",
    "dense_allreduce": "#59a14f",
}
UNKNOWN_PART_COLOUR = "#9c755f"  # a component a later planner adds still gets drawn
TABLE_TEXT_COLUMNS = 4  # name, sharding type, kernel, ranks; the later columns are numbers
MIN_SEGMENT_PX = 1.0  # a 20 MB slice of an 80 GiB axis would otherwise not be drawn at all

Rows = tuple[list[str], list[list[str]]]


def compress_ranks(ranks: Iterable[int]) -> str:
    """Writes ranks as comma-separated ranges: ``[0, 1, 2, 3, 5, 7, 8]`` -> ``"0-3,5,7-8"``.

    Args:
        ranks: rank numbers, in any order; duplicates are ignored.

    Returns:
        The compressed list, ``""`` for no ranks.
    """
    parts: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def _num(value: float) -> str:
    """Two decimals, or three significant digits below 1: one plan spans bytes to terabytes."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    decimals = 2 - math.floor(math.log10(abs(value)))
    return f"{value:.{decimals}f}" if decimals <= 6 else f"{value:.2g}"  # 384 B = 3.6e-07 GiB


def _label(tier: MemoryTier) -> str:
    return tier.value.upper()  # "HBM", "DDR"


def _memory_parts(report: PlanReport) -> list[str]:
    """Device-tier components in stack order, then any unknown ones (shown, not dropped)."""
    tier = report.memory_tier
    seen = {k for r in report.ranks for k, v in r.memory[tier].parts.items()
            if v or k != "embedding_remap"}  # dynamic tables' state: shown where there is some
    return [k for k in MEMORY_PARTS if k in seen] + sorted(seen - set(MEMORY_PARTS))


def _title(report: PlanReport) -> tuple[str, str]:
    c = report.cluster
    capacity = report.summary.rank_memory_capacity_bytes / GIB
    subtitle = (f"{c.hosts} host(s) × {c.devices_per_host} {c.device.value} device(s); device "
                f"memory: {_num(capacity)} GiB {_label(report.memory_tier)} per rank")
    return f"Sharding plan: {c.name} ({c.world_size} ranks)", subtitle


def _summary_rows(report: PlanReport) -> list[tuple[str, str]]:
    s, p = report.summary, report.planner
    cap, peak = s.rank_memory_capacity_bytes, s.peak_rank_memory_bytes
    share = f" ({peak / cap:.0%})" if cap else ""
    by_count = sorted(s.sharding_types.items(), key=lambda kv: -kv[1])
    weights, optimizer = s.embedding_weight_bytes / GIB, s.embedding_optimizer_bytes / GIB
    return [
        ("Tables", str(s.tables)),
        ("Embedding weights + optimizer", f"{_num(weights)} + {_num(optimizer)} GiB"),
        ("Dense parameters", f"{_num(s.dense_parameter_bytes / MIB)} MiB"),
        ("Slowest-rank embedding time",
         f"{_num(s.embedding_max_rank_ms)} ms (rank {s.slowest_rank})"),
        ("Mean-rank embedding time", f"{_num(s.embedding_mean_rank_ms)} ms"),
        ("Imbalance (slowest / mean)", f"{s.imbalance:.2f}x"),
        ("Dense all-reduce", f"{_num(s.dense_allreduce_ms)} ms"),
        ("Step estimate (slowest embeddings + all-reduce)", f"{_num(s.step_estimate_ms)} ms"),
        (f"Peak per-rank {_label(s.memory_tier)}",
         f"{_num(peak / GIB)} of {_num(cap / GIB)} GiB{share} (rank {s.peak_memory_rank})"),
        ("Sharding type/kernel", ", ".join(f"{n} × {k}" for k, n in by_count) or "none"),
        ("Planner", (f"{p.seconds:.2f} s, {p.proposals} proposals, "
                     f"{p.partitions} partitions, best seed {p.best_seed}")),
    ]


def _sharding_label(t) -> str:
    """The sharding type, said as what it is when a split has one block (the whole table)."""
    if t.sharding_type in ("column_wise", "table_column_wise") and len(t.shards) == 1:
        return f"{t.sharding_type} (1 block: the whole table)"
    return t.sharding_type


def _table_rows(report: PlanReport) -> Rows:
    # Dynamic tables' remapping state (id -> row, counters): a column only when a table has it.
    remap = any(t.remap_bytes for t in report.tables)
    header = ["table", "sharding type", "kernel", "ranks", "rows", "dim", "pooling",
              "weights GiB", "optimizer MiB", *(["remap MiB"] if remap else []),
              "slowest shard ms", "all shards ms"]
    rows = [[t.name, _sharding_label(t), t.compute_kernel, compress_ranks(t.ranks),
             f"{t.rows:,}", str(t.dim), _num(t.pooling_factor),
             _num(t.weight_bytes / GIB), _num(t.optimizer_bytes / MIB),
             *([_num(t.remap_bytes / MIB)] if remap else []), _num(t.slowest_shard_ms),
             _num(t.perf_ms_all_shards)]
            for t in report.tables]
    return header, rows


def _rank_rows(report: PlanReport) -> Rows:
    tier = report.memory_tier
    parts = _memory_parts(report)
    # On GPU clusters UVM kernels put tables in host DDR: a column for it only when any rank has.
    other = MemoryTier.DDR if tier is MemoryTier.HBM else None
    if other and not any(r.memory[other].total for r in report.ranks):
        other = None
    header = (["rank", "host"] + [f"{p} GiB" for p in parts]
              + [f"total {_label(tier)} GiB", "% of capacity"]
              + ([f"{_label(other)} GiB"] if other else [])
              + ["compute ms", "comms ms"]
              + (["sharding groups ms"] if any(r.time_ms.sharding_groups for r in report.ranks)
                 else [])
              + ["dense all-reduce ms", "total ms"])
    rows = []
    for r in report.ranks:
        mem, t = r.memory[tier], r.time_ms
        share = f"{mem.total / mem.capacity:.1%}" if mem.capacity else "n/a"
        rows.append([str(r.rank), str(r.host)]
                    + [_num(mem.get(p) / GIB) for p in parts]
                    + [_num(mem.total / GIB), share]
                    + ([_num(r.memory[other].total / GIB)] if other else [])
                    + [_num(t.fwd_compute + t.bwd_compute + t.prefetch),
                       _num(t.fwd_comms + t.bwd_comms)]
                    + ([_num(t.sharding_groups)] if "sharding groups ms" in header else [])
                    + [_num(t.dense_allreduce), _num(t.total)])
    return header, rows


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]], text_columns: int) -> str:
    """A Markdown table; the columns from ``text_columns`` on are right-aligned numbers."""
    def cells(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    align = [":---" if i < text_columns else "---:" for i in range(len(header))]
    return "\n".join([cells(header), "|" + "|".join(align) + "|"] + [cells(r) for r in rows])


def render_markdown(report: PlanReport) -> str:
    """The report as Markdown (``plan.md``): warnings, summary, one row per table and per rank.

    Args:
        report: a planner report (``PlanResult.report``, or ``PlanReport.from_dict`` of a
            loaded ``plan.json``).

    Returns:
        The Markdown text, ending in a newline.
    """
    title, subtitle = _title(report)
    warnings = [f"- **{w}**" for w in report.warnings] or ["No warnings."]
    return "\n\n".join([
        f"# {title}", subtitle,
        "## Warnings", "\n".join(warnings),
        "## Summary", _md_table(["metric", "value"], _summary_rows(report), text_columns=2),
        "## Tables", _md_table(*_table_rows(report), text_columns=TABLE_TEXT_COLUMNS),
        "## Ranks", _md_table(*_rank_rows(report), text_columns=0),
    ]) + "\n"


def _nice_step(top: float, ticks: int = 5) -> float:
    """A 1/2/2.5/5 x 10^k tick step that splits ``top`` into about ``ticks`` intervals."""
    raw = top / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if raw <= m * magnitude)


def _label_step(slot: float, min_px: float) -> int:
    """Label every n-th slot, n the first of a few round numbers that leaves ``min_px`` apart."""
    candidates = (1, 2, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100, 128, 256)
    return next((c for c in candidates if c * slot >= min_px), candidates[-1])


def _segment_heights(true: list[float]) -> list[float]:
    """Drawn heights of one bar's segments: each at least ``MIN_SEGMENT_PX`` so it can be seen
    and hovered, the excess taken from the tallest segment so that the bar's top stays exact."""
    drawn = [max(h, MIN_SEGMENT_PX) for h in true]
    if drawn:
        tallest = max(range(len(drawn)), key=lambda i: drawn[i])
        drawn[tallest] = max(MIN_SEGMENT_PX, drawn[tallest] - (sum(drawn) - sum(true)))
    return drawn


def _bar_chart(title: str, unit: str, ranks: list[RankLoad], values: list[dict[str, float]],
               parts: dict[str, str], limit: tuple[float, str] | None = None) -> str:
    """A figure: an SVG of stacked bars, one per rank, y ticks, host bands, and an HTML legend.

    Args:
        title: the caption. unit: the y axis unit. ranks: the report's ranks.
        values: per rank, the value of each part. parts: part -> colour, bottom-up.
        limit: a horizontal line (value, label), the memory capacity.
    """
    width, height, left, right, top, bottom = 1000, 380, 56, 16, 18, 46
    plot_w, plot_h, base_y = width - left - right, height - top - bottom, height - bottom
    peak = max([sum(v.values()) for v in values] + [limit[0] if limit else 0]) * 1.05 or 1.0
    step = _nice_step(peak)
    y_max = step * math.ceil(peak / step)
    slot = plot_w / max(1, len(ranks))
    bar_w = min(48.0, slot * 0.8)  # with 2 ranks, full-width bars would look like walls

    def y(v: float) -> float:
        return top + plot_h * (1 - v / y_max)

    out = [(f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{html.escape(title)}">')]
    # Alternate host backgrounds so that the ranks of one host read as a group.
    hosts: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        hosts.setdefault(r.host, []).append(i)
    host_step = _label_step(slot * max(map(len, hosts.values()), default=1), 46)
    for n, (host, idx) in enumerate(sorted(hosts.items())):
        x0, x1 = left + idx[0] * slot, left + (idx[-1] + 1) * slot
        if n % 2:
            out.append(f'<rect class="hostband" x="{x0:.2f}" y="{top}" width="{x1 - x0:.2f}" '
                       f'height="{plot_h}" fill="#f2f2f2"/>')
        if len(hosts) > 1 and n % host_step == 0:
            out.append(f'<text x="{(x0 + x1) / 2:.2f}" y="{height - 6}" class="host">'
                       f'host {host}</text>')
    for i in range(round(y_max / step) + 1):
        v = i * step
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.2f}" y2="{y(v):.2f}" '
                   f'class="grid"/><text x="{left - 6}" y="{y(v) + 4:.2f}" class="ytick">'
                   f'{round(v, 6):g}</text>')
    out.append(f'<text transform="translate(14 {top + plot_h / 2}) rotate(-90)" class="axis">'
               f'{html.escape(unit)}</text>'
               f'<line x1="{left}" x2="{width - right}" y1="{base_y}" y2="{base_y}" '
               f'class="axisline"/>')
    rank_step = _label_step(slot, 26)
    for i, (r, vals) in enumerate(zip(ranks, values, strict=True)):
        x = left + i * slot + (slot - bar_w) / 2
        shown = [(p, c, vals.get(p, 0)) for p, c in parts.items() if vals.get(p, 0) > 0]
        heights = _segment_heights([v * plot_h / y_max for _, _, v in shown])
        seg_y = base_y
        for (part, colour, v), h in zip(shown, heights, strict=True):
            seg_y -= h
            tip = f"rank {r.rank} (host {r.host}): {part} {_num(v)} {unit}"
            out.append(f'<rect class="seg" data-rank="{r.rank}" data-part="{html.escape(part)}" '
                       f'x="{x:.2f}" y="{seg_y:.2f}" width="{bar_w:.2f}" height="{h:.2f}" '
                       f'fill="{colour}"><title>{html.escape(tip)}</title></rect>')
        if i % rank_step == 0:
            out.append(f'<text x="{x + bar_w / 2:.2f}" y="{base_y + 14}" class="xtick">'
                       f'{r.rank}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{base_y + 28}" class="axis">rank</text>')
    if limit and limit[0] > 0:
        label = html.escape(limit[1])
        out.append(f'<line class="capacity" x1="{left}" x2="{width - right}" '
                   f'y1="{y(limit[0]):.2f}" y2="{y(limit[0]):.2f}"><title>{label}</title></line>'
                   f'<text x="{width - right - 4}" y="{y(limit[0]) - 5:.2f}" class="limit">'
                   f'{label}</text>')
    out.append("</svg>")
    legend = "".join(f'<span><i style="background:{c}"></i>{html.escape(p)}</span>'
                     for p, c in parts.items())
    if limit:
        legend += '<span><i class="capline"></i>capacity</span>'
    return (f'<figure><figcaption>{html.escape(title)}</figcaption>{"".join(out)}'
            f'<div class="legend">{legend}<span class="note">hover a segment for its value; '
            f'the thinnest are drawn {MIN_SEGMENT_PX:g} px high</span></div></figure>')


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
 margin:24px auto;max-width:1200px;padding:0 16px}
h1{font-size:22px;margin:0 0 2px}h2{font-size:17px;margin:28px 0 8px}.sub{color:#666;margin:0}
.warnings{background:#fff4e5;border-left:4px solid #e8590c;padding:8px 14px;margin:14px 0}
.warnings ul{margin:4px 0;padding-left:20px}.warnings li{margin:3px 0}.ok{color:#2b8a3e}
table{border-collapse:collapse;font-size:13px}th,td{padding:3px 9px;border-bottom:1px solid #e4e4e4}
th{background:#f6f6f6;text-align:left;position:sticky;top:0}
.n{text-align:right;font-variant-numeric:tabular-nums}
table.summary th{background:none;font-weight:normal;color:#555}table.summary td{font-weight:600}
.scroll{max-height:640px;overflow:auto;border:1px solid #e4e4e4;display:inline-block;max-width:100%}
figure{margin:12px 0 24px}figcaption{font-weight:600;margin-bottom:4px}
svg.chart{width:100%;height:auto}.grid{stroke:#e2e2e2}.axisline{stroke:#888}
.capacity{stroke:#c92a2a;stroke-width:2;stroke-dasharray:7 4}
text{font-size:11px;fill:#555}.ytick{text-anchor:end}.xtick,.host,.axis{text-anchor:middle}
.host{fill:#888}.limit{text-anchor:end;fill:#c92a2a;font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;font-size:12px;color:#444}
.legend i{display:inline-block;width:12px;height:12px;margin-right:5px;vertical-align:-2px}
.legend i.capline{height:0;border-top:2px dashed #c92a2a;vertical-align:3px}
.legend .note{color:#888;margin-left:auto}
"""


def _html_table(header: Sequence[str], rows: Iterable[Sequence[str]], text_columns: int,
                cls: str = "", row_classes: Optional[dict[int, str]] = None) -> str:
    def cell(tag: str, i: int, text: str) -> str:
        return f'<{tag}{" class=n" if i >= text_columns else ""}>{html.escape(text)}</{tag}>'

    def tr(n: int) -> str:
        own = (row_classes or {}).get(n)
        return f'<tr class="{own}">' if own else "<tr>"

    # Underscores become spaces so that long component names wrap instead of widening the table.
    head = "".join(cell("th", i, h.replace("_", " ")) for i, h in enumerate(header))
    body = "".join(tr(n) + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>"
                   for n, row in enumerate(rows))
    return (f'<div class="scroll"><table class="{cls}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{body}</tbody></table></div>')


def render_html(report: PlanReport) -> str:
    """The report as one self-contained HTML page (``plan.html``): inline CSS and SVG, no script.

    Args:
        report: a planner report (``PlanResult.report``, or ``PlanReport.from_dict`` of a
            loaded ``plan.json``).

    Returns:
        The HTML document.
    """
    title, subtitle = _title(report)
    tier, ranks = report.memory_tier, report.ranks
    if report.warnings:
        items = "".join(f"<li>{html.escape(w)}</li>" for w in report.warnings)
        warnings = f'<div class="warnings"><strong>Warnings</strong><ul>{items}</ul></div>'
    else:
        warnings = '<p class="ok">No warnings.</p>'
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                      for k, v in _summary_rows(report))
    parts = _memory_parts(report)
    capacity = report.summary.rank_memory_capacity_bytes / GIB
    memory_chart = _bar_chart(
        f"{_label(tier)} per rank (GiB)", "GiB", ranks,
        [{p: r.memory[tier].get(p) / GIB for p in parts} for r in ranks],
        {p: MEMORY_PARTS.get(p, UNKNOWN_PART_COLOUR) for p in parts},
        (capacity, f"capacity {_num(capacity)} GiB"))
    time_chart = _bar_chart(
        "Estimated time per rank and step (ms)", "ms", ranks,
        [{p: r.time_ms.part(p) for p in TIME_PARTS} for r in ranks], TIME_PARTS)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>
<h1>{html.escape(title)}</h1><p class="sub">{html.escape(subtitle)}</p>
{warnings}
<table class="summary">{summary}</table>
<h2>Memory</h2>{memory_chart}
<h2>Estimated time</h2>{time_chart}
<h2>Tables</h2>{_html_table(*_table_rows(report), text_columns=TABLE_TEXT_COLUMNS)}
<h2>Ranks</h2>{_html_table(*_rank_rows(report), text_columns=0)}
</body></html>
"""


def render_sweep_html(config: str, header: Sequence[str], rows: Sequence[Sequence[str]],
                      best: Optional[int]) -> str:
    """``embedtrain plan --cluster A --cluster B [--hosts]``'s page (``sweep.html``): one row
    per candidate cluster, the smallest that fits (row ``best``) marked."""
    name = html.escape(rows[best][0]) if best is not None else "none"
    table = _html_table(header, rows, text_columns=len(header),
                        row_classes={best: "best"} if best is not None else None)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sweep: {html.escape(config)}</title><style>{_CSS}tr.best td{{background:#d4f4d4}}</style>
</head><body>
<h1>Which cluster fits {html.escape(config)}</h1>{table}
<p>smallest that fits: {name}</p>
</body></html>
"""


def render_json(report: PlanReport) -> str:
    """The report as ``plan.json``'s text: ``report.to_dict()``, indented, ending in a newline."""
    return json.dumps(report.to_dict(), indent=2) + "\n"


def write_report(report: PlanReport, out_dir: str | pathlib.Path,
                 formats: Iterable[str] = FORMATS) -> list[pathlib.Path]:
    """Writes ``plan.json``, ``plan.md`` and/or ``plan.html`` into ``out_dir`` (created if need be).

    Args:
        report: a planner report (``PlanResult.report``).
        out_dir: the directory to write into.
        formats: any of ``"json"``, ``"md"``, ``"html"`` (a single name is accepted too).

    Returns:
        The paths written, in the order of ``formats``.

    Raises:
        ValueError: an unknown format; nothing is written then.
    """
    formats = list(dict.fromkeys([formats] if isinstance(formats, str) else formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown report format(s) {', '.join(map(repr, unknown))} "
                         f"(allowed: {', '.join(FORMATS)})")
    render: dict[str, Callable[[PlanReport], str]] = {
        "json": render_json,
        "md": render_markdown,
        "html": render_html,
    }
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = out / f"plan.{fmt}"
        write_atomic(path, render[fmt](report))
        paths.append(path)
    return paths
