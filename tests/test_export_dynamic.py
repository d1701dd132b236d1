"""Exporting and scoring runs with dynamic tables (raw int64 ids remapped to rows).

A drifting data set of raw ids (``embedtrain.datagen.drift``): the test split brings ids training
never admitted, so scoring it is right only if every id reaches the row training's evaluation
looks up -- its own row where it holds one, else the default row of its shard. The references
are ``embedtrain eval``'s metrics (through the CLI) and the per-row logits of the model ``eval``
builds (``test_export._eval_outputs``); the id maps are checked against the remapper's own
:meth:`~embedtrain.tables.dynamic.ManagedTable.id_map` of the checkpointed state.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedtrain.cli import main
from embedtrain.export.export import export_run
from embedtrain.export.manifest import ExportError, Shard, load_manifest
from embedtrain.export.predict import ExportedModel, predict
from embedtrain.tables.dynamic import EMPTY_ID, managed_table, mix_ids
from embedtrain.models.options import DynamicTable

from conftest import run_cli
from test_export import _auc, _eval_outputs, embedtrain

CAPACITY = 120
CONFIG = """
data: {{path: {data}, batch_size: 256, eval_batch_size: 1024, shuffle: false}}
model: {{embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}}
train: {{epochs: 1, eval_every: 0, checkpoint_every: 0, progress: false}}
tables:
  - {{tables: {tables}, capacity: {capacity}, eviction: lru}}
"""


def _drift_data(out: Path) -> Path:
    from embedtrain.datagen.drift import DriftDataSpec, generate_ctr_drift

    generate_ctr_drift(DriftDataSpec(rows=6000, periods=10, lifetime=3, new_ids_per_period=40,
                                     sparse_features=3, rows_per_row_group=500), out,
                       progress=False)
    return out


def _config(root: Path, data: Path, tables: str = '["t_*"]') -> Path:
    path = root / "dynamic.yaml"
    path.write_text(CONFIG.format(data=data, tables=tables, capacity=CAPACITY))
    return path


def _train_cli(config: Path, out: Path, *args: str) -> dict:
    run = embedtrain if "--nproc" in args else run_cli  # ranks need processes of their own
    r = run("train", str(config), "--out", str(out), *args)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


def _eval_cli(run: Path, steps: int) -> dict:
    r = run_cli("eval", str(run), "--split", "test")
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(r.stdout)
    assert result["step"] == steps
    return result


def _checkpoint_id_map(ckpt: Path, prefix: str, name: str, rows: int, segments: list[int]):
    """The remapper's own ``id_map()`` of each row-wise shard's checkpointed state, joined."""
    import torch.distributed.checkpoint as dcp

    ids, held = [], []
    for start, end in zip(segments, segments[1:]):
        table = managed_table(name, DynamicTable(rows))
        if len(segments) > 2:
            table = table.rebuild_with_output_id_range((start, end), segments)
        state = table.state_dict()
        full = {f"{prefix}.{k}": torch.zeros((rows,) if v.dim() and v.shape[0] == end - start
                                             else v.shape, dtype=v.dtype)
                for k, v in state.items()}
        dcp.load(full, checkpoint_id=ckpt, no_dist=True,
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        table.load_state_dict({k: (full[f"{prefix}.{k}"][start:end]
                                   if v.dim() and v.shape[0] == end - start
                                   else full[f"{prefix}.{k}"]) for k, v in state.items()})
        i, r = table.id_map()
        ids.append(i)
        held.append(r)
    ids, held = torch.cat(ids), torch.cat(held)
    order = torch.argsort(ids)
    return ids[order], held[order]


def _check_id_maps(out: Path, summary: dict, shards: int) -> None:
    m = load_manifest(out)
    bounds = [CAPACITY * k // shards for k in range(shards + 1)]
    for t in m.tables:
        assert t.dynamic and t.id_map == f"tables/{t.name}.ids.parquet"
        assert t.rows == CAPACITY and t.segments == bounds
        assert t.default_rows == [b - 1 for b in bounds[1:]]
        file = pq.read_table(out / t.id_map)
        assert file.schema == pa.schema([("id", pa.int64()), ("row", pa.int64())])
        ids, rows = (torch.from_numpy(file.column(c).to_numpy()) for c in ("id", "row"))
        assert t.ids_held == len(ids) == summary["tables"][t.name]["occupied"] > 0
        assert bool((ids[1:] > ids[:-1]).all())  # sorted, distinct
        assert torch.unique(rows).numel() == len(rows)  # distinct rows
        assert not set(rows.tolist()) & set(t.default_rows)
        assert bool((ids >= 0).all()) and bool((ids < EMPTY_ID).all())  # raw ids, unmixed
        prefix = t.checkpoint_key.replace("._embedding_module.embedding_bags.", "._managed_"
                                          "collision_collection._managed_collision_modules.")
        want_ids, want_rows = _checkpoint_id_map(Path(m.source.checkpoint),
                                                 prefix.removesuffix(".weight"), t.name,
                                                 t.rows, t.segments)
        assert torch.equal(ids, want_ids) and torch.equal(rows, want_rows)


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    """A 1-rank run of raw ids, every table dynamic (capacity 120 of ~1,000 ids: evictions),
    trained through the CLI, its ``embedtrain eval`` result, and its export."""
    root = tmp_path_factory.mktemp("export_dynamic")
    data = _drift_data(root / "data")
    run = root / "run"
    summary = _train_cli(_config(root, data), run)
    evaluated = _eval_cli(run, summary["steps"])
    result = export_run(run, root / "out", progress=False)
    return data, run, summary, evaluated, result


def test_export_writes_the_id_maps_the_checkpoint_holds(drift):
    data, run, summary, _, result = drift
    out, m = result.out, load_manifest(result.out)
    assert [t.name for t in m.tables] == ["t_C1", "t_C2", "t_C3"]
    assert {f.encoding for f in m.features.sparse} == {"raw"}
    assert all(f.null_id is None for f in m.features.sparse)
    assert sorted(p.name for p in (out / "tables").iterdir()) == sorted(
        f"t_C{i}.{s}" for i in (1, 2, 3) for s in ("npy", "ids.parquet"))
    assert all(t.shards == [Shard(0, 0, CAPACITY, 8)] for t in m.tables)
    _check_id_maps(out, summary, shards=1)


def test_predict_maps_raw_ids_as_eval_does(drift, tmp_path):
    """Predictions equal eval's, row by row and in AUC: ids held get their rows, the test's
    many unseen ids the default row."""
    data, run, summary, evaluated, result = drift
    r = predict(result.out, [str(data / "test")], tmp_path / "p.parquet", batch_size=100,
                progress=False)
    preds = pq.read_table(tmp_path / "p.parquet")
    assert r.rows == preds.num_rows == 600
    assert r.metrics["auc"] == pytest.approx(evaluated["auc"], abs=1e-6)
    assert _auc(preds) == pytest.approx(evaluated["auc"], abs=1e-6)
    assert evaluated["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    reference, _ = _eval_outputs(run)
    assert np.abs(preds.column("logit").to_numpy() - reference.numpy()).max() <= 1e-5
    # the test split needs the fallback: most of its ids hold no row
    model = ExportedModel(result.out)
    test = pq.read_table(data / "test")
    for t in model.manifest.tables:
        (feature,) = t.features
        ids = torch.from_numpy(test.column(feature).to_numpy())
        rows = model.id_maps[feature].rows(ids)
        default = rows == t.default_rows[0]
        assert 0.5 < float(default.float().mean()) < 1
        share = summary["tables"][t.name]["eval_default_row_share"]
        assert int(default.sum()) == round(share * len(ids))  # eval's count of them


def test_a_bad_raw_id_is_one_line(drift, tmp_path, capsys):
    data, _, _, _, result = drift
    test = pq.read_table(data / "test")
    for value, shown in [(-5, "-5"), (EMPTY_ID, str(EMPTY_ID))]:
        ids = test.column("C2").to_numpy().copy()
        ids[321] = value
        bad = test.set_column(test.schema.get_field_index("C2"), "C2", pa.array(ids))
        pq.write_table(bad, tmp_path / "bad.parquet")
        assert main(["predict", str(result.out), "--input", str(tmp_path / "bad.parquet"),
                     "--out", str(tmp_path / "q.parquet"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"embedtrain predict: error: {tmp_path / 'bad.parquet'}: column C2: "
                       f"row 321: id {shown} outside [0, 2^63 - 1): raw ids of a dynamic "
                       f"table, mapped to rows by its id map"]


def test_an_export_without_id_maps_still_loads(drift, tmp_path):
    """An older export's model.json (no id-map fields) loads; its tables count as static."""
    _, _, _, _, result = drift
    old = tmp_path / "old"
    shutil.copytree(result.out, old)
    raw = json.loads((old / "model.json").read_text())
    for t in raw["tables"]:
        for key in ("id_map", "segments", "default_rows", "ids_held", "id_mix"):
            del t[key]
    (old / "model.json").write_text(json.dumps(raw))
    m = load_manifest(old)
    assert not any(t.dynamic for t in m.tables) and m.tables[0].default_rows is None


def test_an_id_map_of_another_mix_is_refused(drift, tmp_path):
    """Which shard an unseen id falls back to depends on mix_ids: an export made with another
    version of it is refused in one line, not scored with the wrong default rows."""
    _, _, _, _, result = drift
    other = tmp_path / "other"
    shutil.copytree(result.out, other)
    raw = json.loads((other / "model.json").read_text())
    assert raw["tables"][0]["id_mix"] == "feistel4-v1"
    raw["tables"][0]["id_mix"] = "splitmix-v0"
    (other / "model.json").write_text(json.dumps(raw))
    with pytest.raises(ExportError, match="id_mix 'splitmix-v0', this embedtrain maps ids with "
                                          "'feistel4-v1'"):
        ExportedModel(other)


def test_static_and_dynamic_tables_keep_the_models_feature_order(drift, tmp_path):
    """C2 re-encoded to small ids (a static table between two dynamic ones) and C3 too (a
    dynamic table over ids that are not raw): the manifest lists the tables in the model's
    feature order, which the dense program takes, and predictions equal eval's."""
    source = drift[0]
    data = tmp_path / "mixed"
    shutil.copytree(source, data)
    meta = json.loads((data / "metadata.json").read_text())
    splits = {s: pq.read_table(data / s) for s in ("train", "valid", "test")}
    for name in ("C2", "C3"):
        values = np.unique(np.concatenate([t.column(name).to_numpy() for t in splits.values()]))
        for s, t in splits.items():
            ids = np.searchsorted(values, t.column(name).to_numpy()).astype(np.int64)
            splits[s] = t.set_column(t.schema.get_field_index(name), name, pa.array(ids))
        entry = next(e for e in meta["sparse"] if e["name"] == name)
        entry["raw"], entry["num_embeddings"] = False, len(values)
    for s, t in splits.items():
        (file,) = meta["splits"][s]["files"]
        pq.write_table(t, data / file, row_group_size=500)
    (data / "metadata.json").write_text(json.dumps(meta))
    run = tmp_path / "run"
    summary = _train_cli(_config(tmp_path, data, "[t_C1, t_C3]"), run)
    m = export_run(run, tmp_path / "out", progress=False).manifest
    assert [t.name for t in m.tables] == ["t_C1", "t_C2", "t_C3"]
    assert [t.dynamic for t in m.tables] == [True, False, True]
    assert [f.encoding for f in m.features.sparse] == ["raw", "pre_encoded", "pre_encoded"]
    assert ".static.embedding_bags.t_C2.weight" in m.tables[1].checkpoint_key
    assert m.tables[2].ids_held == summary["tables"]["t_C3"]["occupied"]
    assert "in the order of tables" in m.dense_program.inputs[1]
    r = predict(tmp_path / "out", [str(data / "test")], tmp_path / "p.parquet", progress=False)
    reference, metrics = _eval_outputs(run)
    logits = pq.read_table(tmp_path / "p.parquet").column("logit").to_numpy()
    assert np.abs(logits - reference.numpy()).max() <= 1e-5
    assert r.metrics["auc"] == pytest.approx(metrics["auc"], abs=1e-6)


@pytest.mark.slow
def test_two_rank_run_scores_unseen_ids_on_their_shards_default_rows(drift, tmp_path):
    """A 2-rank run: each table row-wise over both ranks, one default row per shard (59, 119).
    Exported on one process, its predictions equal its own test metrics and ``embedtrain
    eval``'s (a checkpoint of 2 shards evaluated on 1 process), which needs every unseen id
    on the default row of the shard its mixed id belongs to."""
    data = drift[0]
    run = tmp_path / "two"
    summary = _train_cli(_config(tmp_path, data), run, "--nproc", "2")
    assert summary["world_size"] == 2
    evaluated = _eval_cli(run, summary["steps"])
    out = export_run(run, tmp_path / "out", progress=False).out
    m = load_manifest(out)
    assert m.source.world_size == 2
    assert all([(s.row_offset, s.rows) for s in t.shards] == [(0, 60), (60, 60)]
               for t in m.tables)
    _check_id_maps(out, summary, shards=2)
    r = predict(out, [str(data / "test")], tmp_path / "p.parquet", progress=False)
    assert r.metrics["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    assert r.metrics["auc"] == pytest.approx(evaluated["auc"], abs=1e-6)
    # both default rows are looked up, each by the ids of its block of the mixed id range
    model = ExportedModel(out)
    test = pq.read_table(data / "test")
    block = -(-EMPTY_ID // 2)
    for t in m.tables:
        (feature,) = t.features
        ids = torch.from_numpy(test.column(feature).to_numpy())
        rows = model.id_maps[feature].rows(ids)
        unseen = ~torch.isin(ids, model.id_maps[feature].ids)
        assert set(rows[unseen].tolist()) == {59, 119}
        assert torch.equal(rows[unseen], torch.where(mix_ids(ids[unseen]) < block, 59, 119))
