"""The out-of-core CSR build (:func:`csr_from_edge_chunks`) against the in-memory one."""

from __future__ import annotations

import numpy as np
import pytest

from embedtrain.graph import csr_external
from embedtrain.graph.csr import csr_from_edges
from embedtrain.graph.csr_external import csr_from_edge_chunks


def _edges(n: int, m: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    # skewed degrees (a few hubs), self-loops and many repeated edges
    src = np.minimum(rng.zipf(1.6, m) - 1, n - 1)
    dst = rng.integers(0, n, m)
    repeat = rng.integers(0, m, m // 5)
    src[repeat[: m // 10]] = src[repeat[m // 10:]][: m // 10]
    dst[repeat[: m // 10]] = dst[repeat[m // 10:]][: m // 10]
    src[:20] = dst[:20]
    return src, dst, rng.uniform(0.5, 2.0, m)


def _chunks(src, dst, w, size):
    for a in range(0, src.shape[0], size):
        yield src[a:a + size], dst[a:a + size], None if w is None else w[a:a + size]


# every pair of settings appears in some case (all 24 combinations: 4x the time, no more pairs)
@pytest.mark.parametrize("undirected,self_loops,duplicates,weighted", [
    (True, "drop", "drop", True), (True, "keep", "sum", False), (True, "keep", "keep", True),
    (False, "drop", "sum", True), (False, "keep", "drop", False), (False, "drop", "keep", False)])
def test_the_external_build_equals_the_in_memory_one(tmp_path, monkeypatch, undirected,
                                                     self_loops, duplicates, weighted):
    monkeypatch.setattr(csr_external, "_SPILL", 300)  # chunks of 1,000 edges spilled in slices
    splits = []
    split = csr_external._SortState._split
    monkeypatch.setattr(csr_external._SortState, "_split",
                        lambda self, *a: (splits.append(a[1:3]), split(self, *a)))
    n, m = 500, 3000
    src, dst, w = _edges(n, m, seed=3)
    w = w if weighted else None
    want = csr_from_edges(src, dst, n, w, undirected=undirected, self_loops=self_loops,
                          duplicates=duplicates)
    # 400 bytes a bucket: 8 to 16 entries, so buckets split (the hubs' down to single nodes)
    # and the recursion and in-order writing run
    got = csr_from_edge_chunks(_chunks(src, dst, w, 1000), n, tmp_path / "csr", weighted=weighted,
                               undirected=undirected, self_loops=self_loops,
                               duplicates=duplicates, memory_budget=400)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[1].dtype == want[1].dtype
    if want[2] is None:
        assert got[2] is None
    else:
        np.testing.assert_array_equal(got[2], want[2])
    assert got[3] == want[3]
    # the outputs are .npy files that load on their own; the spill files are gone
    np.testing.assert_array_equal(np.load(tmp_path / "csr" / "indices.npy"), want[1])
    np.testing.assert_array_equal(np.load(tmp_path / "csr" / "indptr.npy"), want[0])
    assert not (tmp_path / "csr" / "buckets").exists()
    assert len(splits) > 10


def test_a_large_budget_sorts_each_bucket_once(tmp_path):
    src, dst, _ = _edges(300, 2000, seed=4)
    want = csr_from_edges(src, dst, 300)
    got = csr_from_edge_chunks(_chunks(src, dst, None, 64), 300, tmp_path, memory_budget=1 << 30)
    np.testing.assert_array_equal(got[1], want[1])
    assert got[3] == want[3]


def test_nothing_left_gives_an_empty_csr(tmp_path):
    loops = (np.array([1, 2, 2]), np.array([1, 2, 2]), None)  # self-loops only: all dropped
    indptr, indices, _, counts = csr_from_edge_chunks([loops], 4, tmp_path, memory_budget=8)
    assert indptr.tolist() == [0] * 5 and indices.shape == (0,)
    assert counts == csr_from_edges(*loops[:2], 4)[3]


def test_bad_chunks_are_refused_as_in_memory(tmp_path):
    with pytest.raises(ValueError, match=r"dst: ids must be in \[0, 5\), got 7"):
        csr_from_edge_chunks([(np.array([0]), np.array([7]), None)], 5, tmp_path)


# --- the ingest job's out-of-core path ---------------------------------------------------------

SPEC = """
kind: graph
name: big
id_type: {id_type}
edges: {{format: parquet, src: src, dst: dst{weight}{time}}}
nodes: {{format: parquet, id: id, features: [f], label: label, missing_nodes: {missing}}}
graph: {{directed: {directed}, self_loops: drop, duplicates: {duplicates}}}
split: {{valid_fraction: 0.2, test_fraction: 0.2, edge_valid_fraction: 0.05, edge_test_fraction: 0.05}}
"""


def _ingest_inputs(tmp_path, integer=False):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    n, m = 400, 5000
    src, dst, w = _edges(n, m, seed=6)
    ids = np.array([i * 7919 % 1000 if integer else f"n{i * 7919 % 1000}" for i in range(n)])
    files = []
    for part in range(3):  # three files, so rows are numbered across them
        sl = slice(part * m // 3, (part + 1) * m // 3)
        files.append(tmp_path / f"edges{part}.parquet")
        t = rng.integers(0, 50, sl.stop - sl.start).astype(float)  # ties, and missing times
        t[::17] = np.nan
        pq.write_table(pa.table({"src": ids[src[sl]], "dst": ids[dst[sl]], "w": w[sl],
                                 "t": pa.array(t, from_pandas=True)}), files[-1])
    if integer:  # a file with no usable row (null endpoints): an empty shard
        files.append(tmp_path / "edges3.parquet")
        pq.write_table(pa.table({"src": pa.array([None, 3], pa.int64()),
                                 "dst": pa.array([5, None], pa.int64()), "w": [1.0, 1.0],
                                 "t": [1.0, 2.0]}), files[-1])
    table = tmp_path / "nodes.parquet"  # some endpoints are missing from the node table
    keep = rng.permutation(n)[: n - 40]
    pq.write_table(pa.table({"id": ids[keep], "f": rng.normal(size=keep.shape[0]),
                             "label": rng.integers(0, 3, keep.shape[0])}), table)
    return files, table


@pytest.mark.parametrize("directed,duplicates,missing,weighted,timed,integer", [
    (False, "drop", "add", True, False, False), (True, "sum", "drop", False, True, False),
    (False, "keep", "drop", True, True, False), (False, "drop", "add", True, True, True),
    (True, "keep", "drop", False, False, True)])
def test_ingest_out_of_core_equals_in_memory(tmp_path, monkeypatch, directed, duplicates, missing,
                                             weighted, timed, integer):
    # Integer ids out of core take the sorted-array remap (pipelines/graph/remap.py), in batches
    # of 97 rows here, so first appearances span batches; in memory, Polars' joins.
    from embedtrain.graph.store import load_graph
    from pipelines.graph import passes, remap
    from pipelines.graph.passes import ingest
    from pipelines.graph.spec import load_spec

    monkeypatch.setattr(remap, "BATCH_ROWS", 97)
    if integer and directed:  # the direct table (the ids' range fits); else sorted arrays
        monkeypatch.setattr(passes, "build_id_map", lambda kept, head, budget, progress:
                            remap.build_id_map(kept, head, 1 << 30, progress))
    files, table = _ingest_inputs(tmp_path, integer)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(SPEC.format(id_type="integer" if integer else "string",
                                     directed=str(directed).lower(), duplicates=duplicates,
                                     missing=missing, weight=", weight: w" if weighted else "",
                                     time=", timestamp: t" if timed else ""))
    reports, graphs = [], []
    for name, memory_gb in (("memory", None), ("external", 2e-6)):  # ~2 KiB: buckets split
        spec = load_spec(spec_file, [f"graph.memory_gb={memory_gb}"] if memory_gb else None)
        reports.append(ingest(spec, files, tmp_path / name, nodes=[table]))
        graphs.append(load_graph(tmp_path / name))
    assert [r["csr_build"]["method"] for r in reports] == ["in memory", "out of core"]
    for r in reports:
        for key in ("phases", "wall_seconds", "csr_build", "peak_rss_gb"):
            r.pop(key)
    assert reports[0] == reports[1]
    a, b = graphs
    for key in ("indptr", "indices", "weights", "features", "labels"):
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None) == (y is None), key
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=key)
    for split in a.splits:
        np.testing.assert_array_equal(a.splits[split], b.splits[split])
    for split in ("valid", "test"):  # by time where timed: the newest edges held out
        np.testing.assert_array_equal(a.edge_splits[split], b.edge_splits[split])
    assert not list(tmp_path.glob(".external-scratch-*"))  # the scratch folder is gone
    np.testing.assert_array_equal(pq_ids(tmp_path / "memory"), pq_ids(tmp_path / "external"))


def pq_ids(out):
    import pyarrow.parquet as pq

    return pq.read_table(out / "nodes" / "ids.parquet").column(0).to_numpy(zero_copy_only=False)


# --- the generator's out-of-core path ----------------------------------------------------------

def test_datagen_out_of_core_writes_the_same_graph(tmp_path, monkeypatch):
    import json

    from embedtrain.datagen import GraphDataSpec, generate_graph
    from embedtrain.datagen import graph as datagen_graph
    from embedtrain.graph.store import FeatureDtype, load_graph

    monkeypatch.setattr(datagen_graph, "_EDGE_CHUNK", 4000)  # 15,000 edges: four chunks
    spec = GraphDataSpec(nodes=3000, seed=2, link_fraction=0.1, feature_dtype=FeatureDtype.FLOAT16)
    generate_graph(spec, tmp_path / "memory", progress=False)
    drawn = []
    chunks = datagen_graph.PlantedGraph.edge_chunks
    monkeypatch.setattr(datagen_graph.PlantedGraph, "edge_chunks",
                        lambda self, s: (drawn.append(1) or c for c in chunks(self, s)))
    generate_graph(spec, tmp_path / "external", progress=False, memory_gb=1e-5)
    assert len(drawn) == 4  # the out-of-core path drew the chunks one by one
    a, b = load_graph(tmp_path / "memory"), load_graph(tmp_path / "external")
    for key in ("indptr", "indices", "features", "labels"):
        np.testing.assert_array_equal(np.asarray(getattr(a, key)), np.asarray(getattr(b, key)))
    assert a.features.dtype == np.float16
    for split in ("train", "valid", "test"):
        np.testing.assert_array_equal(a.splits[split], b.splits[split])
    np.testing.assert_array_equal(a.edge_splits["test"], b.edge_splits["test"])
    meta = [json.loads((tmp_path / d / "metadata.json").read_text()) for d in ("memory", "external")]
    assert meta[0] == meta[1]
    assert not list(tmp_path.glob(".external-scratch-*"))


def test_datagen_cli_edges_and_memory_gb(tmp_path, capsys):
    import json

    from embedtrain.cli import main

    assert main(["datagen", "graph", "--nodes", "2000", "--edges", "7000", "--memory-gb", "0.0001",
                 "--feature-dim", "4", "--out", str(tmp_path / "cli")]) == 0
    assert main(["datagen", "graph", "--nodes", "2000", "--avg-degree", "7", "--feature-dim", "4",
                 "--out", str(tmp_path / "api")]) == 0
    meta = [json.loads((tmp_path / d / "metadata.json").read_text()) for d in ("cli", "api")]
    assert meta[0]["generator"]["edges_drawn"] == 7000
    assert meta[0] == meta[1]  # --edges E is --avg-degree 2E/N; out of core, the same graph
    for f in ("graph/indices.npy", "graph/indptr.npy", "nodes/features.npy"):
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "api" / f).read_bytes()
    assert main(["datagen", "graph", "--nodes", "20", "--edges", "0", "--out",
                 str(tmp_path / "bad")]) == 2
    assert "--edges must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("direct", [False, True])
def test_integer_id_map_numbers_by_first_appearance(direct):
    from pipelines.graph.remap import IntegerIdMap

    rng = np.random.default_rng(3)
    head = rng.choice(np.arange(-50, 1000), 40, replace=False)  # the node table's ids
    batches = [rng.integers(-60, 1000, (2, k)) for k in (1, 30, 0, 200, 7)]
    order = {int(x): i for i, x in enumerate(head)}  # the slow reference
    for src, dst in batches:
        for x in np.stack([src, dst], 1).ravel():
            order.setdefault(int(x), len(order))
    ids = IntegerIdMap(head, (-60, 999) if direct else None)
    for src, dst in batches:
        ids.add_first_seen(src, dst)
    assert ids.size == len(order)
    np.testing.assert_array_equal(ids.ids(), sorted(order, key=order.get))
    absent = next(x for x in range(-60, 1000) if x not in order)
    probe = np.array([5000, -61, *order, absent, 2**40])  # outside the range, or not an id
    dense, found = ids.find(probe)
    assert found.tolist() == [False, False, *[True] * len(order), False, False]
    assert dense[found].tolist() == [order[k] for k in order]
    ids.truncate(len(head))
    dense, found = ids.find(probe)
    assert dense[found].tolist() == list(range(len(head)))
    np.testing.assert_array_equal(ids.ids(), head)
