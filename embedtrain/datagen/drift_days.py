"""The drifting CTR data set as day partitions: ``embedtrain datagen ctr --drift --days N``.

What continual training reads (``data.partitions``, ``embedtrain train --warm-start``): the
planted model of :mod:`embedtrain.datagen.drift` with one period a day, each day written as its
own data set ``OUT/day=001/``, ``OUT/day=002/``, ... holding a single ``train`` split and a
``metadata.json`` (raw int64 ids; ``num_embeddings`` the day's distinct ids; the oracle's AUC and
log loss on the day's rows). A day's partition is training data for its day and test data for
the model trained up to the day before. ``OUT/partitions.json`` lists the partitions in order.

Each day's ``metadata.json`` also says how new its ids are: ``partition.new_id_share``, the share
of the day's lookups whose id no earlier day held (per feature and over all), and
``partition.new_ids`` per feature. The same spec always gives identical files; day ``d``'s rows
are those of period ``d - 1`` of :func:`embedtrain.datagen.generate_ctr_drift` with
``periods = days`` (same seed, same chunks).

Example:
    >>> meta = generate_ctr_drift_days(DriftDataSpec(rows=70_000, periods=7), "/tmp/days",
    ...                                progress=False)
    >>> meta["partitions"][:2]
    ['day=001', 'day=002']
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from embedtrain.datagen.ctr import SplitWriter, log_loss, prepare_out_dir, roc_auc
from embedtrain.datagen.drift import (
    DriftDataSpec, DriftModel, columns_meta, period_rows, period_starts)
from embedtrain.features import PARTITIONS_FILE
from embedtrain.utils import progress_bar, write_atomic

_DAY = re.compile(r"^day=\d{3,}$")


def partition_name(day: int) -> str:
    """The folder of day ``day`` (1-based): ``day=001``."""
    return f"day={day:03d}"


def _clear_partitions(out: Path) -> None:
    """Removes an earlier generator's partitions; refuses day folders no index lists."""
    index = out / PARTITIONS_FILE
    listed = set(json.loads(index.read_text())["partitions"]) if index.is_file() else set()
    for d in sorted(out.iterdir()):
        if d.is_dir() and _DAY.match(d.name):
            if d.name not in listed:
                raise FileExistsError(f"{d}: a day partition that {index} does not list; "
                                      f"refusing to overwrite")
            shutil.rmtree(d)
    index.unlink(missing_ok=True)


def generate_ctr_drift_days(spec: DriftDataSpec, out_dir: str | os.PathLike,
                            progress: bool = True) -> dict:
    """Writes ``spec.periods`` day partitions (``valid_fraction``/``test_fraction`` unused) and
    ``partitions.json``; returns the index written there (with each day's rows, oracle AUC and
    new-id share)."""
    spec = dataclasses.replace(spec, valid_fraction=0.0, test_fraction=0.0)
    out = prepare_out_dir(out_dir)
    _clear_partitions(out)
    model = DriftModel(spec)
    starts = period_starts(spec)
    seen_before = [np.zeros(k, dtype=bool) for k in model.total]
    days = []
    with progress_bar(spec.rows, "datagen", disable=not progress) as bar:
        for t in range(spec.periods):
            name = partition_name(t + 1)
            writer = SplitWriter(out / name, "train", spec, model.schema())
            probs, labels = [], []
            seen = [np.zeros(k, dtype=bool) for k in model.total]
            new_lookups = np.zeros(spec.sparse_features, dtype=np.int64)
            for table, idx, p, y in period_rows(model, t, starts):
                writer.add(table)
                probs.append(p)
                labels.append(y)
                for f, j in enumerate(idx):
                    seen[f][j] = True
                    new_lookups[f] += int(np.count_nonzero(~seen_before[f][j]))
                bar.update(len(y))
            writer.close()
            days.append(_write_day(out / name, spec, model, t, writer, probs, labels, seen,
                                   seen_before, new_lookups))
            for f in range(spec.sparse_features):
                seen_before[f] |= seen[f]
    index = {"format_version": 1, "name": "synthetic_ctr_drift",
             "partitions": [d["name"] for d in days], "days": days,
             "generator": {"seed": int(spec.seed), "rows": int(spec.rows), "days": spec.periods,
                           "lifetime": spec.lifetime,
                           "new_ids_per_period": spec.new_ids_per_period,
                           "planted": model.description()}}
    write_atomic(out / PARTITIONS_FILE, json.dumps(index, indent=2) + "\n")
    return index


def _write_day(root: Path, spec: DriftDataSpec, model: DriftModel, t: int, writer: SplitWriter,
               probs: list, labels: list, seen: list, seen_before: list,
               new_lookups: np.ndarray) -> dict:
    p, y = np.concatenate(probs), np.concatenate(labels)
    rows = writer.rows
    features = {name: {"distinct_ids": int(np.count_nonzero(seen[f])),
                       "new_ids": int(np.count_nonzero(seen[f] & ~seen_before[f])),
                       "new_id_share": float(new_lookups[f] / rows)}
                for f, name in enumerate(model.names)}
    share = float(new_lookups.sum() / (rows * spec.sparse_features))
    meta = {
        **columns_meta(spec, model, {n: features[n]["distinct_ids"] for n in model.names}),
        "splits": {"train": {"files": writer.files, "rows": rows}},
        "oracle_auc": {"train": roc_auc(p, y)},
        "oracle_logloss": {"train": log_loss(p, y)},
        "ctr": {"train": float(y.mean())},
        "partition": {"name": root.name, "day": t + 1, "days": spec.periods,
                      "new_id_share": share, "features": features},
    }
    write_atomic(root / "metadata.json", json.dumps(meta, indent=2) + "\n")
    return {"name": root.name, "rows": rows, "oracle_auc": meta["oracle_auc"]["train"],
            "new_id_share": share}
