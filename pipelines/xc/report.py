"""``ingest_report.json`` and ``metadata.json`` of an XC ingestion job (:mod:`pipelines.xc.passes`).

``metadata.json`` is what ``task: xc`` reads, with the keys ``embedtrain datagen xc`` writes
(``task``, ``label``, ``dense``, ``sparse`` (the tokens), ``splits``, ``num_classes``,
``label_column``, ``multi_label``, ``labels_per_row``, ``max_labels``, ``token_column``,
``vocab_size``: the token table's size) plus ``class_counts`` (the train split's label count of
every class, in class order; :func:`embedtrain.data.stats.class_counts` returns it), ``null_id``,
``vocab_sizes``, ``vocab_files``, ``hash_buckets``, ``dense_stats``, ``source`` and the resolved
``spec``.

``ingest_report.json`` answers "what happened to my rows": ``rows_read``, ``rows_written`` per
split, ``rows_dropped`` by reason, the same per input file (``files``, with each repository
file's header), ``dropped_examples`` (the first ``dropped_line_examples`` dropped lines of each
reason, by file: 1-based line numbers, the header being line 1; parquet: 0-based rows),
``labels`` (classes, labels per row, ``labels_removed`` by reason, rows without a label given),
``tokens`` (table size, rows without tokens, lengths, truncation, vocabulary and
out-of-vocabulary rates), ``repairs`` (dense values filled), ``split``, ``warnings``, phases.

Example:
    >>> report = json.load(open("data/eurlex/ingest_report.json"))  # doctest: +SKIP
    >>> report["dropped_examples"]["feature_without_colon"]
    [{'file': 'eurlex/train.txt', 'lines': [1207]}]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import polars as pl

from embedtrain.config_io import to_dict
from pipelines.core.encode import Vocabulary
from pipelines.core.fields import Encoding, SparseSpec, SplitMethod
from pipelines.core.inputs import FILE
from pipelines.core.output import SPLIT, SPLITS
from pipelines.core.report import DROP, FORMAT_VERSION, dataset_name, written_splits
from pipelines.core.stats import finite, oov_rates
from pipelines.xc.read import NO_LABEL, XCLayout
from pipelines.xc.spec import XCIngestSpec


class XCStats:
    """The row-statistics groups (file, split, drop code) of :mod:`pipelines.xc.passes`, with
    accessors for the checks, the report and the metadata."""

    def __init__(self, groups: pl.DataFrame, reasons: list[str], files: list[str]) -> None:
        self.groups, self.reasons, self.files = groups, reasons, files
        self._kept = groups.filter(pl.col(DROP).is_null())

    @property
    def kept_groups(self) -> pl.DataFrame:
        return self._kept

    @property
    def rows_read(self) -> int:
        return int(self.groups["rows"].sum()) if self.groups.height else 0

    def kept(self, split: Optional[str] = None, key: str = "rows") -> int:
        part = self._kept if split is None else self._kept.filter(pl.col(SPLIT) == split)
        return int(part[key].sum() or 0) if part.height and key in part.columns else 0

    @property
    def kept_total(self) -> int:
        return self.kept()

    def kept_extreme(self, key: str, largest: bool) -> Optional[int]:
        column = self._kept[key] if self._kept.height else None
        if column is None or column.null_count() == len(column):
            return None
        return int(column.max() if largest else column.min())

    def file_rows(self, path: str) -> int:
        part = self.groups.filter(pl.col(FILE) == path)
        return int(part["rows"].sum()) if part.height else 0

    def dropped(self, path: Optional[str] = None) -> dict[str, int]:
        """Dropped rows by reason (of one file, or all)."""
        part = self.groups.filter(pl.col(DROP).is_not_null())
        if path is not None:
            part = part.filter(pl.col(FILE) == path)
        out: dict[str, int] = {}
        for code, rows in part.group_by(DROP).agg(pl.col("rows").sum()).iter_rows():
            out[self.reasons[code]] = out.get(self.reasons[code], 0) + int(rows)
        return dict(sorted(out.items()))

    def written(self, path: str) -> dict[str, int]:
        part = self._kept.filter(pl.col(FILE) == path)
        return {s: int(part.filter(pl.col(SPLIT) == s)["rows"].sum() or 0) for s in SPLITS}

    def labels_removed(self) -> dict[str, int]:
        """Labels removed from rows that parse (kept rows and ``no_label`` ones), by reason."""
        code = self.reasons.index(NO_LABEL)
        part = self.groups.filter(pl.col(DROP).is_null() | (pl.col(DROP) == code))
        out = {"label_out_of_vocabulary": int(part["labels_out_of_vocabulary"].sum() or 0),
               "duplicate_label": int(part["labels_duplicate"].sum() or 0)}
        return {k: v for k, v in out.items() if v}

    def rows_without_label_given(self) -> int:
        code = self.reasons.index(NO_LABEL)
        part = self.groups.filter(pl.col(DROP) == code)
        return int(part["labels_none_given"].sum() or 0) if part.height else 0


def dense_statistics(stats: XCStats, spec: XCIngestSpec) -> dict[str, dict]:
    """Per dense feature: the training split's mean/std (a constant feature: std 1)."""
    part = stats.kept_groups.filter(pl.col(SPLIT) == "train")
    out = {}
    for d in spec.dense:
        mean = part[f"{d.name}:mean"][0] if part.height else None
        std = part[f"{d.name}:std"][0] if part.height else None
        mean, std = float(mean or 0.0), float(std or 0.0)
        out[d.name] = {"mean": mean, "std": std if std > 0 else 1.0, "standardized": d.standardize,
                       "log1p": d.log1p, "clip_min": d.clip_min, "clip_max": d.clip_max,
                       "fill_null": d.fill_null}
    return out


def label_name(spec: XCIngestSpec, layout: XCLayout) -> str:
    if spec.labels.name is not None:
        return spec.labels.name
    return "labels" if layout.multi_label else "label"


@dataclass
class XCOutputs:
    """What the report and the metadata are built from."""

    spec: XCIngestSpec
    layout: XCLayout
    files: list[Path]
    stats: XCStats
    written: dict[str, list[tuple[str, int]]]
    token: SparseSpec
    token_vocab: Optional[Vocabulary]
    token_counts: Optional[pl.DataFrame]  # __split, value, count (vocab tokens)
    label_vocab: Optional[Vocabulary]
    class_counts: np.ndarray
    label_name: str
    vocab_files: dict[str, str]
    dense_stats: dict[str, dict]

    @property
    def num_embeddings(self) -> int:
        t = self.token
        if t.encoding is Encoding.VOCAB:
            return len(self.token_vocab) + 1
        return t.hash_buckets if t.encoding is Encoding.HASH else t.num_embeddings

    @property
    def max_length(self) -> int:
        return max(self.stats.kept_extreme("tokens_max", largest=True) or 0, 1)

    @property
    def labels_per_row(self) -> list[int]:
        lo = self.stats.kept_extreme("labels_min", largest=False) or 1
        hi = self.stats.kept_extreme("labels_max", largest=True) or 1
        return [lo, hi]


def build_report(c: XCOutputs, examples: dict[str, list[dict]], warnings: list[str],
            phases: list[dict], wall_seconds: float) -> dict:
    """The ``ingest_report.json`` dict."""
    spec, stats = c.spec, c.stats
    dropped = stats.dropped()
    written = {split: sum(n for _, n in c.written[split]) for split in SPLITS}
    kept = stats.kept_total
    files = []
    for f in c.files:
        entry: dict[str, Any] = {"file": str(f), "rows_read": stats.file_rows(str(f)),
                                 "rows_written": stats.written(str(f)),
                                 "rows_dropped": stats.dropped(str(f))}
        header = c.layout.headers.get(str(f))
        if header is not None:
            entry["header"] = {"rows": header.rows, "features": header.features,
                               "labels": header.labels}
        files.append(entry)
    labels: dict[str, Any] = {
        "column": c.label_name, "encoding": spec.label_encoding.value,
        "num_classes": len(c.class_counts), "multi_label": c.layout.multi_label,
        "labels_per_row": c.labels_per_row,
        "mean_labels_per_row": _rate(stats.kept(key="labels"), kept),
        "labels_written": stats.kept(key="labels"),
        "labels_removed": stats.labels_removed(),
        "rows_without_label_given": stats.rows_without_label_given(),
        "classes_without_train_labels": int((c.class_counts == 0).sum()),
    }
    if c.label_vocab is not None:
        labels.update(min_frequency=spec.labels.min_frequency,
                      max_vocab_size=spec.labels.max_vocab_size)
    tokens: dict[str, Any] = {
        "column": c.token.name, "encoding": c.token.encoding.value,
        "num_embeddings": c.num_embeddings,
        "rows_without_tokens": stats.kept(key="tokens_empty"),
        "mean_length": _rate(stats.kept(key="tokens"), kept), "max_length": c.max_length,
        "rows_truncated": stats.kept(key="tokens_truncated"),
    }
    if spec.repository:
        tokens["values"] = (f"kept in column {spec.tokens.values_column}"
                            if spec.tokens.values_column else "dropped (not used by the encoder)")
    if c.token_vocab is not None:
        assert c.token_counts is not None
        table = pl.DataFrame({"value": c.token_vocab.values})
        tokens.update(vocab_size=len(c.token_vocab), min_frequency=c.token.min_frequency,
                      max_vocab_size=c.token.max_vocab_size,
                      distinct_train_values=int((c.token_counts[SPLIT] == "train").sum()),
                      oov_rate=oov_rates(c.token_counts, table))
    repairs: dict[str, dict[str, int]] = {"dense_null_filled": {}, "unparsable_number": {},
                                          "dense_non_finite_filled": {}}
    dense = {}
    for d in spec.dense:
        nulls, bad = stats.kept(key=f"{d.name}:null"), stats.kept(key=f"{d.name}:unparsable")
        if nulls - bad:
            repairs["dense_null_filled"][d.name] = nulls - bad
        if bad:
            repairs["unparsable_number"][d.name] = bad
        if stats.kept(key=f"{d.name}:non_finite"):  # non_finite: fill (else the job stopped)
            repairs["dense_non_finite_filled"][d.name] = stats.kept(key=f"{d.name}:non_finite")
        dense[d.name] = {"null_rate": _rate(nulls, kept),
                         "train_mean": finite(c.dense_stats[d.name]["mean"]),
                         "train_std": finite(c.dense_stats[d.name]["std"])}
    s = spec.split
    split_info: dict[str, Any] = {"method": s.resolved_method.value, "column": s.column,
                                  "valid_fraction": s.fraction("valid"),
                                  "test_fraction": s.fraction("test"), "seed": s.hash_seed}
    if s.resolved_method is SplitMethod.FILES:
        split_info["files"] = s.files
    report = {
        "name": dataset_name(spec, c.files, "xc"),
        "kind": "xc",
        "format": spec.input.format.value,
        "inputs": [str(f) for f in c.files],
        "rows_read": stats.rows_read,
        "rows_written": written,
        "rows_written_total": sum(written.values()),
        "rows_dropped": dropped,
        "rows_dropped_total": sum(dropped.values()),
        "files": files,
        "dropped_examples": examples,
        "dropped_examples_limit": spec.dropped_line_examples,
        "labels": labels,
        "tokens": tokens,
        "repairs": {k: v for k, v in repairs.items() if v},
        "split": split_info,
        "files_written": {split: len(c.written[split]) for split in SPLITS},
        "phases": phases,
        "wall_seconds": round(wall_seconds, 3),
    }
    if dense:
        report["dense"] = dense
    if warnings:
        report["warnings"] = warnings
    return report


def build_metadata(c: XCOutputs) -> dict:
    """The ``metadata.json`` dict: ``embedtrain datagen xc``'s keys, plus ``class_counts`` (the
    train split's label count of every class, in class order) and the ingest keys."""
    spec = c.spec
    multi = c.layout.multi_label
    per_row = c.labels_per_row if multi else [1, 1]
    meta = {
        "format_version": FORMAT_VERSION,
        "name": dataset_name(spec, c.files, "xc"),
        "task": "xc",
        "label": c.label_name,
        "dense": [d.name for d in spec.dense],
        "dense_transform": "none",
        "sparse": [{"name": c.token.name, "num_embeddings": c.num_embeddings, "multi_hot": True,
                    "max_length": c.max_length}],
        "splits": {split: {"files": [f for f, _ in c.written[split]],
                           "rows": sum(n for _, n in c.written[split])}
                   for split in written_splits(c.written)},
        "num_classes": len(c.class_counts),
        "label_column": c.label_name,
        "multi_label": multi,
        "labels_per_row": per_row,
        "max_labels": per_row[1],
        "token_column": c.token.name,
        "vocab_size": c.num_embeddings,  # the token table (ids 0..vocab_size-1), as datagen's
        "class_counts": c.class_counts.tolist(),
        "null_id": 0,
        "vocab_sizes": {c.token.name: len(c.token_vocab)} if c.token_vocab is not None else {},
        "vocab_files": c.vocab_files,
        "hash_buckets": ({c.token.name: c.token.hash_buckets}
                         if c.token.encoding is Encoding.HASH else {}),
        "dense_stats": c.dense_stats,
        "source": {"format": spec.input.format.value, "files": [str(f) for f in c.files],
                   "rows_read": c.stats.rows_read},
        "spec": _spec_dict(spec),
    }
    return meta


def _spec_dict(spec: XCIngestSpec) -> dict:
    """The spec as plain data; ``non_finite`` left out of dense entries at its default, so that
    the data set of an earlier spec is byte-identical to what it was."""
    raw = to_dict(spec)
    for entry in raw.get("dense", []):
        if entry.get("non_finite") == "error":
            entry.pop("non_finite")
    return raw


def _rate(n: float, total: float) -> Optional[float]:
    return round(float(n) / total, 6) if total else None


def summary_lines(report: dict, out: str | os.PathLike, engine: str) -> list[str]:
    """What ``embedtrain ingest`` prints when the job is done (``engine``: its name)."""
    written = ", ".join(f"{k} {v:,}" for k, v in report["rows_written"].items())
    dropped = ", ".join(f"{k} {v:,}" for k, v in report["rows_dropped"].items()) or "none"
    labels = report["labels"]
    removed = ", ".join(f"{k} {v:,}" for k, v in labels["labels_removed"].items()) or "none"
    return [f"read {report['rows_read']:,} rows from {len(report['inputs'])} file(s) in "
            f"{report['wall_seconds']:.1f} s ({engine} engine)",
            f"written: {written}",
            f"dropped: {dropped}",
            f"labels: {labels['num_classes']:,} classes, {labels['labels_per_row'][0]}-"
            f"{labels['labels_per_row'][1]} per row; removed: {removed}",
            f"tokens: {report['tokens']['num_embeddings']:,} ids (0: unknown), "
            f"{report['tokens']['rows_without_tokens']:,} row(s) without tokens",
            f"data set: {out}/ (metadata.json, ingest_report.json, train/ valid/ test/, vocab/)"]
