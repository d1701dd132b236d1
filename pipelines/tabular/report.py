"""``metadata.json`` and ``ingest_report.json`` of an ingestion job, built from its statistics.

``metadata.json`` is the trainer's contract (read by :func:`embedtrain.features.load_dataset_meta`):
``format_version``, ``name``, ``label``, ``dense``, ``dense_transform: "none"`` (dense columns are
already transformed), ``sparse`` (output names: name, num_embeddings, multi_hot, max_length;
``encoding: raw`` features add ``raw: true``, and their num_embeddings is the training split's
distinct ids, at least 1: a capacity hint for a dynamic table, not a bound on the ids),
``splits`` (files relative to the data set folder, rows; train always, valid and test only when
they received rows), ``bucket_boundaries`` (only with bucketized features), plus
``vocab_sizes``, ``hash_buckets``, ``dense_stats``, ``vocab_files``, ``split``, ``source`` and the
resolved ``spec`` (sparse ``dtype`` filled in from the input) for serving and for reruns.

``ingest_report.json`` answers "what happened to my rows": ``rows_read``, ``rows_written`` per
split, ``rows_dropped`` by reason (and ``rows_dropped_by_column``), ``repairs`` by kind and column
(``unparsable_number``: text that did not parse as a number, in a ``cast: float`` dense feature or
a bucketized one), ``warnings`` (an empty valid/test split),
per-feature null and out-of-vocabulary rates (``encoding: raw`` features: ``distinct_train_ids``,
``distinct_ids_by_split`` and ``unseen_in_train``, the valid/test ids that never occur in train),
the split cut-offs and the phases' timings.

Example:
    >>> report = json.load(open("data/ctr_ingested/ingest_report.json"))  # doctest: +SKIP
    >>> report["rows_dropped"]
    {'null_label': 12}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import polars as pl

from embedtrain.config_io import to_dict
from pipelines.core.errors import IngestError
from pipelines.core.encode import Vocabulary
from pipelines.core.fields import EmptyList, Encoding, SparseSpec, SplitMethod
from pipelines.core.output import SPLIT, SPLITS
from pipelines.core.report import FORMAT_VERSION, written_splits
from pipelines.core.stats import finite, oov_rates
from pipelines.tabular.spec import IngestSpec
from pipelines.tabular.stats import PassStats


def dense_statistics(stats: PassStats, spec: IngestSpec) -> dict[str, dict]:
    """Per dense feature: the training split's mean/std of the filled, clipped, log1p'd value.

    A constant feature is standardised with std 1, so it becomes 0 rather than NaN or noise:
    "constant" is a std within rounding of 0 (``<= 1e-12 * max(1, |mean|)``), which is what
    summing a constant in floating point leaves (and the Ray engine's merge of per-file
    deviations).
    """
    out = {}
    for d in spec.dense:
        mean = float(stats.stat("train", f"{d.name}:mean") or 0.0)
        std = float(stats.stat("train", f"{d.name}:std") or 0.0)
        constant = std <= 1e-12 * max(1.0, abs(mean))
        out[d.name] = {
            "mean": mean, "std": 1.0 if constant else std, "standardized": d.standardize,
            "log1p": d.log1p, "clip_min": d.clip_min, "clip_max": d.clip_max,
            "fill_null": d.fill_null,
        }
    return out


def bucket_boundaries(stats: PassStats, spec: IngestSpec) -> dict[str, list[float]]:
    """Per bucketized feature: its ``bucketize`` boundaries, or the training split's
    ``i/quantiles`` quantiles (i = 1..N-1; repeated values once, so a skewed column may get fewer
    buckets)."""
    out: dict[str, list[float]] = {}
    for s in spec.sparse:
        if s.bucketize is not None:
            out[s.name] = [float(b) for b in s.bucketize]
        elif s.quantiles is not None:
            qs = [stats.stat("train", f"{s.name}:q{i}") for i in range(1, s.quantiles)]
            if stats.kept_rows("train") - stats.stat("train", f"{s.name}:null") <= 0:
                qs = []
            out[s.name] = sorted({float(q) for q in qs if q is not None})
    return out


def num_embeddings(spec_feature: SparseSpec, vocab: Optional[Vocabulary],
                   boundaries: Optional[list[float]] = None,
                   raw_ids: Optional[dict] = None) -> int:
    """Table size: vocabulary + the null/unknown id 0, hash buckets, buckets + id 0, or the
    declared size; for a raw feature the training split's distinct ids (``raw_ids``:
    :func:`pipelines.tabular.stats.raw_id_counts`'s entry), at least 1."""
    if spec_feature.encoding is Encoding.RAW:
        assert raw_ids is not None
        return max(1, raw_ids["distinct"]["train"] or 0)
    if spec_feature.bucketized:
        assert boundaries is not None
        return len(boundaries) + 2
    if spec_feature.encoding is Encoding.VOCAB:
        return len(vocab) + 1
    if spec_feature.encoding is Encoding.HASH:
        return spec_feature.hash_buckets
    return spec_feature.num_embeddings


def _max_length(s: SparseSpec, stats: PassStats) -> int:
    if not s.multi_hot:
        return 1
    observed = max(int(stats.stat(split, f"{s.name}:max_length")) for split in SPLITS)
    if s.max_length is not None:
        observed = min(observed, s.max_length)
    return max(observed, 1)


# keys added to the spec after format 1 shipped: left out of metadata.json's ``spec`` while at
# their defaults, so that the data set of an older spec is byte-identical to what it was
_NEW_SPEC_KEYS = {"dense": {"cast": None, "non_finite": "error"},
                  "sparse": {"column": None, "bucketize": None, "quantiles": None},
                  "split": {"values": None, "files": None}}


def spec_dict(spec: IngestSpec) -> dict:
    """The resolved spec as plain data, without new keys at their defaults."""
    raw = to_dict(spec)
    for section, keys in _NEW_SPEC_KEYS.items():
        entries = raw[section] if isinstance(raw[section], list) else [raw[section]]
        for entry in entries:
            for key, default in keys.items():
                if entry.get(key, default) == default:
                    entry.pop(key, None)
    return raw


def build_metadata(spec: IngestSpec, files: Sequence[Path], stats: PassStats,
                   written: dict[str, list[tuple[str, int]]], vocabs: dict[str, Vocabulary],
                   dense: dict[str, dict],
                   boundaries: Optional[dict[str, list[float]]] = None) -> dict:
    """The ``metadata.json`` dict (see the module docstring)."""
    boundaries = boundaries or {}
    sparse = [{"name": s.name,
               "num_embeddings": num_embeddings(s, vocabs.get(s.name), boundaries.get(s.name),
                                                stats.raw_ids.get(s.name)),
               "multi_hot": s.multi_hot, "max_length": _max_length(s, stats),
               **({"raw": True} if s.encoding is Encoding.RAW else {})}
              for s in spec.sparse]
    meta = {
        "format_version": FORMAT_VERSION,
        "name": spec.name,
        "label": spec.label,
        "label_range": spec.label_range,
        "dense": [d.name for d in spec.dense],
        "dense_transform": "none",
        "sparse": sparse,
        "splits": {split: {"files": [f for f, _ in written[split]],
                           "rows": sum(r for _, r in written[split])}
                   for split in written_splits(written)},
        "null_id": 0,  # vocab and hash features: null and unknown values
        "vocab_sizes": {s.name: len(vocabs[s.name]) for s in spec.sparse if s.name in vocabs},
        "vocab_files": {name: f"vocab/{name}.parquet" for name in vocabs},
        "hash_buckets": {s.name: s.hash_buckets for s in spec.sparse
                         if s.encoding is Encoding.HASH},
        "dense_stats": dense,
        "source": {"format": spec.input.format.value, "files": [str(f) for f in files],
                   "rows_read": stats.rows_read},
        "spec": spec_dict(spec),
    }
    if boundaries:  # bucketized features: ids 1 + #{b <= x}, 0 for null
        meta["bucket_boundaries"] = boundaries
    return meta


def build_report(spec: IngestSpec, files: Sequence[Path], stats: PassStats,
                 written: dict[str, list[tuple[str, int]]], vocabs: dict[str, Vocabulary],
                 dense: dict[str, dict], cutoffs: Optional[tuple[float, float]],
                 phases: list[dict], wall_seconds: float,
                 boundaries: Optional[dict[str, list[float]]] = None,
                 warnings: Optional[list[str]] = None) -> dict:
    """The ``ingest_report.json`` dict (see the module docstring)."""
    boundaries = boundaries or {}
    dropped = stats.dropped()
    kept = {split: stats.kept_rows(split) for split in SPLITS}
    kept_total = sum(kept.values())
    repairs: dict[str, dict[str, int]] = {
        "dense_null_filled": {}, "unparsable_number": {}, "dense_non_finite_filled": {},
        "dense_clipped": {},
        "categorical_null_to_id_0": {}, "list_truncated": {}, "empty_list_to_id_0": {}}

    def add(kind: str, column: str, n: float) -> None:
        if n:
            repairs[kind][column] = int(n)

    features: dict[str, dict] = {}
    for d in spec.dense:
        nulls = stats.total(f"{d.name}:null")
        bad = stats.total(f"{d.name}:unparsable") if d.cast is not None else 0
        add("dense_null_filled", d.name, nulls - bad)  # a value that did not parse is no null
        add("unparsable_number", d.name, bad)
        add("dense_non_finite_filled", d.name, stats.total(f"{d.name}:non_finite"))
        add("dense_clipped", d.name, stats.total(f"{d.name}:clipped"))
        features[d.name] = {
            "kind": "dense",
            "null_rate": _rate(nulls, kept_total),
            "null_rate_by_split": {s: _rate(stats.stat(s, f"{d.name}:null"), kept[s])
                                   for s in SPLITS},
            "train_mean": finite(dense[d.name]["mean"]), "train_std": finite(dense[d.name]["std"]),
        }
    for s in spec.sparse:
        nulls = stats.total(f"{s.name}:null")
        info: dict = {"kind": "sparse", "encoding": s.encoding.value,
                      "num_embeddings": num_embeddings(s, vocabs.get(s.name),
                                                       boundaries.get(s.name),
                                                       stats.raw_ids.get(s.name)),
                      "null_rate": _rate(nulls, kept_total),
                      "null_rate_by_split": {sp: _rate(stats.stat(sp, f"{s.name}:null"), kept[sp])
                                             for sp in SPLITS}}
        if s.column is not None:
            info["column"] = s.column
        if s.bucketized:
            info["encoding"] = "bucketize" if s.bucketize is not None else "quantiles"
            info["boundaries"] = boundaries[s.name]
        bad = stats.total(f"{s.name}:unparsable") if s.bucketized and spec.is_text else 0
        add("unparsable_number", s.name, bad)
        if s.encoding is not Encoding.PRE_ENCODED and not s.multi_hot:
            add("categorical_null_to_id_0", s.name, nulls - bad)
        if s.multi_hot:
            empty = stats.total(f"{s.name}:empty")
            info["empty_list_rate"] = _rate(empty, kept_total)
            info["mean_length"] = _rate(stats.total(f"{s.name}:elements"), kept_total)
            add("list_truncated", s.name, stats.total(f"{s.name}:truncated"))
            if s.empty_list is EmptyList.OOV:
                add("empty_list_to_id_0", s.name, nulls + empty)
        if s.name in stats.raw_ids:
            raw = stats.raw_ids[s.name]
            info["distinct_train_ids"] = raw["distinct"]["train"]
            info["distinct_ids_by_split"] = raw["distinct"]
            info["unseen_in_train"] = raw["unseen_in_train"]
        if s.name in vocabs:
            vocab, values = vocabs[s.name], stats.values[s.name]
            info["vocab_size"] = len(vocab)
            info["distinct_train_values"] = int((values[SPLIT] == "train").sum())
            info["oov_rate"] = oov_rates(values, pl.DataFrame({"value": vocab.values}))
        features[s.name] = info
    split_info: dict = {"method": spec.split.method.value, "column": spec.split.column}
    if spec.split.method is SplitMethod.TIME and cutoffs is not None:
        split_info["valid_start"], split_info["test_start"] = (finite(c, 3) for c in cutoffs)
    elif spec.split.method is SplitMethod.COLUMN:
        split_info["values"] = spec.split.values
    elif spec.split.method is SplitMethod.FILES:
        split_info["files"] = spec.split.files
    else:
        split_info.update(valid_fraction=spec.split.valid_fraction,
                          test_fraction=spec.split.test_fraction, seed=spec.split.hash_seed)
    written_rows = {split: sum(r for _, r in written[split]) for split in SPLITS}
    report = {
        "name": spec.name,
        "inputs": [str(f) for f in files],
        "rows_read": stats.rows_read,
        "rows_written": written_rows,
        "rows_written_total": sum(written_rows.values()),
        "rows_dropped": dropped,
        "rows_dropped_total": sum(dropped.values()),
        "rows_dropped_by_column": stats.dropped_by_column(),
        "repairs": {k: v for k, v in repairs.items() if v},
        "features": features,
        "split": split_info,
        "files_written": {split: len(written[split]) for split in SPLITS},
        "phases": phases,
        "wall_seconds": round(wall_seconds, 3),
    }
    if warnings:
        report["warnings"] = warnings
    return report


def _rate(n: float, total: float) -> Optional[float]:
    return round(float(n) / total, 6) if total else None


def check_counts(stats: PassStats, spec: IngestSpec, files: Sequence[Path],
                 inputs: Sequence[str | os.PathLike],
                 values: Optional[Callable[[str, str], list]] = None) -> None:
    """Refuses a job with no rows, no kept rows or no training rows (one line each). Without
    kept rows the line names the column behind the most drops and, given ``values`` (reason,
    column -> a few of the values that dropped rows), what it held."""
    where = files[0] if len(files) == 1 else ", ".join(map(str, inputs))
    if stats.rows_read == 0:
        raise IngestError(f"{where}: no rows to ingest ({len(files)} file(s), all empty)")
    kept = sum(stats.kept_rows(s) for s in SPLITS)
    if kept == 0:
        dropped = ", ".join(f"{k} {v:,}" for k, v in stats.dropped().items()) or "none"
        raise IngestError(f"{where}: no training rows to build vocabularies and statistics on "
                          f"({stats.rows_read:,} rows read; dropped: {dropped})"
                          f"{_drop_detail(stats, spec, values)}")
    if stats.kept_rows("train") == 0:
        others = ", ".join(f"{s} {stats.kept_rows(s):,}" for s in SPLITS if s != "train")
        raise IngestError(f"{where}: split train receives no rows ({others}); "
                          f"{_SPLIT_FIX[spec.split.method]('train')}")
    for name in [d.name for d in spec.dense] + [s.name for s in spec.sparse]:
        empty = stats.total(f"{name}:null") + stats.total(f"{name}:empty")  # lists: [] too
        if empty == kept:
            source = next((s.source for s in spec.sparse if s.name == name), name)
            raise IngestError(
                f"{where}: column {source}: empty in all {kept:,} rows kept, so feature {name} "
                "would be only its fill value (nothing to learn from); check the column's name "
                "and the separator, or remove the feature from the spec")


def _drop_detail(stats: PassStats, spec: IngestSpec,
                 values: Optional[Callable[[str, str], list]]) -> str:
    """``; column y: unparsable_value 299, values seen: 'yes', 'no'; ...``: the (reason, column)
    behind the most dropped rows, a few of its values, and what the rule is."""
    ranked = sorted(((n, reason, column) for reason, by_col in stats.dropped_by_column().items()
                     for column, n in by_col.items()), key=lambda t: (-t[0], t[1], t[2]))
    if not ranked:
        return ""
    n, reason, column = ranked[0]
    if reason == "wrong_field_count":
        return ""  # the count is the value: no column to name
    seen = values(reason, column) if values is not None else []
    text = f"; column {column}: {reason} {n:,}"
    if seen:
        text += ", values seen: " + ", ".join(repr(v) for v in seen)
    if column == spec.label and reason in ("unparsable_value", "label_out_of_range"):
        low, high = spec.label_range or ("-inf", "inf")
        text += (f"; the label must be a number in [{low:g}, {high:g}] (label_range; map text "
                 "labels such as yes/no to 1/0)") if spec.label_range else \
            "; the label must be a finite number"
    return text


_SPLIT_FIX = {
    SplitMethod.HASH: lambda split: "lower split.valid_fraction/split.test_fraction",
    SplitMethod.TIME: lambda split: ("lower split.valid_fraction/split.test_fraction (or move "
                                     "split.boundaries)"),
    SplitMethod.COLUMN: lambda split: (f"list the column's values of {split} in "
                                       f"split.values.{split}"),
    SplitMethod.FILES: lambda split: (f"give {split} files matching split.files.{split}"
                                      if split != "train" else
                                      "leave some files unmatched by split.files (they are train)"),
}


def empty_split_warnings(stats: PassStats, spec: IngestSpec) -> list[str]:
    """A line per empty valid/test split (left out of metadata.json): what training loses."""
    loses = {"valid": "training will not evaluate periodically or select a best checkpoint",
             "test": "training will report no final test metrics"}
    out = []
    for split in ("valid", "test"):
        if stats.kept_rows(split) == 0:
            if spec.split.method in (SplitMethod.HASH, SplitMethod.TIME):
                fix = f"set split.{split}_fraction > 0 to have one"
                if spec.split.method is SplitMethod.TIME and spec.split.boundaries is not None:
                    fix = "move split.boundaries to have one"
            else:
                fix = _SPLIT_FIX[spec.split.method](split) + " to have one"
            out.append(f"no {split} split: {loses[split]}; {fix}")
    return out


def summary_lines(report: dict, out: str | os.PathLike, engine: str) -> list[str]:
    """What ``embedtrain ingest`` prints when the job is done (``engine``: its name)."""
    written = ", ".join(f"{k} {v:,}" for k, v in report["rows_written"].items())
    dropped = ", ".join(f"{k} {v:,}" for k, v in report["rows_dropped"].items()) or "none"
    repaired = ", ".join(f"{k} {sum(v.values()):,}" for k, v in report["repairs"].items()) or "none"
    return [f"read {report['rows_read']:,} rows from {len(report['inputs'])} file(s) in "
            f"{report['wall_seconds']:.1f} s ({engine} engine)",
            f"written: {written}",
            f"dropped: {dropped}",
            f"repaired values: {repaired}",
            f"data set: {out}/ (metadata.json, ingest_report.json, train/ valid/ test/, vocab/)"]
