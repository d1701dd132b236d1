"""What the graph job reports: ``ingest_report.json`` (built by :mod:`pipelines.graph.passes`:
edges read, dropped by reason, merged and stored; nodes from the table and the edges; the
splits) and the summary lines ``embedtrain ingest`` prints."""

from __future__ import annotations

import os


def summary_lines(report: dict, out: str | os.PathLike, engine: str) -> list[str]:
    """What ``embedtrain ingest`` prints when the job is done (``engine``: its name)."""
    e, n = report["edges"], report["nodes"]
    dropped = ", ".join(f"{k} {v:,}" for k, v in e["rows_dropped"].items() if v) or "none"
    held = ", ".join(f"{k} {v:,}" for k, v in e["held_out"].items()) or "none"
    return [f"read {e['rows_read']:,} edge rows from {len(report['inputs']['edges'])} file(s) in "
            f"{report['wall_seconds']:.1f} s ({engine} engine)",
            f"graph: {n['num_nodes']:,} nodes, {e['csr_entries']:,} CSR entries "
            f"({'directed' if e['directed'] else 'undirected'}), held-out edges: {held}",
            f"dropped: {dropped}; duplicates merged: {e['duplicates_merged']:,}",
            f"data set: {out}/ (metadata.json, ingest_report.json, graph/, nodes/, splits/)"]
