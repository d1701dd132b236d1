"""ParquetBatchReader against a slow per-row reference, plus its error messages."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from embedtrain.data.reader import DataError, ParquetBatchReader
from embedtrain.features import DenseTransform, FeatureSpec, load_dataset_meta
from embedtrain.testing import random_ctr_table, write_parquet


def _reference_rows(table: pa.Table, spec: FeatureSpec) -> dict[float, dict]:
    """Row contents keyed by the (unique) first dense value, built one row at a time."""
    rows = {}
    for r in table.to_pylist():
        ids = {}
        for f in spec.sparse:
            v = r[f.name]
            ids[f.name] = list(v) if isinstance(v, list) else [v]
        rows[np.float32(r["d0"]).item()] = {
            "label": float(r["label"]),
            "dense": [np.float32(r[d]).item() for d in spec.dense],
            "ids": ids,
        }
    return rows


def _batch_rows(batch, spec: FeatureSpec) -> list[dict]:
    per_key = batch.sparse_features.to_dict()
    out = []
    for i in range(batch.labels.numel()):
        out.append({
            "label": batch.labels[i].item(),
            "dense": batch.dense_features[i].tolist(),
            "ids": {f.name: per_key[f.name].to_dense()[i].tolist() for f in spec.sparse},
        })
    return out


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch_size", [64, 100])
def test_reader_matches_reference(tmp_path, shuffle, batch_size):
    table, spec = random_ctr_table(rows=1000, seed=1)
    files = [write_parquet(table.slice(0, 600), tmp_path / "a.parquet", row_group_size=128),
             write_parquet(table.slice(600), tmp_path / "b.parquet", row_group_size=128)]
    reader = ParquetBatchReader(files, spec, batch_size, shuffle=shuffle, seed=3,
                                shuffle_buffer_rows=300)
    reference = _reference_rows(table, spec)
    seen = []
    for batch in reader:
        assert batch.dense_features.dtype == torch.float32
        assert batch.sparse_features.keys() == spec.sparse_names
        for row in _batch_rows(batch, spec):
            key = row["dense"][0]
            assert row == reference[key]
            seen.append(key)
    assert sorted(seen) == sorted(reference)  # every row exactly once
    assert len(reader) == -(-1000 // batch_size)
    unshuffled_order = [np.float32(v).item() for v in table.column("d0").to_pylist()]
    assert (seen == unshuffled_order) == (not shuffle)


def test_shuffle_is_seeded_per_epoch_and_drop_last(tmp_path):
    table, spec = random_ctr_table(rows=500, seed=2)
    f = write_parquet(table, tmp_path / "t.parquet", row_group_size=64)
    reader = ParquetBatchReader([f], spec, 64, shuffle=True, seed=5, drop_last=True)
    order = lambda epoch: torch.cat([b.dense_features[:, 0] for b in reader.iter_epoch(epoch)])
    assert torch.equal(order(0), order(0))
    assert not torch.equal(order(0), order(1))
    assert len(reader) == 500 // 64 and order(0).numel() == 64 * (500 // 64)


def test_skip_batches_resumes_exactly(tmp_path):
    table, spec = random_ctr_table(rows=700, seed=3)
    f = write_parquet(table, tmp_path / "t.parquet", row_group_size=100)
    reader = ParquetBatchReader([f], spec, 50, shuffle=True, seed=1, shuffle_buffer_rows=200)
    full = list(reader.iter_epoch(2))
    tail = list(reader.iter_epoch(2, skip_batches=5))
    assert len(tail) == len(full) - 5
    for a, b in zip(full[5:], tail):
        assert torch.equal(a.dense_features, b.dense_features)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
        assert torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())


def test_ranks_read_disjoint_row_groups(tmp_path):
    table, spec = random_ctr_table(rows=1000, seed=4)
    f = write_parquet(table, tmp_path / "t.parquet", row_group_size=100)
    keys = []
    for rank in range(3):
        reader = ParquetBatchReader([f], spec, 32, rank=rank, world_size=3)
        keys.append({v for b in reader for v in b.dense_features[:, 0].tolist()})
    assert sum(len(k) for k in keys) == 1000 and len(set().union(*keys)) == 1000


def test_log1p_transform(tmp_path):
    table, spec = random_ctr_table(rows=50, seed=5, num_dense=2)
    spec = FeatureSpec(spec.label, spec.dense, spec.sparse, DenseTransform.LOG1P)
    f = write_parquet(table, tmp_path / "t.parquet")
    batch = next(iter(ParquetBatchReader([f], spec, 50)))
    raw = np.stack([table.column(d).to_numpy() for d in spec.dense], 1)
    np.testing.assert_allclose(batch.dense_features.numpy(), np.log1p(np.maximum(raw, 0)), rtol=1e-6)


def _bad(tmp_path, table, spec, match):
    f = write_parquet(table, tmp_path / "bad.parquet", row_group_size=40)
    with pytest.raises(DataError, match=match) as err:
        list(ParquetBatchReader([f], spec, 16))
    assert "bad.parquet" in str(err.value) and "\n" not in str(err.value)


def test_missing_column_is_named(tmp_path):
    table, spec = random_ctr_table(rows=100)
    _bad(tmp_path, table.drop_columns(["s2"]), spec, r"missing column\(s\): s2")


def test_null_is_named_with_row(tmp_path):
    table, spec = random_ctr_table(rows=100)
    d1 = table.column("d1").to_pylist()
    d1[57] = None
    table = table.set_column(table.schema.get_field_index("d1"), "d1", pa.array(d1, pa.float32()))
    _bad(tmp_path, table, spec, r"column d1: 1 null value\(s\) in row group 1, first at row 57")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_dense_value_is_named_with_row(tmp_path, value):
    table, spec = random_ctr_table(rows=100)
    d1 = table.column("d1").to_pylist()
    d1[57] = d1[61] = value
    table = table.set_column(table.schema.get_field_index("d1"), "d1", pa.array(d1, pa.float32()))
    _bad(tmp_path, table, spec, rf"column d1: 2 value\(s\) not finite \(NaN or infinite\) in row "
                                rf"group 1, first at row 57 \({value}\)")


def test_out_of_range_id_is_named_with_row(tmp_path):
    table, spec = random_ctr_table(rows=100)
    s0 = table.column("s0").to_numpy().copy()
    s0[83] = 7  # vocab of s0 is 7
    table = table.set_column(table.schema.get_field_index("s0"), "s0", pa.array(s0))
    _bad(tmp_path, table, spec, r"column s0: id 7 outside \[0, 7\) at row 83")


def test_wrong_type_is_named(tmp_path):
    table, spec = random_ctr_table(rows=100)
    strings = pa.array([str(v) for v in table.column("s1").to_pylist()])
    table = table.set_column(table.schema.get_field_index("s1"), "s1", strings)
    _bad(tmp_path, table, spec, r"column s1: expected integer ids")


def test_corrupt_file_is_named(tmp_path):
    table, spec = random_ctr_table(rows=100)
    f = write_parquet(table, tmp_path / "t.parquet")
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    with pytest.raises(DataError, match="t.parquet: not a readable parquet file"):
        ParquetBatchReader([f], spec, 16)


@pytest.mark.parametrize("value", [7, -1, 1.5, float("nan")])
def test_ctr_label_that_is_not_a_click_is_named_with_row(tmp_path, value):
    table, spec = random_ctr_table(rows=100)
    labels = (np.arange(100) % 2).astype(np.float32)
    labels[57] = value
    table = table.set_column(0, "label", pa.array(labels))
    _bad(tmp_path, table, spec, rf"column label: label {value:g} at row 57 is not a click "
                                r"\(CTR labels are 0 or 1, or a probability in \[0, 1\]\)")


def test_soft_labels_in_the_unit_interval_are_clicks(tmp_path):
    table, spec = random_ctr_table(rows=100)
    table = table.set_column(0, "label", pa.array(np.linspace(0, 1, 100, dtype=np.float32)))
    batch = next(iter(ParquetBatchReader([write_parquet(table, tmp_path / "s.parquet")], spec, 100)))
    assert batch.labels.min() == 0 and batch.labels.max() == 1


def test_truncated_parquet_is_named_when_measured_for_planning(tmp_path):
    from embedtrain.data.stats import measure_pooling_factors
    from embedtrain.testing import tiny_ctr_dataset

    data = tiny_ctr_dataset(tmp_path / "d", rows=2000)
    meta = load_dataset_meta(data)
    victim = meta.files("train")[0]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    with pytest.raises(DataError, match=rf"^{victim}: not a readable parquet file \(truncated or "
                                        r"corrupt\?\)"):
        measure_pooling_factors(meta)
    with pytest.raises(DataError, match=rf"^{victim}: not a readable parquet file"):
        ParquetBatchReader(meta.files("train"), meta.features, 64)


@pytest.mark.parametrize("edit,message", [
    (lambda f: f.update(multi_hot=True), r"column {name}: int64, not a list \(metadata.json says "
                                         r"multi_hot: true\)"),
    (lambda f: f.update(multi_hot=True, name="C99"), r"column C99: missing \(metadata.json names it\)"),
])
def test_multi_hot_columns_are_checked_before_they_are_measured(tmp_path, edit, message):
    import json

    from embedtrain.data.stats import measure_pooling_factors
    from embedtrain.testing import tiny_ctr_dataset

    data = tiny_ctr_dataset(tmp_path / "d", rows=500)
    meta_file = data / "metadata.json"
    raw = json.loads(meta_file.read_text())
    single = next(f for f in raw["sparse"] if not f.get("multi_hot"))
    name = single["name"]
    edit(single)
    meta_file.write_text(json.dumps(raw))
    meta = load_dataset_meta(data)
    with pytest.raises(DataError, match=rf"^{meta.files('train')[0]}: " + message.format(name=name)):
        measure_pooling_factors(meta)


def _with_lists(table, spec, name, lists):
    i = table.schema.get_field_index(name)
    return table.set_column(i, name, pa.array(lists, pa.list_(pa.int64())))


def test_a_list_longer_than_max_length_is_named_with_row(tmp_path):
    table, spec = random_ctr_table(rows=100, list_features=(1,), max_length=4)
    name = spec.sparse[1].name
    lists = [[1] * (i % 5) for i in range(100)]  # 0..4 ids: within max_length
    lists[57] = [1, 2, 3, 4, 5]
    _bad(tmp_path, _with_lists(table, spec, name, lists), spec,
         rf"column {name}: row 57 holds 5 ids, but metadata.json says max_length: 4$")


def test_a_list_in_a_single_valued_feature_is_named_with_row(tmp_path):
    table, spec = random_ctr_table(rows=100, list_features=(1,))
    name = spec.sparse[0].name
    assert not spec.sparse[0].multi_hot
    lists = [[i % 3] for i in range(100)]  # one id a row, stored as lists: reads as single ids
    batch = next(iter(ParquetBatchReader(
        [write_parquet(_with_lists(table, spec, name, lists), tmp_path / "ok.parquet")], spec, 100)))
    assert batch.sparse_features[name].lengths().max() == 1
    lists[63] = [0, 1]
    _bad(tmp_path, _with_lists(table, spec, name, lists), spec,
         rf"column {name}: row 63 holds 2 ids, but metadata.json says multi_hot: false")


def test_a_multi_hot_feature_without_max_length_has_no_bound(tmp_path):
    import json

    from embedtrain.testing import tiny_ctr_dataset

    data = tiny_ctr_dataset(tmp_path / "d", rows=500)
    raw = json.loads((data / "metadata.json").read_text())
    multi = next(f for f in raw["sparse"] if f.get("multi_hot"))
    del multi["max_length"]
    (data / "metadata.json").write_text(json.dumps(raw))
    feature = next(f for f in load_dataset_meta(data).features.sparse if f.name == multi["name"])
    assert feature.max_length == 0
