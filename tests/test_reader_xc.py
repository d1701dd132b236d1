"""ParquetBatchReader with class-id labels (``FeatureSpec.num_classes``): single and multi-label."""

import json
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedtrain.datagen import XCDataSpec, generate_xc
from embedtrain.data.reader import DataError, LastBatch, ParquetBatchReader
from embedtrain.features import DatasetError, FeatureSpec, SparseFeature, load_dataset_meta
from embedtrain.testing import write_parquet

VOCAB = 100_000


def _xc_table(rows: int, num_classes: int, max_labels: int, multi: bool, seed: int = 0,
              label_type: Optional[pa.DataType] = None) -> tuple[pa.Table, list[list[int]]]:
    """A table whose row ``r`` has ``d0 = r`` and tokens starting with ``r``, and its labels.

    The label column is ``label_type``, by default int64 or, if ``multi``, a list of int64.

    Returns:
        ``(table, labels)``: per row, its class ids in file order (one, if not ``multi``).
    """
    rng = np.random.default_rng(seed)
    counts = np.ones(rows, np.int64)
    if multi:
        counts = rng.integers(1, max_labels + 1, size=rows)
        counts[0] = max_labels  # a full row, whatever the draw
    ids = rng.integers(0, num_classes, size=int(counts.sum()))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    if label_type is None:
        label_type = pa.list_(pa.int64()) if multi else pa.int64()
    if multi:
        label = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                         pa.array(ids).cast(label_type.value_type))
        label = label.cast(label_type)
    else:
        label = pa.array(ids).cast(label_type)
    token_lengths = rng.integers(1, 4, size=rows)
    token_offsets = np.concatenate([[0], np.cumsum(token_lengths)]).astype(np.int32)
    tokens = rng.integers(0, VOCAB, size=int(token_offsets[-1]))
    tokens[token_offsets[:-1]] = np.arange(rows)  # each row's first token is its row number
    table = pa.table({
        "labels" if multi else "label": label,
        "d0": pa.array(np.arange(rows, dtype=np.float32)),
        "tokens": pa.ListArray.from_arrays(pa.array(token_offsets), pa.array(tokens)),
    })
    return table, [ids[offsets[r] : offsets[r + 1]].tolist() for r in range(rows)]


def _spec(num_classes: int, max_labels: int, multi: bool) -> FeatureSpec:
    return FeatureSpec(label="labels" if multi else "label", dense=("d0",),
                       sparse=(SparseFeature("tokens", VOCAB, multi_hot=True, max_length=3),),
                       num_classes=num_classes, max_labels=max_labels)


def _padded(labels: list[list[int]], max_labels: int) -> np.ndarray:
    return np.array([row + [-1] * (max_labels - len(row)) for row in labels], np.int64)


def _row_ids(batch) -> torch.Tensor:
    """Each row's first token, i.e. its row number in the file."""
    tokens = batch.sparse_features["tokens"]
    starts = tokens.offsets()[:-1][tokens.lengths() > 0]  # padding rows have no token
    return tokens.values()[starts]


def test_single_label_is_int64_and_exact_above_2_pow_24(tmp_path):
    num_classes = 2**25
    table, _ = _xc_table(1000, num_classes, 1, multi=False)
    top = np.arange(num_classes - 1000, num_classes)  # float32 would round most of these
    table = table.set_column(0, "label", pa.array(top))
    assert np.float32(num_classes - 1).item() != num_classes - 1
    f = write_parquet(table, tmp_path / "t.parquet", row_group_size=300)
    reader = ParquetBatchReader([f], _spec(num_classes, 1, multi=False), 64, num_workers=0)
    batches = list(reader)
    assert all(b.labels.dtype == torch.int64 and b.labels.dim() == 1 for b in batches)
    assert torch.equal(torch.cat([b.labels for b in batches]), torch.from_numpy(top))


@pytest.mark.parametrize("label_type", [pa.list_(pa.int64()), pa.large_list(pa.int32())])
def test_multi_label_round_trip_in_order(tmp_path, label_type):
    table, labels = _xc_table(700, 1000, 3, multi=True, seed=1, label_type=label_type)
    files = [write_parquet(table.slice(0, 400), tmp_path / "a.parquet", row_group_size=128),
             # tiny row groups: batches of more than 16 slices are concatenated first
             write_parquet(table.slice(400), tmp_path / "b.parquet", row_group_size=5)]
    reader = ParquetBatchReader(files, _spec(1000, 3, multi=True), 100, num_workers=0)
    batches = list(reader)
    assert all(b.labels.dtype == torch.int64 and b.labels.shape[1:] == (3,) for b in batches)
    assert np.array_equal(torch.cat([b.labels for b in batches]).numpy(), _padded(labels, 3))


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_keeps_labels_with_their_rows(tmp_path, multi, num_workers):
    rows, max_labels = 1000, 4 if multi else 1
    table, labels = _xc_table(rows, 5000, max_labels, multi=multi, seed=2)
    files = [write_parquet(table.slice(0, 550), tmp_path / "a.parquet", row_group_size=100),
             write_parquet(table.slice(550), tmp_path / "b.parquet", row_group_size=100)]
    expected = torch.from_numpy(_padded(labels, max_labels))
    expected = expected if multi else expected[:, 0]
    spec = _spec(5000, max_labels, multi)
    for rank, world in (0, 1), (1, 3):  # 3 ranks: this rank's 333 rows, a partial row group
        reader = ParquetBatchReader(files, spec, 64, shuffle=True, seed=7, shuffle_buffer_rows=300,
                                    num_workers=num_workers, last_batch=LastBatch.PAD,
                                    rank=rank, world_size=world)
        seen = []
        for batch in reader.iter_epoch(1):
            real = len(batch.labels) - getattr(batch, "padding", 0)
            ids = _row_ids(batch)  # padding rows have no tokens: only the real rows' ids
            assert len(ids) == real and (batch.labels[real:] == -1).all()
            assert torch.equal(batch.labels[:real], expected[ids])
            assert torch.equal(batch.dense_features[:real, 0], ids.float())
            seen.append(ids)
        seen = torch.cat(seen)
        first = 334 if world == 3 else 0  # rank 1 of 3 holds rows 334 .. 666
        assert sorted(seen.tolist()) == list(range(first, first + reader.num_rows))
        assert not torch.equal(seen, torch.arange(first, first + reader.num_rows))  # shuffled


def _with_label(table: pa.Table, column: pa.Array) -> pa.Table:
    return table.set_column(0, table.schema.names[0], column)


def _lists(labels: list[list[int]], row: int, value) -> pa.Array:
    return pa.array([value if r == row else v for r, v in enumerate(labels)], pa.list_(pa.int64()))


BAD_ROW = 150  # in the second row group, so row numbers count from the file's start


@pytest.mark.parametrize("case", ["null", "negative", "too_large", "list_null", "list_null_id",
                                  "list_too_large", "list_empty", "list_too_many"])
def test_bad_labels_name_file_column_and_row(tmp_path, case):
    multi = case.startswith("list")
    table, labels = _xc_table(300, 1000, 3, multi=multi, seed=3)
    flat = [row[0] for row in labels]
    bad = {
        "null": lambda: pa.array([None if r == BAD_ROW else v for r, v in enumerate(flat)],
                                 pa.int64()),
        "negative": lambda: pa.array([-1 if r == BAD_ROW else v for r, v in enumerate(flat)]),
        "too_large": lambda: pa.array([1000 if r == BAD_ROW else v for r, v in enumerate(flat)]),
        "list_null": lambda: _lists(labels, BAD_ROW, None),
        "list_null_id": lambda: _lists(labels, BAD_ROW, [3, None]),
        "list_too_large": lambda: _lists(labels, BAD_ROW, [3, 1000]),
        "list_empty": lambda: _lists(labels, BAD_ROW, []),
        "list_too_many": lambda: _lists(labels, BAD_ROW, [1, 2, 3, 4]),
    }[case]()
    f = write_parquet(_with_label(table, bad), tmp_path / "bad_labels.parquet", row_group_size=100)
    reader = ParquetBatchReader([f], _spec(1000, 3, multi), 64, num_workers=0)
    with pytest.raises(DataError) as err:
        list(reader)
    message = str(err.value)
    column = "labels" if multi else "label"
    assert "bad_labels.parquet" in message and f"column {column}:" in message
    assert f"row {BAD_ROW}" in message
    if case == "list_empty":
        assert "has no label" in message
    if case == "list_too_many":
        assert "has 4 labels, more than max_labels 3" in message


def test_out_of_range_scan_without_statistics(tmp_path):
    table, labels = _xc_table(300, 1000, 1, multi=False, seed=4)
    column = pa.array([5000 if r == 210 else row[0] for r, row in enumerate(labels)])
    path = tmp_path / "nostats.parquet"
    pq.write_table(_with_label(table, column), path, row_group_size=100, write_statistics=False)
    with pytest.raises(DataError, match=r"nostats\.parquet: column label: class id 5000 outside "
                                        r"\[0, 1000\) at row 210"):
        list(ParquetBatchReader([path], _spec(1000, 1, False), 64, num_workers=0))


@pytest.mark.parametrize("multi", [False, True])
def test_non_integer_labels_are_rejected(tmp_path, multi):
    table, labels = _xc_table(100, 1000, 2, multi=multi, seed=5)
    column = (pa.array([[float(v) for v in row] for row in labels]) if multi
              else pa.array([float(row[0]) for row in labels]))
    f = write_parquet(_with_label(table, column), tmp_path / "floats.parquet")
    with pytest.raises(DataError, match=r"floats\.parquet: column labels?: expected integer class "
                                        r"ids, got (list<\w+: )?double"):
        list(ParquetBatchReader([f], _spec(1000, 2, multi), 64, num_workers=0))


def test_list_and_single_label_files_do_not_mix(tmp_path):
    single, _ = _xc_table(100, 1000, 1, multi=False, seed=6)
    multi, _ = _xc_table(100, 1000, 2, multi=True, seed=6)
    a = write_parquet(multi.rename_columns(["label", "d0", "tokens"]), tmp_path / "multi.parquet")
    b = write_parquet(single, tmp_path / "single.parquet")
    mismatch = (r"single\.parquet: column label: a single-label column here but a list column "
                r"\(multi-label\) in .*multi\.parquet")
    with pytest.raises(DataError, match=mismatch):
        ParquetBatchReader([a, b], _spec(1000, 2, multi=False), 64)


def test_ctr_labels_unchanged_without_num_classes(tmp_path):
    table, labels = _xc_table(100, 1000, 1, multi=False, seed=7)
    labels = [[row[0] % 2] for row in labels]  # clicks: CTR labels must be 0 or 1
    table = table.set_column(0, "label", pa.array([row[0] for row in labels]))
    f = write_parquet(table, tmp_path / "t.parquet")
    spec = FeatureSpec("label", ("d0",), (SparseFeature("tokens", VOCAB, True, 3),))
    batch = next(iter(ParquetBatchReader([f], spec, 100, num_workers=0)))
    assert batch.labels.dtype == torch.float32
    assert torch.equal(batch.labels, torch.tensor([row[0] for row in labels], dtype=torch.float32))


@pytest.mark.parametrize("multi", [False, True])
def test_generated_xc_data_loads_with_class_id_labels(tmp_path, multi):
    spec = XCDataSpec(classes=200, rows=2000, vocab=500, seed=1, multi_label=multi,
                      labels_per_row=(1, 3))
    generate_xc(spec, tmp_path, progress=False)
    meta = load_dataset_meta(tmp_path)
    assert meta.features.num_classes == 200 and meta.features.max_labels == (3 if multi else 1)
    assert meta.extra["num_classes"] == 200 and meta.extra["multi_label"] is multi
    reader = ParquetBatchReader(meta.files("train"), meta.features, batch_size=64)
    labels = torch.cat([b.labels for b in reader])
    assert labels.dtype == torch.int64 and len(labels) == meta.split_rows["train"]
    assert labels.shape[1:] == ((3,) if multi else ())
    if multi:
        assert (labels[:, 0] >= 0).all() and labels.max() < 200
        assert ((labels >= 0) | (labels == -1)).all()
        assert ((labels == -1).sum(1) <= 2).all()
    else:
        assert labels.min() >= 0 and labels.max() < 200


def _write_meta(root: Path, **extra) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    meta = {"label": "labels", "dense": [], "sparse": [], "splits": {}, **extra}
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def test_metadata_class_keys(tmp_path):
    features = load_dataset_meta(_write_meta(tmp_path / "a")).features
    assert features.num_classes is None and features.max_labels == 1
    meta = load_dataset_meta(_write_meta(tmp_path / "b", num_classes=10, labels_per_row=[2, 5]))
    assert (meta.features.num_classes, meta.features.max_labels) == (10, 5)
    assert meta.extra["labels_per_row"] == [2, 5] and meta.extra["num_classes"] == 10
    meta = load_dataset_meta(_write_meta(tmp_path / "c", num_classes=10, labels_per_row=[2, 5],
                                         max_labels=7))
    assert meta.features.max_labels == 7 and meta.extra["max_labels"] == 7
    for key, value in [("num_classes", 1), ("num_classes", "10"), ("num_classes", True),
                       ("max_labels", 0), ("max_labels", 2.0), ("labels_per_row", [3, 2]),
                       ("labels_per_row", 4)]:
        root = _write_meta(tmp_path / f"bad_{key}_{value}", **{key: value})
        with pytest.raises(DatasetError, match=rf"metadata\.json: {key}: expected"):
            load_dataset_meta(root)
