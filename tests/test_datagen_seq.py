"""Tests for embedtrain.datagen.seq (small sizes: the whole file runs in a few seconds)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from embedtrain.datagen import SeqDataSpec, generate_seq
from embedtrain.datagen.ctr import SPLITS
from embedtrain.datagen.seq import iter_chunks, oracle_rows
from embedtrain.datagen.seq_model import FIRST_POP, SeqPlantedModel, rank_metrics

# min_length 3 (some users get no train row), max_length 6 (most rows are truncated), several
# files per split.
SPEC = SeqDataSpec(users=3_000, items=1_000, clusters=10, min_length=3, max_length=6,
                   mean_extra_events=8.0, rows_per_row_group=500, rows_per_file=1_200, seed=0)
# For the brute-force oracle check: every item is scored there.
TINY = SeqDataSpec(users=300, items=200, clusters=5, max_length=4, seed=3)
TINY_CLUSTER = SeqDataSpec(users=300, items=200, clusters=5, max_length=4, seed=3,
                           successors=2, transition="cluster")


def _read(out: Path, meta: dict, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(out / f) for f in meta["splits"][split]["files"]])


def _lists(column: pa.ChunkedArray) -> list[list[int]]:
    return column.to_pylist()


def _sequences(events: pa.Table) -> dict[int, list[int]]:
    """Each user's items, from the event log regrouped by user and sorted by time."""
    user, ts = events["user"].to_numpy(), events["timestamp"].to_numpy()
    item = events["item"].to_numpy()
    order = np.lexsort((ts, user))
    user, ts, item = user[order], ts[order], item[order]
    same = user[1:] == user[:-1]
    assert (ts[1:][same] > ts[:-1][same]).all()          # strictly increasing per user
    cuts = np.flatnonzero(~same) + 1
    return {int(u[0]): i.tolist() for u, i in zip(np.split(user, cuts), np.split(item, cuts))}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("seq")
    return out, generate_seq(SPEC, out, progress=False, events_dir=out)


def test_metadata(dataset):
    out, meta = dataset
    assert json.loads((out / "metadata.json").read_text()) == meta
    expected = {"task": "seq", "num_items": 1_001, "num_users": 3_000, "max_length": 6,
                "min_length": 3, "split_method": "leave_last_out", "user_column": "user",
                "items_column": "items", "target_column": "target"}
    assert {k: meta[k] for k in expected} == expected
    for name in ("oracle_hr@10", "oracle_ndcg@10", "oracle_expected_hr@10"):
        assert set(meta[name]) == {"valid", "test"} and 0 < meta[name]["test"] < 1, name
    assert meta["oracle_ndcg@10"]["test"] < meta["oracle_hr@10"]["test"]
    assert meta["generator"]["seed"] == 0 and meta["generator"]["clusters"] == 10
    assert "successors" in meta["generator"]["description"]
    assert [len(meta["splits"][s]["files"]) for s in ("valid", "test")] == [3, 3]
    assert meta["splits"]["valid"]["rows"] == meta["splits"]["test"]["rows"] == 3_000
    assert pq.ParquetFile(out / meta["splits"]["test"]["files"][0]).metadata.row_group(
        0).num_rows == 500


def test_leave_last_out_layout(dataset):
    out, meta = dataset
    events = pq.read_table(out / "events" / "part-00000.parquet")
    assert meta["events"] == events.num_rows
    seqs = _sequences(events)
    assert sorted(seqs) == list(range(SPEC.users))
    L = SPEC.max_length
    tables = {s: _read(out, meta, s) for s in SPLITS}
    for s, t in tables.items():
        want = ["user", "items", "target"]
        assert t.column_names == want and t.schema.field("items").type == pa.list_(pa.int64())
        assert all(t.schema.field(c).type == pa.int64() for c in want if c != "items")
        users = t["user"].to_numpy()
        assert (np.diff(users) > 0).all()                        # ascending user ids
        flat = t["items"].combine_chunks().flatten().to_numpy()
        assert flat.min() >= 1 and flat.max() <= SPEC.items     # never the padding id 0
    for s, end in (("train", 3), ("valid", 2), ("test", 1)):
        t = tables[s]
        for u, items, target in zip(t["user"].to_pylist(), _lists(t["items"]),
                                    t["target"].to_pylist()):
            x = seqs[u]
            assert items == x[max(0, len(x) - end - L): len(x) - end] and target == x[-end]
    train = tables["train"]
    assert train["user"].to_pylist() == [u for u, x in seqs.items() if len(x) - 3 >= 1]
    assert len(train) < SPEC.users                               # users with n = 3: no row
    lengths = {s: np.array([len(i) for i in _lists(tables[s]["items"])]) for s in SPLITS}
    assert lengths["train"].max() == L and lengths["valid"].max() == L   # truncated
    assert lengths["train"].min() == 1 and lengths["valid"].min() == 1
    n = np.array([len(x) for x in seqs.values()])
    assert n.min() == SPEC.min_length and n.max() <= SPEC.max_events
    assert abs(n.mean() - SPEC.min_length - SPEC.mean_extra_events) < 0.6


def test_event_log(dataset, tmp_path):
    out, meta = dataset
    events = pq.read_table(out / "events" / "part-00000.parquet")
    assert events.column_names == ["user", "item", "timestamp"]
    assert all(f.type == pa.int64() for f in events.schema)
    ts, user = events["timestamp"].to_numpy(), events["user"].to_numpy()
    assert (np.diff(ts) >= 0).all()                              # global time order
    tie = np.diff(ts) == 0
    assert (np.diff(user)[tie] > 0).all()                        # ties by user
    assert user[:1000].std() > 100                               # users interleaved
    model = SeqPlantedModel(SPEC)                                # the drawn sequences
    seqs = _sequences(events)
    for ch in iter_chunks(SPEC, model):
        for i in range(len(ch.offsets) - 1):
            assert seqs[ch.first_user + i] == ch.items[ch.offsets[i]:ch.offsets[i + 1]].tolist()
    # CSV (the same events) into a folder of its own; the metadata does not change.
    meta2 = generate_seq(SPEC, tmp_path / "d", progress=False, events_dir=tmp_path / "raw",
                         events_format="csv")
    assert meta2 == meta and not (tmp_path / "d" / "events").exists()
    assert (tmp_path / "raw" / "events" / "part-00000.csv").read_text().startswith(
        '"user","item","timestamp"\n')
    assert pacsv.read_csv(tmp_path / "raw" / "events" / "part-00000.csv").equals(events)
    with pytest.raises(ValueError, match="events_format must be one of parquet, csv"):
        generate_seq(SPEC, tmp_path / "d", progress=False, events_dir=tmp_path, events_format="tsv")


def test_determinism_and_seed_dependence(dataset, tmp_path):
    out, meta = dataset
    again = tmp_path / "again"
    assert generate_seq(SPEC, again, progress=False, events_dir=again) == meta
    files = [f for s in SPLITS for f in meta["splits"][s]["files"]]
    for f in files + ["events/part-00000.parquet"]:
        assert (out / f).read_bytes() == (again / f).read_bytes(), f
    other = SeqDataSpec(**{**SPEC.__dict__, "seed": 1})
    meta3 = generate_seq(other, tmp_path / "other", progress=False)
    assert not _read(out, meta, "test").equals(_read(tmp_path / "other", meta3, "test"))
    assert meta3["oracle_hr@10"] != meta["oracle_hr@10"]


def test_planted_model():
    model = SeqPlantedModel(SPEC)
    N, K, S = SPEC.items, SPEC.clusters, SPEC.successors
    assert model.succ.shape == (N + 1, S)
    assert np.bincount(model.cluster[1:], minlength=K).tolist() == [N // K] * K
    np.testing.assert_allclose(np.bincount(model.cluster[1:], model.pop[1:], K), 1.0)
    assert model.g.sum() == pytest.approx(1.0) and model.pop[0] == model.g[0] == 0
    np.testing.assert_allclose(model.succ_weight, [0.4, 0.3, 0.2, 0.1])
    succ = model.succ[1:]
    assert (succ >= 1).all() and (succ != np.arange(1, N + 1)[:, None]).all()
    assert (np.sort(succ, axis=1)[:, 1:] != np.sort(succ, axis=1)[:, :-1]).all()  # distinct
    local = (model.cluster[succ] == model.cluster[1:, None]).mean()
    assert abs(local - (0.8 + 0.2 / K)) < 0.03
    # The pool: each cluster's 10 most popular items, best first.
    assert (model.rank[model.pool] == np.arange(10)).all()
    assert (model.cluster[model.pool] == np.arange(K)[:, None]).all()


def _brute_force(model: SeqPlantedModel, x: list[int]) -> np.ndarray:
    """P(next = j | x) for all j = 0..N (0: probability 0), from the model's definition."""
    spec, N, K = model.spec, model.num_items, model.num_clusters
    pop_k = np.zeros((K, N + 1))                                   # pop_k(j), all k and j
    pop_k[model.cluster[1:], np.arange(1, N + 1)] = model.pop[1:]
    succ_p = np.zeros((N + 1, N + 1))                              # succ(i)[j]
    if spec.transition == "item":
        succ_p[np.arange(N + 1)[:, None], model.succ] = model.succ_weight
    else:  # the s-th successor cluster of i's cluster, then its popularity
        for s, weight in enumerate(model.succ_weight):
            succ_p += weight * pop_k[model.cluster_succ[model.cluster, s]]
    succ_p[0] = 0
    a, b, c = spec.successor_prob, spec.interest_prob, spec.global_prob
    first = FIRST_POP * pop_k[:, x[0]] + (1 - FIRST_POP) * model.g[x[0]]
    log = np.log(model.weight) + np.log(first)
    for prev, cur in zip(x[:-1], x[1:]):
        log += np.log(a * succ_p[prev, cur] + b * pop_k[:, cur] + c * model.g[cur])
    post = np.exp(log - log.max())
    post /= post.sum()
    p = a * succ_p[x[-1]] + b * post @ pop_k + c * model.g
    p[0] = -np.inf
    return p


@pytest.mark.parametrize("spec", [TINY, TINY_CLUSTER], ids=["item", "cluster"])
def test_oracle_matches_brute_force(spec):
    model = SeqPlantedModel(spec)
    (ch,) = list(iter_chunks(spec, model))
    figures = oracle_rows(model, ch)
    for split, end in (("valid", 2), ("test", 1)):
        hr, ndcg, expected = [], [], []
        for i in range(spec.users):
            x = ch.items[ch.offsets[i]:ch.offsets[i + 1]].tolist()
            p = _brute_force(model, x[:-end])
            assert p[1:].sum() == pytest.approx(1.0)
            top = np.lexsort((np.arange(len(p)), -p))[:10]        # ties: the smaller id first
            h, n = rank_metrics(top[None], np.array([x[-end]]))
            hr.append(h[0])
            ndcg.append(n[0])
            expected.append(p[top].sum())
        np.testing.assert_array_equal(figures[split][0], hr)
        np.testing.assert_array_equal(figures[split][1], ndcg)
        np.testing.assert_allclose(figures[split][2], expected, rtol=1e-9)
        assert 0.3 < np.mean(hr) < 1 and np.mean(ndcg) < np.mean(hr)
    # rank_metrics itself: rank 1 -> 1, rank 3 -> 1/log2(4) = 0.5, absent -> 0.
    h, n = rank_metrics(np.array([[5, 6, 7], [5, 6, 7], [5, 6, 7]]), np.array([5, 7, 9]))
    assert h.tolist() == [1, 1, 0] and n.tolist() == [1.0, 0.5, 0.0]


def test_oracle_ties_rank_the_smaller_id_first():
    # Equal cluster weights and a uniform posterior: the same rank in every cluster ties exactly,
    # within the top 10 and at its cut.
    spec = SeqDataSpec(users=10, items=400, clusters=20, cluster_zipf_a=0.0)
    model = SeqPlantedModel(spec)
    last = np.arange(1, spec.items + 1)
    post = np.full((len(last), spec.clusters), 1 / spec.clusters)
    top, prob = model.oracle_topk(post, last)
    every = np.broadcast_to(np.arange(1, spec.items + 1), (len(last), spec.items))
    p = model.next_probs(post, last, np.ascontiguousarray(every))
    order = np.lexsort((every, -p))
    np.testing.assert_array_equal(top, np.take_along_axis(every, order[:, :10], 1))
    np.testing.assert_array_equal(prob, np.take_along_axis(p, order[:, :10], 1))
    ranked = np.take_along_axis(p, order[:, :11], 1)
    assert (ranked[:, 9] == ranked[:, 10]).mean() > 0.5 and (ranked[:, :9] == ranked[:, 1:10]).any()


def test_oracle_beats_popularity(dataset):
    out, meta = dataset
    train, test = _read(out, meta, "train"), _read(out, meta, "test")
    counts = np.bincount(train["items"].combine_chunks().flatten().to_numpy(),
                         minlength=SPEC.items + 1)
    top = np.argsort(-counts, kind="stable")[:10]
    hr, ndcg = rank_metrics(np.broadcast_to(top, (len(test), 10)), test["target"].to_numpy())
    oracle_hr, oracle_ndcg = meta["oracle_hr@10"]["test"], meta["oracle_ndcg@10"]["test"]
    assert oracle_hr > hr.mean() + 0.3 and oracle_ndcg > ndcg.mean() + 0.2, (hr.mean(), oracle_hr)
    for s in ("valid", "test"):   # the realised HR close to its expectation
        assert abs(meta["oracle_hr@10"][s] - meta["oracle_expected_hr@10"][s]) < 0.03


def test_cluster_transitions():
    spec = SeqDataSpec(users=20_000, items=1_000, clusters=10, transition="cluster", seed=1)
    model = SeqPlantedModel(spec)
    K, S = spec.clusters, spec.successors
    assert model.succ.shape == (spec.items + 1, 0) and model.cluster_succ.shape == (K, S)
    assert (model.cluster_succ != np.arange(K)[:, None]).all()          # never itself
    assert all(len(set(row)) == S for row in model.cluster_succ.tolist())  # distinct
    np.testing.assert_allclose(model.transfer.sum(axis=1), 1.0)
    assert model.transfer[np.arange(K), model.cluster_succ[:, 0]].tolist() == [0.4] * K
    # The draws follow the model the oracle ranks by: the realised HR@10 and the summed top-10
    # probability agree within about 3 standard errors (a draw from another successor cluster,
    # or uniform inside it, would not).
    (ch,) = list(iter_chunks(spec, model))
    hr, _, expected = oracle_rows(model, ch)["test"]
    assert abs(hr.mean() - expected.mean()) < 0.01, (hr.mean(), expected.mean())
    # Steps from a successor cluster: the next item's cluster is a successor of the last one's
    # at least as often as the successor component alone makes it.
    first = ch.offsets[:-1]
    prev = np.ones(len(ch.items), bool)
    prev[first] = False
    cur = ch.items[prev]
    last = ch.items[np.flatnonzero(prev) - 1]
    follows = (model.cluster_succ[model.cluster[last]] == model.cluster[cur][:, None]).any(1)
    assert follows.mean() > spec.successor_prob, follows.mean()


@pytest.mark.parametrize("field, value, says", [
    ("users", 5, "SeqDataSpec.users must be an integer >= 10, got 5"),
    ("items", 89, "SeqDataSpec.items must be an integer >= 10 * clusters"),
    ("clusters", 0, "SeqDataSpec.clusters must be an integer >= 1"),
    ("min_length", 2, "SeqDataSpec.min_length must be an integer in [3, max_events=200]"),
    ("min_length", 201, "SeqDataSpec.min_length must be"),
    ("max_length", 0, "SeqDataSpec.max_length must be an integer >= 1"),
    ("successor_prob", 0.0, "SeqDataSpec.successor_prob must be in (0, 1)"),
    ("global_prob", 0.2, "successor_prob + SeqDataSpec.interest_prob + SeqDataSpec.global_prob "
                    "must sum to 1, got 1.05"),
    ("item_zipf_a", 0.0, "SeqDataSpec.item_zipf_a must be positive"),
    ("seed", -1, "SeqDataSpec.seed must be a non-negative integer"),
    ("users", 10.5, "SeqDataSpec.users must be an integer"),
    ("transition", "items", "SeqDataSpec.transition must be one of item, cluster, got 'items'"),
])
def test_bad_spec_values(field, value, says):
    with pytest.raises(ValueError) as e:
        SeqDataSpec(**{"items": 100, "clusters": 9, field: value})
    assert says in str(e.value) and "\n" not in str(e.value)


def test_cluster_transition_needs_fewer_successors_than_clusters():
    with pytest.raises(ValueError, match="successors must be < clusters .= 4. with transition "
                                         "'cluster', got 4$"):
        SeqDataSpec(items=100, clusters=4, transition="cluster")


def test_cli(tmp_path, capsys):
    from embedtrain.cli import main

    out = tmp_path / "gen"
    argv = ["datagen", "seq", "--users", "400", "--items", "500", "--clusters", "5",
            "--max-length", "8", "--min-length", "4", "--seed", "2", "--out", str(out)]
    assert main(argv + ["--events", str(out), "--events-format", "csv"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}: 400 users, 500 items")
    assert "oracle HR@10 on test" in printed
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["max_length"] == 8 and meta["min_length"] == 4 and meta["generator"]["seed"] == 2
    assert (out / "events" / "part-00000.csv").is_file()
    assert main(argv) == 0                     # replaces the earlier output, CSV log included
    assert not (out / "events").exists()
    raw = tmp_path / "raw"
    assert main(argv + ["--events", str(raw)]) == 0
    info = json.loads((raw / "datagen.json").read_text())
    assert info["files"] == ["events/part-00000.parquet"] and info["rows"] == meta["events"]
    assert pq.read_table(raw / info["files"][0]).num_rows == meta["events"]
    capsys.readouterr()
    for bad, says in [(["--items", "40"], "--items must be an integer >= 10 * clusters"),
                      (["--min-length", "2"], "--min-length must be"),
                      (["--events-format", "json"], "--events-format: expected one of"),
                      (["--events", str(out / "raw")], "--events: must be --out itself or"),
                      (["--successor-prob", "0.3"], "--successor-prob + --interest-prob + "
                                                    "--global-prob must sum to 1"),
                      (["--transition", "clusters"], "--transition must be one of item, "
                                                     "cluster, got 'clusters'"),
                      (["--transition", "cluster", "--successors", "5"],
                       "--successors must be < clusters (= 5) with transition 'cluster'")]:
        assert main(argv + bad) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "Spec." not in err[0], err
    mixture = ["--successor-prob", "0.3", "--interest-prob", "0.6", "--global-prob", "0.1",
               "--successor-locality", "0.2"]
    assert main(argv + mixture) == 0
    generator = json.loads((out / "metadata.json").read_text())["generator"]
    assert [generator[k] for k in ("successor_prob", "interest_prob", "global_prob",
                                   "successor_locality")] == [0.3, 0.6, 0.1, 0.2]
    assert generator["transition"] == "item" and generator["successors"] == 4
    assert main(argv + ["--transition", "cluster", "--successors", "2"]) == 0
    generator = json.loads((out / "metadata.json").read_text())["generator"]
    assert generator["transition"] == "cluster" and generator["successors"] == 2
    assert "successor clusters" in generator["description"]
    assert main(["datagen", "seq", "--users", "5", "--out", str(tmp_path / "no")]) == 2
    assert not (tmp_path / "no").exists()


def test_cli_length_flags(tmp_path, capsys):
    """``--mean-extra-events`` and ``--max-events`` reach the spec: long histories (~100 events
    a user, as in small public logs), capped; a bad value is one line naming the flag."""
    from embedtrain.cli import main

    out = tmp_path / "long"
    argv = ["datagen", "seq", "--users", "300", "--items", "500", "--clusters", "5",
            "--max-length", "200", "--min-length", "20", "--out", str(out)]
    assert main(argv + ["--mean-extra-events", "80", "--max-events", "150"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    gen = meta["generator"]
    assert gen["mean_extra_events"] == 80 and gen["max_events"] == 150
    assert 80 * 300 < meta["events"] < 110 * 300
    lengths = [len(x) for x in pq.read_table(out / meta["splits"]["test"]["files"][0])
               .column("items").to_pylist()]
    assert min(lengths) == 19 and max(lengths) == 149  # n - 1 events before the test target
    capsys.readouterr()
    for bad, says in [(["--max-events", "10"], "--min-length must be an integer in [3, "
                                               "max_events=10]"),
                      (["--mean-extra-events", "-1"], "--mean-extra-events must be")]:
        assert main(argv + bad) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


def test_progress_goes_to_stderr(tmp_path, capsys):
    spec = SeqDataSpec(users=300, items=200, clusters=5)
    generate_seq(spec, tmp_path / "on", progress=True)
    captured = capsys.readouterr()
    final = captured.err.rstrip("\n").split("\r")[-1]
    assert captured.out == "" and final.startswith("datagen seq: 100%|") and " 300/300 [" in final
    generate_seq(spec, tmp_path / "off", progress=False)
    assert capsys.readouterr() == ("", "")
