"""Retrieval ingestion (``kind: sequence``, ``task: retrieval``): one row per event against a
pure-Python reference (both split methods), the item table and its drops, ``datagen retrieval
--events`` ingested back into the generator's rows, a run on the ingested data, bad input in one
line."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from embedtrain.config_io import ConfigError
from pipelines import run_ingest
from pipelines.core.errors import IngestError

SPLITS = ("train", "valid", "test")
CATALOG = [f"i{k}" for k in range(45)]  # the item table: i45..i59 are in events, not in it


def _events(seed: int, n: int = 2500, users: int = 120, items: int = 60) -> list[tuple]:
    """(user, item, time, age) rows: repeated times, items outside the table, some nulls."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        u = f"u{int(rng.integers(users)):03d}"
        r = rng.random()
        rows.append((None if r < 0.01 else u,
                     None if 0.01 <= r < 0.02 else f"i{int(rng.zipf(1.3)) % items}",
                     None if 0.02 <= r < 0.03 else int(rng.integers(0, 300)),
                     None if r > 0.97 else f"a{int(rng.integers(4))}"))
    return rows


def _reference(rows, max_length, min_length, method="lloo", valid_time=0, test_time=0):
    """The data set by the definition: per split (user, age, history, item) rows with raw
    values, and the drops."""
    dropped, events = Counter(), defaultdict(list)
    for index, (u, i, t, a) in enumerate(rows):
        reason = ("null_user" if u is None else "null_item" if i is None else
                  "null_time" if t is None else "unknown_item" if i not in CATALOG else None)
        if reason:
            dropped[reason] += 1
        else:
            events[u].append((t, index, i, a))
    kept = {u: sorted(v) for u, v in events.items() if len(v) >= min_length}
    dropped["short_history"] = sum(len(v) for v in events.values() if len(v) < min_length)
    out = {s: [] for s in SPLITS}
    for user in sorted(kept):
        x = kept[user]
        for k, (t, _, item, age) in enumerate(x):
            if method == "lloo":
                split = "test" if k == len(x) - 1 else "valid" if k == len(x) - 2 else "train"
            else:
                split = "train" if t < valid_time else "valid" if t < test_time else "test"
            out[split].append((user, age, [i for _, _, i, _ in x[max(0, k - max_length):k]],
                               item))
    return out, dropped


def _write(tmp_path: Path, rows: list[tuple]) -> Path:
    pl.DataFrame(rows, schema=["user", "item", "timestamp", "age"], orient="row").write_csv(
        tmp_path / "events.csv")
    pl.DataFrame({"item": CATALOG, "color": [f"c{k % 7}" for k in range(len(CATALOG))]}
                 ).write_csv(tmp_path / "items.csv")
    return tmp_path / "events.csv"


def _spec(tmp_path: Path, body: str, features: str = "[age]") -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"kind: sequence\ntask: retrieval\nuser_features: {features}\n"
                    f"items: {{path: {tmp_path / 'items.csv'}, features: [color]}}\n" + body)
    return spec


def _decoded(out: Path, split: str) -> list[tuple]:
    """A split's rows with every id mapped back to its raw value through the vocabularies."""
    meta = json.loads((out / "metadata.json").read_text())
    if split not in meta["splits"]:
        return []
    vocab = {}
    for name, file in meta["vocab_files"].items():
        table = pl.read_parquet(out / file)
        vocab[name] = dict(zip(table["id"].to_list(), table["value"].to_list()))
    frame = pl.concat([pl.read_parquet(out / f) for f in meta["splits"][split]["files"]])
    return [(vocab["user"][r["user"]], vocab["age"].get(r["age"]),
             [vocab["item"][i] for i in r["history"]], vocab["item"][r["item"]])
            for r in frame.iter_rows(named=True)]


@pytest.mark.parametrize("method", ["lloo", "time"])
def test_rows_equal_the_reference(tmp_path, method):
    """Every kept event is one row's label with its newest max_length events before it; the
    split is leave-last-out or by time; every event read is used or dropped by reason."""
    rows = _events(0)
    split = ("split: {method: time, valid_time: 200, test_time: 250}\n" if method == "time"
             else "")
    spec = _spec(tmp_path, f"max_length: 4\nmin_length: 3\n{split}")
    report, lines = run_ingest(spec, [str(_write(tmp_path, rows))], tmp_path / "out",
                               progress=False)
    want, dropped = _reference(rows, 4, 3, method, 200, 250)
    for s in SPLITS:
        assert _decoded(tmp_path / "out", s) == want[s], s
    assert report["events_dropped"] == {k: dropped[k] for k in report["events_dropped"]}
    assert dropped["unknown_item"] > 0 and report["events_dropped"]["truncated"] == 0
    assert report["rows_read"] == report["events_used"] + sum(report["events_dropped"].values())
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert meta["task"] == "retrieval" and meta["num_classes"] == len(CATALOG)
    assert [f["name"] for f in meta["sparse"]] == ["user", "age", "history"]
    # the item table: every listed item (some in no event) in the file's order, its features
    items = pl.read_parquet(tmp_path / "out" / "items.parquet")
    colors = pl.read_parquet(tmp_path / "out" / "vocab" / "item_color.parquet")
    color = dict(zip(colors["id"].to_list(), colors["value"].to_list()))
    assert items["item"].to_list() == list(range(len(CATALOG)))
    assert [color[c] for c in items["color"]] == [f"c{k % 7}" for k in range(len(CATALOG))]
    assert any("ids 0..44: the item table" in line for line in lines)


def test_datagens_event_log_ingests_into_datagens_rows(tmp_path):
    """``datagen retrieval --events`` and ``ingest`` of that log agree row for row (features
    mapped through the vocabularies), item table included, with the shipped spec
    (``configs/ingest/retrieval_events.yaml``); the same log ingests as task: seq."""
    from embedtrain.datagen.retrieval import RetrievalDataSpec, generate_retrieval

    spec = RetrievalDataSpec(users=600, items=300, segments=4, attributes=2, categories=5,
                             brands=20, max_length=6, seed=5)
    generate_retrieval(spec, tmp_path / "gen", progress=False, events=True)
    config = Path(__file__).resolve().parent.parent / "configs/ingest/retrieval_events.yaml"
    run_ingest(config, [str(tmp_path / "gen" / "events")], tmp_path / "ing", progress=False,
               overrides=[f"items.path={tmp_path / 'gen' / 'items.parquet'}", "max_length=6",
                          "user_features=[segment, attr0, attr1]"])
    ing = tmp_path / "ing"
    meta = json.loads((ing / "metadata.json").read_text())

    def decode(frame: pl.DataFrame, files: dict) -> pl.DataFrame:
        for column, file in files.items():
            v = pl.read_parquet(ing / file)
            frame = frame.with_columns(pl.col(column).replace_strict(
                dict(zip(v["id"].to_list(), v["value"].to_list())), return_dtype=pl.Int64))
        return frame

    for split in SPLITS:
        gen = pl.read_parquet(tmp_path / "gen" / split / "*.parquet")
        got = decode(pl.read_parquet(ing / split / "*.parquet"),
                     {c: meta["vocab_files"][c] for c in ("segment", "attr0", "attr1")})
        assert got.columns == gen.columns and got.equals(gen), split
    items = decode(pl.read_parquet(ing / "items.parquet"),
                   {c: meta["vocab_files"][f"item.{c}"] for c in ("category", "brand")})
    assert items.equals(pl.read_parquet(tmp_path / "gen" / "items.parquet"))
    (tmp_path / "seq.yaml").write_text("kind: sequence\ninput: {format: parquet}\n"
                                       "id_type: integer\nmin_length: 3\n")
    report, _ = run_ingest(tmp_path / "seq.yaml", [str(tmp_path / "gen" / "events")],
                           tmp_path / "seq", progress=False)
    assert report["rows_read"] == meta["events"] and report["rows_written"]["test"] == 600


def test_a_run_trains_and_evaluates_on_ingested_data(tmp_path):
    """The retrieval family takes the ingested data set as it is: the run's evaluation ranks the
    whole item table."""
    import embedtrain as et

    rows = _events(1, n=4000)
    run_ingest(_spec(tmp_path, "max_length: 5\nmin_length: 3\n"),
               [str(_write(tmp_path, rows))], tmp_path / "data", progress=False)
    cfg = et.load_config("configs/retrieval_synthetic.yaml", overrides=[
        f"data.path={tmp_path / 'data'}", "train.max_steps=6", "data.batch_size=64",
        "task.mixed_negatives=8", "model.dim=8", "model.hidden=[16]", "train.progress=false"])
    summary = et.fit(cfg, tmp_path / "run")
    assert summary["steps"] == 6 and 0 <= summary["recall@10"] <= summary["recall@50"] <= 1
    # served: the export ranks the whole item table for the ingested query rows
    et.export_run(tmp_path / "run", tmp_path / "export", progress=False)
    et.predict(tmp_path / "export", [str(tmp_path / "data" / "test")], tmp_path / "top.parquet",
               top_k=5, progress=False)
    top = pl.read_parquet(tmp_path / "top.parquet")["top_ids"].to_list()
    assert len(top) == json.loads((tmp_path / "data" / "metadata.json").read_text()
                                  )["splits"]["test"]["rows"]
    assert all(len(set(t)) == 5 and 0 <= min(t) and max(t) < len(CATALOG) for t in top)
    with pytest.raises(IngestError, match="a retrieval data set ingested from events"):
        et.predict(tmp_path / "export", [str(tmp_path / "events.csv")], tmp_path / "raw.parquet",
                   raw=True, progress=False)


@pytest.mark.parametrize("body,message", [
    ("task: ranking\n", "task: expected seq or retrieval"),
    ("task: seq\n", "user_features: only for task: retrieval"),
    ("items: {features: [color]}\n", "items.features: needs items.path"),
    ("time: age\n", "user, item, time and user_features columns must differ"),
])
def test_spec_mistakes_are_refused_in_one_line(tmp_path, body, message):
    spec = tmp_path / "spec.yaml"
    spec.write_text("kind: sequence\nuser_features: [age]\n"
                    + ("" if body.startswith("task") else "task: retrieval\n") + body)
    with pytest.raises(ConfigError, match=message):
        run_ingest(spec, [str(tmp_path)], tmp_path / "out", progress=False)


def test_a_bad_item_table_is_one_line_naming_file_row_and_column(tmp_path):
    events = _write(tmp_path, _events(2, n=200))
    pl.DataFrame({"item": ["i1", "i2", "i1"], "color": ["a", "b", "c"]}).write_csv(
        tmp_path / "items.csv")
    with pytest.raises(IngestError, match=r"items\.csv: row 2: column item: listed twice "
                                          r"\(value 'i1'\)"):
        run_ingest(_spec(tmp_path, ""), [str(events)], tmp_path / "out", progress=False)
    pl.DataFrame({"item": ["i1"]}).write_csv(tmp_path / "items.csv")
    with pytest.raises(IngestError, match=r"items\.csv: cannot read the item table: .*color"):
        run_ingest(_spec(tmp_path, ""), [str(events)], tmp_path / "out", progress=False)
    (tmp_path / "items.csv").unlink()
    with pytest.raises(IngestError, match=r"items\.csv: no such file \(items\.path\)"):
        run_ingest(_spec(tmp_path, ""), [str(events)], tmp_path / "out", progress=False)
    with pytest.raises(IngestError, match=r"events\.csv: missing column\(s\) hue"):
        run_ingest(_spec(tmp_path, "", "[hue]"), [str(events)], tmp_path / "out",
                   progress=False)
