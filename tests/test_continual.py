"""Continual training: day partitions, partitioned data sets, warm starts and their lineage."""

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_cli
from test_train_cli import _assert_equal, _params

from embedtrain.datagen.drift import DriftDataSpec, generate_ctr_drift
from embedtrain.datagen.drift_days import generate_ctr_drift_days
from embedtrain.features import DatasetError, load_dataset_meta

SPEC = dict(rows=3000, periods=4, lifetime=2, new_ids_per_period=40, sparse_features=3,
            rows_per_row_group=125)  # 6 a day: every rank reads whole groups, day by day


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    root = tmp_path_factory.mktemp("continual")
    generate_ctr_drift_days(DriftDataSpec(**SPEC), root / "days", progress=False)
    config = root / "c.yaml"
    config.write_text(f"""
data: {{path: {root / 'days'}, batch_size: 250, eval_batch_size: 1000, shuffle: false}}
model: {{embedding_dim: 8, bottom_mlp: [16], top_mlp: [16]}}
train: {{epochs: 1, checkpoint_every: 2, keep_checkpoints: 20, progress: false}}
tables: [{{tables: ["t_*"], capacity: 200, eviction: lru}}]
""")
    return root, config


def _train(config, out, *args):
    r = run_cli("train", str(config), "--out", str(out), *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _final(run):
    return sorted((run / "checkpoints").glob("step_*"))[-1]


def test_day_partitions_are_the_drifting_sets_periods(days, tmp_path):
    root, _ = days
    generate_ctr_drift(DriftDataSpec(**SPEC, valid_fraction=0.0, test_fraction=0.0),
                       tmp_path / "ref", progress=False)
    ref = pq.read_table(tmp_path / "ref" / "train")
    index = json.loads((root / "days" / "partitions.json").read_text())
    assert index["partitions"] == ["day=001", "day=002", "day=003", "day=004"]
    tables = [pq.read_table(root / "days" / p / "train") for p in index["partitions"]]
    assert pq.read_table(tmp_path / "ref" / "train").num_rows == sum(t.num_rows for t in tables)
    for day, t in enumerate(tables):
        assert set(t.column("period").to_pylist()) == {day}
    assert all(a.equals(b) for a, b in zip(
        ref.to_batches(), [b for t in tables for b in t.to_batches()]))
    seen: dict[str, set] = {f: set() for f in ("C1", "C2", "C3")}
    for p, t in zip(index["partitions"], tables):
        meta = json.loads((root / "days" / p / "metadata.json").read_text())
        new = 0
        for f in seen:
            ids = t.column(f).to_numpy()
            assert meta["partition"]["features"][f]["distinct_ids"] == len(set(ids))
            new += int(sum(i not in seen[f] for i in ids))
            seen[f] |= set(ids.tolist())
        assert meta["partition"]["new_id_share"] == pytest.approx(new / (3 * t.num_rows))
        assert meta["splits"]["train"]["rows"] == t.num_rows
    assert index["days"][0]["new_id_share"] == 1.0 and 0 < index["days"][1]["new_id_share"] < 1


def test_a_partitioned_data_set_reads_its_partitions_in_order(days, tmp_path):
    root, _ = days
    data = root / "days"
    meta = load_dataset_meta(data, ["day=003", "day=001"])
    assert meta.partitions == ("day=003", "day=001")
    assert [f.parent.parent.name for f in meta.files("train")] == ["day=003", "day=001"]
    parts = [load_dataset_meta(data / p) for p in ("day=003", "day=001")]
    assert meta.split_rows["train"] == sum(p.split_rows["train"] for p in parts)
    assert [f.num_embeddings for f in meta.features.sparse] == [
        max(a.num_embeddings, b.num_embeddings)
        for a, b in zip(parts[0].features.sparse, parts[1].features.sparse)]
    assert load_dataset_meta(data).partitions == ("day=001", "day=002", "day=003", "day=004")
    for names, message in ((["day=009"], "no partition 'day=009'"),
                           (["day=001", "day=001"], "named twice"), ([], "empty")):
        with pytest.raises(DatasetError, match=message):
            load_dataset_meta(data, names)
    with pytest.raises(DatasetError, match="not a partitioned data set"):
        load_dataset_meta(data / "day=001", ["day=001"])
    odd = tmp_path / "odd"
    shutil.copytree(data, odd)
    m = json.loads((odd / "day=002" / "metadata.json").read_text())
    m["dense"] = m["dense"][:-1]
    (odd / "day=002" / "metadata.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError, match=r"day=002/metadata.json: its columns differ"):
        load_dataset_meta(odd)


def test_a_warm_start_continues_the_run_it_starts_from_bit_for_bit(days, tmp_path):
    """Day 1, then a warm start on day 2: the same weights, tables' remapping state and
    optimizer state as one run over both days (no shuffle: the same batches in order)."""
    _, config = days
    _train(config, tmp_path / "d1", "--partitions", "day=001")
    _train(config, tmp_path / "d2", "--partitions", "day=002", "--warm-start",
           str(tmp_path / "d1"))
    _train(config, tmp_path / "both", "--partitions", "day=001,day=002")
    a, b = _params(_final(tmp_path / "d2"), tmp_path), _params(_final(tmp_path / "both"), tmp_path)
    assert any("_mch_sorted_raw_ids" in k for k in a["model"])
    _assert_equal({k: a[k] for k in ("model", "optimizer")},
                  {k: b[k] for k in ("model", "optimizer")})
    lineage = json.loads((tmp_path / "d2" / "lineage.json").read_text())
    assert lineage["partitions"] == ["day=002"]
    assert lineage["warm_start"]["run"] == str((tmp_path / "d1").resolve())
    assert lineage["warm_start"]["step"] == 3
    assert [c["partition"] for c in lineage["consumed"]] == ["day=001"]
    evaluated = run_cli("eval", str(tmp_path / "d2"), "--split", "train", "--partitions",
                        "day=003")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert 0.5 < json.loads(evaluated.stdout)["auc"] < 1


def test_a_partition_is_consumed_once_along_a_line(days, tmp_path):
    _, config = days
    _train(config, tmp_path / "d1", "--partitions", "day=001")
    _train(config, tmp_path / "d2", "--partitions", "day=002", "--warm-start",
           str(tmp_path / "d1"))
    for partitions, run in (("day=001", "d2"), ("day=003,day=002", "d2"), ("day=001", "d1")):
        r = run_cli("train", str(config), "--out", str(tmp_path / "d3"), "--partitions",
                    partitions, "--warm-start", str(tmp_path / run))
        assert r.returncode != 0 and not (tmp_path / "d3").exists()
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "was consumed by" in lines[0], r.stderr
    unfinished = tmp_path / "unfinished"
    shutil.copytree(tmp_path / "d1", unfinished)
    (unfinished / "summary.json").unlink()
    r = run_cli("train", str(config), "--out", str(tmp_path / "d3"), "--partitions", "day=002",
                "--warm-start", str(unfinished))
    assert r.returncode != 0 and "not finished" in r.stderr and len(r.stderr.splitlines()) == 1
    # a run of no line overwriting one of a line leaves no lineage behind
    from embedtrain.testing import tiny_ctr_dataset

    plain = tiny_ctr_dataset(tmp_path / "plain", rows=600)
    _train(config, tmp_path / "d2", "--overwrite", "--set", f"data.path={plain}",
           "--set", "tables=[]")
    assert not (tmp_path / "d2" / "lineage.json").exists()


def test_a_killed_warm_start_resumes_to_the_uninterrupted_runs_weights(days, tmp_path):
    """Killed after a checkpoint, or before any: resumed, each partition's rows are trained on
    once, and the weights are those of the run that was never stopped."""
    _, config = days
    _train(config, tmp_path / "d1", "--partitions", "day=001")
    line = ["--partitions", "day=002,day=003", "--warm-start", str(tmp_path / "d1")]
    _train(config, tmp_path / "full", *line)
    want = _params(_final(tmp_path / "full"), tmp_path)
    for name, keep in (("after", 2), ("before", 0)):
        run = tmp_path / name
        _train(config, run, *line, "--set", "train.max_steps=3")
        for ckpt in (run / "checkpoints").glob("step_*"):  # what a kill had left
            if int(ckpt.name.split("_")[1]) > keep:
                shutil.rmtree(ckpt)
        (run / "summary.json").unlink()
        r = _train(config, run, *line, "--resume")
        assert ("no checkpoint" in r.stdout + r.stderr) == (keep == 0)
        got = _params(_final(run), tmp_path)
        _assert_equal({k: got[k] for k in ("model", "optimizer")},
                      {k: want[k] for k in ("model", "optimizer")})


def test_tables_grow_for_an_extended_vocabulary(tmp_path):
    """A warm start onto a data set whose vocabulary grew: the old rows and their optimizer
    state carried, the new rows a fresh table's with fresh state."""
    from embedtrain.config import load_config
    from embedtrain.recipes import build_run
    from embedtrain.testing import tiny_ctr_dataset

    data = tmp_path / "data"
    tiny_ctr_dataset(data / "p1", rows=1000)
    shutil.copytree(data / "p1", data / "p2")
    meta = json.loads((data / "p2" / "metadata.json").read_text())
    old = {f["name"]: f["num_embeddings"] for f in meta["sparse"]}
    for f in meta["sparse"]:
        f["num_embeddings"] += 7  # ids appended by an extended vocabulary
    (data / "p2" / "metadata.json").write_text(json.dumps(meta))
    config = tmp_path / "c.yaml"
    config.write_text(f"""
data: {{path: {data}, batch_size: 250, shuffle: false}}
model: {{embedding_dim: 8, bottom_mlp: [16], top_mlp: [16]}}
train: {{epochs: 1, checkpoint_every: 0, progress: false}}
""")
    _train(config, tmp_path / "a", "--partitions", "p1")
    a = _params(_final(tmp_path / "a"), tmp_path)
    cfg = load_config(config, ["data.partitions=[p2]"])
    fresh = {k: v.clone() for k, v in _states(build_run(cfg, tmp_path / "f", progress=False))}
    run = build_run(cfg, tmp_path / "b", progress=False)
    run.trainer.warm_start(_final(tmp_path / "a"))
    grown = dict(_states(run))
    optimizer = run.trainer.optimizer.state_dict()["state"]
    tables = [k for k in grown if k.endswith(".weight") and ".t_" in k]
    assert tables and len(tables) == len(old)
    for key in tables:
        name = key.split(".t_")[1].split(".")[0]
        n = old[name]
        assert grown[key].shape[0] == n + 7
        assert torch.equal(grown[key][:n], a["model"][key])
        assert torch.equal(grown[key][n:], fresh[key][n:])
        state = {(p, name): _full(v) for p, st in optimizer.items() if p.endswith(key)
                 for name, v in st.items()}
        assert state, key
        for (p, name), v in state.items():
            assert torch.equal(v[:n], a["optimizer"]["state"][p][name])
            assert v.shape[0] == n + 7 and not v[n:].any()


def _states(run):
    """``(key, full tensor)`` of a built run's model state."""
    for k, v in run.trainer.model.state_dict().items():
        if isinstance(v, torch.Tensor):
            yield k, _full(v)


def _full(t):
    local = getattr(t, "local_shards", None)
    if local is None:
        return t.detach()
    return torch.cat([s.tensor.detach() for s in local()]) if local() else t



@pytest.fixture(scope="module")
def line(days, tmp_path_factory):
    """Day 1's run and day 2's warm start, with full exports of both (float32 and int8)."""
    from embedtrain.export.export import export_run

    _, config = days
    root = tmp_path_factory.mktemp("line")
    _train(config, root / "d1", "--partitions", "day=001")
    _train(config, root / "d2", "--partitions", "day=002", "--warm-start", str(root / "d1"))
    for q in ("none", "int8"):
        for run in ("d1", "d2"):
            export_run(root / run, root / f"{run}_{q}", quantize=q, progress=False)
    return root


def _same_files(a, b):
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_two_exports_of_one_checkpoint_are_byte_identical(line, tmp_path):
    from embedtrain.export.export import export_run

    export_run(line / "d2", tmp_path / "again", progress=False)
    _same_files(tmp_path / "again", line / "d2_none")


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_delta_patches_an_export_into_the_full_export_bit_for_bit(days, line, tmp_path,
                                                                    quantize):
    from embedtrain.export.delta import apply_delta, export_delta
    from embedtrain.export.predict import predict

    base, full = line / f"d1_{quantize}", line / f"d2_{quantize}"
    record = export_delta(line / "d2", base, tmp_path / "delta", progress=False)
    live = tmp_path / "live"
    shutil.copytree(base, live)
    apply_delta(tmp_path / "delta", live)
    _same_files(live, full)
    assert not list(tmp_path.glob(".live*"))  # the old export removed
    changed = of = 0
    for t in sorted((full / "tables").glob("t_*.npy")):
        a, b = np.load(base / "tables" / t.name), np.load(t)
        changed += int((a.view(np.uint8).reshape(len(a), -1)
                        != b.view(np.uint8).reshape(len(b), -1)).any(axis=1).sum())
        of += len(a)
    assert (record["rows_changed"], record["table_rows"]) == (changed, of) and 0 < changed < of
    assert record["bytes"] < record["full_bytes"]
    assert sum(e["removed"] for e in record["id_maps"]) > 0  # day 1's ids evicted
    data = days[0] / "days" / "day=003" / "train"
    predict(live, [str(data)], tmp_path / "a.parquet", progress=False)
    predict(full, [str(data)], tmp_path / "b.parquet", progress=False)
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))
    apply_delta(tmp_path / "delta", live)  # applied already: nothing to do
    _same_files(live, full)


def test_a_killed_apply_leaves_the_served_export_intact(days, line, tmp_path, monkeypatch):
    from embedtrain.export import delta as delta_module
    from embedtrain.export.delta import apply_delta, export_delta
    from embedtrain.export.manifest import ExportError
    from embedtrain.export.predict import ExportedModel, predict

    export_delta(line / "d2", line / "d1_none", tmp_path / "delta", progress=False)
    live = tmp_path / "live"
    shutil.copytree(line / "d1_none", live)
    data = days[0] / "days" / "day=003" / "train"
    predict(live, [str(data)], tmp_path / "before.parquet", progress=False)

    def killed(*args):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(delta_module, "_exchange", killed)
    with pytest.raises(KeyboardInterrupt):
        apply_delta(tmp_path / "delta", live)
    monkeypatch.undo()
    _same_files(live, line / "d1_none")
    predict(live, [str(data)], tmp_path / "after.parquet", progress=False)
    assert pq.read_table(tmp_path / "after.parquet").equals(
        pq.read_table(tmp_path / "before.parquet"))
    with pytest.raises(ExportError, match="made from the export"):
        apply_delta(tmp_path / "delta", line / "d2_int8")

    # a reader loading while the patch lands reloads: the new export, never a mix
    real, calls = ExportedModel._load, []

    def load(self, root, program):
        real(self, root, program)
        if not calls:
            calls.append(root)
            apply_delta(tmp_path / "delta", live)

    monkeypatch.setattr(ExportedModel, "_load", load)
    model = ExportedModel(live)
    _same_files(live, line / "d2_none")
    assert model.manifest.source.checkpoint == ExportedModel(line / "d2_none").manifest \
        .source.checkpoint


def test_delta_commands(line, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(line / "d1_none", live)
    r = run_cli("export", str(line / "d2"), "--delta-from", str(live), "--out",
                str(tmp_path / "delta"), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "of the full export" in r.stdout and "table rows changed" in r.stdout
    r = run_cli("export", "--apply", str(tmp_path / "delta"), "--to", str(live))
    assert r.returncode == 0 and "applied" in r.stdout, r.stderr[-2000:]
    _same_files(live, line / "d2_none")
    for args in (["--apply", str(tmp_path / "delta")],
                 [str(line / "d2"), "--delta-from", str(live)],
                 [str(line / "d2"), "--delta-from", str(live), "--out", str(tmp_path / "x"),
                  "--quantize", "int8"]):
        r = run_cli("export", *args)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_two_ranks_warm_start_resume_and_reshard(days, tmp_path):
    """On 2 ranks: a warm start killed before its first checkpoint and resumed ends with the
    weights of the uninterrupted one; a 2-rank run's checkpoint warm-starts a 1-rank run."""
    from test_distributed import embedtrain

    _, config = days

    def two(out, *args):
        r = embedtrain("train", str(config), "--out", str(tmp_path / out), "--nproc", "2",
                       *args)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    two("d1", "--partitions", "day=001")
    line = ["--partitions", "day=002,day=003", "--warm-start", str(tmp_path / "d1")]
    two("full", *line)
    two("killed", *line, "--set", "train.max_steps=1")
    shutil.rmtree(tmp_path / "killed" / "checkpoints")
    (tmp_path / "killed" / "summary.json").unlink()
    two("killed", *line, "--resume")
    a = _params(_final(tmp_path / "full"), tmp_path)
    b = _params(_final(tmp_path / "killed"), tmp_path)
    _assert_equal({k: a[k] for k in ("model", "optimizer")},
                  {k: b[k] for k in ("model", "optimizer")})
    # resharded: the 2-rank run's checkpoint warm-starts a 1-rank run (dynamic tables load
    # N -> M shards where each new shard holds whole old ones)
    _train(config, tmp_path / "one", "--partitions", "day=002", "--warm-start",
           str(tmp_path / "d1"))
    lineage = json.loads((tmp_path / "one" / "lineage.json").read_text())
    assert [c["run"] for c in lineage["consumed"]] == [str((tmp_path / "d1").resolve())]


def test_follow_trains_each_partition_once_as_it_appears(days, tmp_path):
    """Continuous mode: two partitions, then (stopped) the rest, then one that appears while it
    waits; each run warm-started from the one before, evaluated on the next partition first."""
    from embedtrain.config import load_config
    from embedtrain.recipes import follow

    root, config = days
    data = tmp_path / "days"
    data.mkdir()
    for p in ("day=001", "day=002", "day=003"):
        shutil.copytree(root / "days" / p, data / p)
    cfg = load_config(config, [f"data.path={data}"])
    first = follow(cfg, tmp_path / "runs", max_partitions=2)
    assert [r["partition"] for r in first] == ["day=001", "day=002"]
    assert "before" not in first[0] and first[1]["before"]["run"] == first[0]["run"]
    arrived = []

    def sleep(seconds):  # day 4 lands while the follower waits
        if not arrived:
            shutil.copytree(root / "days" / "day=004", data / "day=004")
            arrived.append(seconds)

    rest = follow(cfg, tmp_path / "runs", wait_s=5, poll_s=1, sleep=sleep)
    assert [r["partition"] for r in rest] == ["day=003", "day=004"] and arrived == [1]
    lineage = json.loads((tmp_path / "runs" / "day=004" / "lineage.json").read_text())
    assert [c["partition"] for c in lineage["consumed"]] == ["day=001", "day=002", "day=003"]
    assert lineage["warm_start"]["run"] == str((tmp_path / "runs" / "day=003").resolve())
    records = [json.loads(x) for x in (tmp_path / "runs" / "follow.jsonl").read_text()
               .splitlines()]
    assert [r["partition"] for r in records] == ["day=001", "day=002", "day=003", "day=004"]
    assert 0.4 < records[-1]["before"]["auc"] < 1
    assert follow(cfg, tmp_path / "runs") == []  # nothing new: nothing trained
    # the line as warm starts by hand: the same weights
    _train(config, tmp_path / "h1", "--set", f"data.path={data}", "--partitions", "day=001")
    _train(config, tmp_path / "h2", "--set", f"data.path={data}", "--partitions", "day=002",
           "--warm-start", str(tmp_path / "h1"))
    a = _params(_final(tmp_path / "runs" / "day=002"), tmp_path)
    b = _params(_final(tmp_path / "h2"), tmp_path)
    _assert_equal({k: a[k] for k in ("model", "optimizer")},
                  {k: b[k] for k in ("model", "optimizer")})
