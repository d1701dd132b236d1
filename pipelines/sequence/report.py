"""The sequence job's outputs besides the rows: ``ingest_report.json``, ``metadata.json`` and the
lines ``embedtrain ingest`` prints.

The report follows the accounting rule of :mod:`pipelines.core.report` for events: ``rows_read``
= ``events_used`` + ``events_dropped`` by reason. ``metadata.json`` holds the keys
``embedtrain datagen seq`` writes (``task: seq``, ``num_items``, the column names, the splits),
plus ``vocab_files``, ``source`` and the resolved ``spec``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from embedtrain.config_io import to_dict
from pipelines.core.report import FORMAT_VERSION, dataset_name

USER_COLUMN, ITEMS_COLUMN, TARGET_COLUMN = "user", "items", "target"


def build_report(spec: Any, engine: dict, inputs: list[dict], read: int, used: int,
                 dropped: dict[str, int], *, users: int, kept_users: int, num_items: int,
                 splits: dict, written: dict[str, list[tuple[str, int]]], phases: list[dict],
                 seconds: float) -> dict:
    """The ``ingest_report.json`` dict."""
    history = {}
    for split, rows in splits.items():
        lengths = rows.hi - rows.lo
        history[split] = ({"mean": round(float(lengths.mean()), 3), "max": int(lengths.max()),
                           "min": int(lengths.min())} if len(lengths) else None)
    return {
        "kind": "sequence",
        "task": spec.task,
        "format_version": FORMAT_VERSION,
        "engine": engine,
        "inputs": inputs,
        "rows_read": read,
        "events_used": used,
        "events_dropped": dropped,
        "users": {"read": users, "kept": kept_users, "dropped_short_history": users - kept_users},
        "num_items": num_items,
        "rows_written": {s: sum(n for _, n in written[s]) for s in written},
        "files": {s: [f for f, _ in written[s]] for s in written},
        "history_length": history,
        "split": to_dict(spec.split),
        "max_length": spec.max_length,
        "min_length": spec.min_length,
        "phases": phases,
        "wall_seconds": round(seconds, 3),
    }


def build_metadata(spec: Any, report: dict, files: Sequence[Path]) -> dict:
    """The ``metadata.json`` dict (the layout of :mod:`embedtrain.datagen.seq`'s data sets)."""
    rows = report["rows_written"]
    return {
        "format_version": FORMAT_VERSION,
        "name": dataset_name(spec, files, "sequence"),
        "task": "seq",
        "num_items": report["num_items"] + 1,  # ids 1..V and the padding row 0
        "num_users": report["users"]["kept"],
        "max_length": spec.max_length,
        "min_length": spec.min_length,
        "split_method": spec.split.method.value,
        "user_column": USER_COLUMN,
        "items_column": ITEMS_COLUMN,
        "target_column": TARGET_COLUMN,
        # the rows as the training readers see them: a multi-hot id feature and a class label
        "label": TARGET_COLUMN, "dense": [], "num_classes": report["num_items"] + 1,
        "sparse": [{"name": ITEMS_COLUMN, "num_embeddings": report["num_items"] + 1,
                    "multi_hot": True, "max_length": spec.max_length}],
        "events": report["events_used"],
        "splits": {s: {"files": report["files"][s], "rows": rows[s]}
                   for s in report["files"] if s == "train" or rows[s]},
        "null_id": 0,
        "vocab_files": {"item": "vocab/item.parquet"},
        "source": {"format": spec.input.format.value, "files": [str(f) for f in files],
                   "rows_read": report["rows_read"]},
        "spec": to_dict(spec),
    }


def summary_lines(report: dict, out: str | os.PathLike, engine: str) -> list[str]:
    """What ``embedtrain ingest`` prints when the job is done (``engine``: its name)."""
    dropped = ", ".join(f"{k} {v:,}" for k, v in report["events_dropped"].items() if v) or "none"
    rows = report["rows_written"]
    history = report["history_length"].get("test") or {}
    mean = history.get("mean")
    return [f"read {report['rows_read']:,} events from {len(report['inputs'])} file(s) in "
            f"{report['wall_seconds']:.1f} s ({engine} engine)",
            f"users: {report['users']['kept']:,} kept, {report['users']['dropped_short_history']:,}"
            f" with fewer than {report['min_length']} events dropped; items: "
            f"{report['num_items']:,} ({_id_range(report)})",
            f"rows: train {rows.get('train', 0):,}, valid {rows.get('valid', 0):,}, test "
            f"{rows.get('test', 0):,} ({report['split']['method']}; test history "
            f"{'-' if mean is None else f'{mean:.1f}'} items on average, at most "
            f"{report['max_length']})",
            f"events: {report['events_used']:,} used; dropped: {dropped}",
            f"data set: {out}/ (metadata.json, ingest_report.json, train/ valid/ test/, vocab/"
            f"{', items.parquet' if report.get('task') == 'retrieval' else ''})"]


def _id_range(report: dict) -> str:
    n = report["num_items"]
    return f"ids 0..{n - 1:,}: the item table" if report.get("task") == "retrieval" else \
        f"ids 1..{n:,}"

