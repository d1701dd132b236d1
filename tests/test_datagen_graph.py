"""The graph store (CSR building, writing, loading) and the synthetic graph generator.

Small sizes only: CSR policies are checked against a per-edge Python reference on tiny random
graphs; the generator runs on 6,000 nodes (a fraction of a second).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from embedtrain.datagen.graph import (
    GraphDataSpec, NodeFeatures, PlantedGraph, generate_graph, homophily)
from embedtrain.datagen.graph_words import TopicWords
from embedtrain.graph.csr import csr_from_edges, hold_out_edges, row_blocks
from embedtrain.graph.store import load_graph, write_graph
from embedtrain.features import DatasetError

SPEC = GraphDataSpec(nodes=6_000, avg_degree=10, seed=3)


def reference_csr(src, dst, n, weights, undirected, self_loops, duplicates):
    """Edge by edge: what csr_from_edges must produce."""
    seen: dict[tuple[int, int], int] = {}
    stored: list[list] = []  # [u, v, weight]
    loops = dups = 0
    for i, (u, v) in enumerate(zip(src.tolist(), dst.tolist())):
        w = 1.0 if weights is None else float(weights[i])
        if u == v:
            loops += 1
            if self_loops == "drop":
                continue
        key = (min(u, v), max(u, v)) if undirected else (u, v)
        if key in seen:
            dups += 1
            if duplicates == "drop":
                continue
            if duplicates == "sum":
                stored[seen[key]][2] += w
                continue
        else:
            seen[key] = len(stored)
        stored.append([u, v, w])
    rows: list[list] = [[] for _ in range(n)]
    for u, v, w in stored:
        if undirected:
            rows[u].append((v, w))
            if u != v:
                rows[v].append((u, w))
        else:
            rows[v].append((u, w))  # row v: the sources of edges into v
    indptr = np.cumsum([0] + [len(r) for r in rows])
    entries = [e for r in rows for e in sorted(r, key=lambda e: e[0])]  # stable: input order
    indices = np.array([e[0] for e in entries], dtype=np.int64)
    w_out = np.array([e[1] for e in entries], dtype=np.float32)
    return indptr, indices, w_out, loops, dups, len(stored)


@pytest.mark.parametrize("undirected, self_loops, duplicates, weighted", list(itertools.product(
    [True, False], ["drop", "keep"], ["drop", "keep", "sum"], [False, True])))
def test_csr_from_edges_matches_reference(undirected, self_loops, duplicates, weighted):
    rng = np.random.default_rng(hash((undirected, self_loops, duplicates, weighted)) % 2**32)
    for trial in range(5):
        n = int(rng.integers(1, 9))
        e = int(rng.integers(0, 40))
        src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
        weights = rng.integers(1, 5, e).astype(np.float64) if weighted else None
        indptr, indices, w, counts = csr_from_edges(src, dst, n, weights, undirected,
                                                    self_loops, duplicates)
        r_ptr, r_idx, r_w, loops, dups, stored = reference_csr(
            src, dst, n, weights, undirected, self_loops, duplicates)
        assert indptr.tolist() == r_ptr.tolist()
        assert indices.tolist() == r_idx.tolist()
        assert indices.dtype == np.int32 and indptr.dtype == np.int64
        if weighted or duplicates == "sum":
            np.testing.assert_array_equal(w, r_w)  # sum without weights: multiplicities
        else:
            assert w is None
        assert counts.self_loops == loops and counts.duplicates == dups
        assert counts.self_loops_dropped == (loops if self_loops == "drop" else 0)
        assert counts.duplicates_dropped == (dups if duplicates == "drop" else 0)
        assert counts.duplicates_merged == (dups if duplicates == "sum" else 0)
        assert counts.edges == stored and counts.csr_entries == len(indices)
        assert counts.input_edges == (counts.edges + counts.self_loops_dropped
                                      + counts.duplicates_dropped + counts.duplicates_merged)


def test_csr_from_edges_rejects_bad_ids():
    with pytest.raises(ValueError, match=r"dst: ids must be in \[0, 3\), got 3"):
        csr_from_edges(np.array([0, 1]), np.array([1, 3]), 3)
    with pytest.raises(ValueError, match="src: ids must be in"):
        csr_from_edges(np.array([-1]), np.array([0]), 3)
    with pytest.raises(ValueError, match="one length"):
        csr_from_edges(np.array([0, 1]), np.array([1]), 3)
    with pytest.raises(ValueError, match="not a valid Duplicates"):
        csr_from_edges(np.array([0]), np.array([1]), 3, duplicates="merge")


def test_row_blocks_cover_the_nodes_in_bounded_pieces():
    rng = np.random.default_rng(0)
    degrees = rng.integers(0, 6, 50)
    degrees[7] = 40  # one node larger than a block
    indptr = np.concatenate([[0], np.cumsum(degrees)])
    blocks = row_blocks(indptr, max_entries=10)
    assert blocks[0][0] == 0 and blocks[-1][1] == 50
    assert all(a[1] == b[0] for a, b in zip(blocks[:-1], blocks[1:]))
    for lo, hi in blocks:
        assert hi > lo and (indptr[hi] - indptr[lo] <= 10 or hi - lo == 1)


def test_hold_out_edges_removes_both_directions_and_all_copies():
    src, dst = np.array([0, 1, 1, 2, 3, 0]), np.array([1, 0, 2, 3, 0, 0])
    indptr, indices, w, _ = csr_from_edges(src, dst, 4, np.arange(1.0, 7.0),
                                           self_loops="keep", duplicates="keep")
    new_ptr, new_idx, new_w, held = hold_out_edges(indptr, indices, w, False, 0.25, 0.25, seed=1)
    kept = {(int(u), int(v)) for u in range(4) for v in new_idx[new_ptr[u]:new_ptr[u + 1]]}
    out = {tuple(e) for k in ("valid", "test") for e in held[k].T.tolist()}
    assert len(held["valid"][0]) == len(held["test"][0]) == 1
    for u, v in out:
        assert u < v and (u, v) not in kept and (v, u) not in kept
    assert (0, 0) in kept  # self-loops are never held out
    assert len(new_idx) == len(new_w) == len(indices) - sum(2 * (1 + ((u, v) == (0, 1)))
                                                            for u, v in out)


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("graph")
    return out, generate_graph(SPEC, out, progress=False)


def test_metadata_follows_the_format(graph):
    out, meta = graph
    assert json.loads((out / "metadata.json").read_text()) == meta
    assert meta["format_version"] == 1 and meta["task"] == "graph" and meta["directed"] is False
    assert meta["csr"] == {"indptr": "graph/indptr.npy", "indices": "graph/indices.npy",
                           "weights": None}
    assert meta["splits"] == {s: f"splits/{s}_nodes.npy" for s in ("train", "valid", "test")}
    assert meta["num_classes"] == 16 and meta["num_features"] == 32
    g = load_graph(out)
    assert isinstance(g.indices, np.memmap) and g.indices.dtype == np.int32
    assert g.num_edges == meta["num_edges"] == meta["generator"]["edge_counts"]["csr_entries"]
    assert g.features.dtype == np.float32 and g.features.shape == (6_000, 32)
    rows = np.repeat(np.arange(g.num_nodes), g.degrees())
    assert np.all(np.diff(rows * g.num_nodes + g.indices) > 0)  # sorted rows, no duplicates
    assert not np.any(rows == g.indices)
    pairs = set(zip(rows.tolist(), g.indices.tolist()))
    assert all((v, u) in pairs for u, v in list(pairs)[:2000])  # symmetric


def test_generator_is_deterministic(graph, tmp_path):
    out, _ = graph
    generate_graph(SPEC, tmp_path / "again", progress=False)
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "again")
                           for p in (tmp_path / "again").rglob("*") if p.is_file())
    for f in files:
        assert (out / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f
    other = generate_graph(GraphDataSpec(nodes=6_000, avg_degree=10, seed=4), tmp_path / "other",
                           progress=False)
    assert other["num_edges"] != json.loads((out / "metadata.json").read_text())["num_edges"]


def test_homophily_and_heavy_tailed_degrees(graph):
    out, meta = graph
    gen = meta["generator"]
    g = load_graph(out)
    h = homophily(g.indptr, g.indices, g.labels)
    assert h == pytest.approx(gen["homophily"], abs=1e-4)
    assert abs(h - (1 - SPEC.mixing)) < 0.03
    deg = g.degrees()
    assert deg.max() > 10 * deg.mean() and gen["degree"]["max"] == deg.max()
    assert 2.0 < gen["degree"]["hill_exponent"] < 4.0  # the cut-off bends small graphs
    assert deg.mean() == pytest.approx(SPEC.avg_degree, rel=0.1)  # less the dropped edges
    counts = gen["edge_counts"]
    assert counts["input_edges"] == gen["edges_drawn"] == SPEC.nodes * SPEC.avg_degree // 2
    assert counts["edges"] + counts["self_loops_dropped"] + counts["duplicates_dropped"] == (
        counts["input_edges"])


def test_features_are_weakly_informative(graph):
    """A nearest-class-mean classifier fitted on train features scores near the recorded Bayes
    figure, clearly below what the one-hop neighbourhood allows."""
    out, meta = graph
    gen = meta["generator"]
    g = load_graph(out)
    x, y = np.asarray(g.features), np.asarray(g.labels)
    train, test = g.splits["train"], g.splits["test"]
    means = np.stack([x[train][y[train] == k].mean(axis=0) for k in range(16)])
    dist = ((x[test][:, None, :] - means[None]) ** 2).sum(axis=-1)
    ncm = float(np.mean(np.argmin(dist, axis=1) == y[test]))
    bayes = gen["feature_bayes_accuracy"]["test"]
    assert 0.45 < bayes < 0.7 and ncm < 0.75
    assert bayes - 0.07 < ncm < bayes + 0.04
    assert gen["one_hop_bayes_accuracy"]["test"] > 0.8


def test_splits_are_disjoint_and_cover_the_nodes(graph):
    g = load_graph(graph[0])
    parts = [np.asarray(g.splits[s]) for s in ("train", "valid", "test")]
    assert [len(p) for p in parts] == [4_800, 600, 600]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(6_000))


def test_link_fraction_holds_out_edges_absent_from_the_csr(tmp_path):
    meta = generate_graph(GraphDataSpec(nodes=3_000, avg_degree=6, link_fraction=0.2, seed=1),
                          tmp_path, progress=False)
    g = load_graph(tmp_path)
    rows = np.repeat(np.arange(g.num_nodes), g.degrees())
    present = set((rows * g.num_nodes + g.indices).tolist())
    stored = meta["generator"]["edge_counts"]["edges"]
    for split in ("valid", "test"):
        u, v = g.edge_splits[split]
        assert len(u) == round(0.1 * stored) and np.all(u < v)
        assert not present & set((u * g.num_nodes + v).tolist())
        assert not present & set((v * g.num_nodes + u).tolist())
    assert g.num_edges == 2 * (stored - round(0.1 * stored) * 2)


@pytest.mark.parametrize("link_fraction, phases", [(0.0, 4), (0.1, 5)])
def test_progress_goes_to_stderr(tmp_path, capsys, link_fraction, phases):
    spec = GraphDataSpec(nodes=500, avg_degree=4, link_fraction=link_fraction)
    generate_graph(spec, tmp_path / "on", progress=True)
    captured = capsys.readouterr()
    final = captured.err.rstrip("\n").split("\r")[-1]  # tqdm's last redraw: the finished bar
    assert captured.out == "" and final.startswith(f"datagen graph: {phases}/{phases} phases [")
    assert final.endswith(f"], wrote {tmp_path / 'on'}")
    generate_graph(spec, tmp_path / "off", progress=False)
    assert capsys.readouterr() == ("", "")


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match=r"GraphDataSpec\.degree_exponent must be above 2"):
        GraphDataSpec(degree_exponent=1.5)
    with pytest.raises(ValueError, match=r"GraphDataSpec\.mixing"):
        GraphDataSpec(mixing=1.5)


# --- bag-of-words node features ----------------------------------------------------------------

BOW = GraphDataSpec(nodes=3_000, avg_degree=4, communities=5, seed=2, features=NodeFeatures.BOW,
                    vocab=400, words_per_node=15, topic_share=0.2)


def test_bow_features_are_deterministic_word_sets_with_a_community_signal(tmp_path):
    """Every node holds exactly ``words_per_node`` distinct words (0/1 floats in the layout the
    GNN reader reads); the same seed gives the same bytes; a community's topic words are clearly
    more frequent inside it than outside; a naive Bayes classifier fitted on the train
    nodes' word counts scores near, and not above, the recorded feature-only Bayes accuracy."""
    meta = generate_graph(BOW, tmp_path / "a", progress=False)
    again = generate_graph(BOW, tmp_path / "b", progress=False)
    assert meta == again
    for rel in ("nodes/features.npy", "nodes/labels.npy", "graph/indices.npy"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    other = generate_graph(GraphDataSpec(**{**BOW.__dict__, "seed": 3}), tmp_path / "c",
                           progress=False)
    assert other["generator"]["feature_bayes_accuracy"] != meta["generator"][
        "feature_bayes_accuracy"]
    g = load_graph(tmp_path / "a")
    x, y = np.asarray(g.features), np.asarray(g.labels)
    assert meta["num_features"] == 400 and x.shape == (3_000, 400) and x.dtype == np.float32
    assert set(np.unique(x).tolist()) == {0.0, 1.0} and np.all(x.sum(axis=1) == 15)
    assert meta["generator"]["spec"]["features"] == "bow"
    topics = PlantedGraph(BOW).words.topics
    freq = np.stack([x[y == k].mean(axis=0) for k in range(5)])       # (K, V) word frequencies
    for k in range(5):
        inside = freq[k, topics[k]].mean()
        outside = np.delete(freq, k, axis=0)[:, topics[k]].mean()
        assert inside > 1.6 * outside, (k, inside, outside)
    train, test = g.splits["train"], g.splits["test"]
    counts = np.stack([x[train][y[train] == k].sum(axis=0) for k in range(5)]) + 1.0
    log_p = np.log(counts / counts.sum(axis=1, keepdims=True))
    fitted = float(np.mean(np.argmax(x[test] @ log_p.T, axis=1) == y[test]))
    bayes = meta["generator"]["feature_bayes_accuracy"]["test"]
    assert 0.4 < bayes < 0.95 and bayes - 0.12 < fitted < bayes + 0.04, (bayes, fitted)
    assert meta["generator"]["one_hop_bayes_accuracy"]["test"] > bayes


def test_bow_word_sets_follow_their_exact_likelihood():
    """The sampler draws each set of words with the probability the Bayes figures use: all 15
    two-word sets of a 6-word vocabulary, enumerated, sum to 1 and match 100k draws."""
    words = TopicWords(communities=2, vocab=6, words_per_node=2, topic_share=0.5, seed=[1])
    sets = np.zeros((15, 6))
    for i, pair in enumerate(itertools.combinations(range(6), 2)):
        sets[i, list(pair)] = 1.0
    p = np.exp(words.log_likelihoods(sets))
    assert np.allclose(p.sum(axis=0), 1.0)
    for k in range(2):
        x = words.sample(np.random.default_rng(k), np.full(100_000, k))
        drawn = (x @ (2 ** np.arange(6)))[:, None] == (sets @ (2 ** np.arange(6)))[None]
        assert np.all(drawn.sum(axis=1) == 1)
        assert np.abs(drawn.mean(axis=0) - p[:, k]).max() < 0.005


def test_bow_cli_flags(tmp_path, capsys):
    from embedtrain.cli import main

    out = tmp_path / "g"
    argv = ["datagen", "graph", "--nodes", "300", "--avg-degree", "4", "--communities", "3",
            "--out", str(out)]
    assert main(argv + ["--features", "bow", "--vocab", "50", "--words-per-node", "5",
                        "--topic-share", "0.3"]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    spec = meta["generator"]["spec"]
    assert meta["num_features"] == 50 and (spec["words_per_node"], spec["topic_share"]) == (5, .3)
    capsys.readouterr()
    for bad, says in [(["--features", "bag"], "--features: expected one of gaussian, bow"),
                      (["--vocab", "50"], "--vocab: only with --features bow"),
                      (["--features", "bow", "--feature-dim", "8"], "--feature-dim: not with"),
                      (["--features", "bow", "--words-per-node", "0"],
                       "--words-per-node must be an integer in [1, min(vocab, 512)]")]:
        assert main(argv + bad) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "Spec." not in err[0], err


# --- write_graph / load_graph ------------------------------------------------------------------

def small_graph(tmp_path: Path) -> Path:
    indptr, indices, weights, _ = csr_from_edges(np.array([0, 1, 2]), np.array([1, 2, 3]), 4,
                                                 np.array([1.0, 2.0, 3.0]))
    write_graph(tmp_path / "g", indptr, indices, weights,
                features=np.arange(8, dtype=np.float32).reshape(4, 2),
                labels=np.array([0, 1, -1, 1]), num_classes=2,
                splits={"train": np.array([0, 1]), "valid": np.array([3]),
                        "test": np.array([], dtype=np.int64)},
                edge_splits={"valid": np.array([[0], [3]]), "test": np.array([[1], [3]])},
                name="small", extra_meta={"note": 1})
    return tmp_path / "g"


def test_write_load_round_trip(tmp_path):
    root = small_graph(tmp_path)
    for mmap in (True, False):
        g = load_graph(root, mmap=mmap)
        assert isinstance(g.indices, np.memmap) == mmap
        assert g.indptr.tolist() == [0, 1, 3, 5, 6] and g.indices.tolist() == [1, 0, 2, 1, 3, 2]
        assert g.weights.tolist() == [1, 1, 2, 2, 3, 3] and g.weights.dtype == np.float32
        assert g.labels.tolist() == [0, 1, -1, 1] and g.num_classes == 2
        assert g.features.shape == (4, 2) and g.splits["valid"].tolist() == [3]
        assert g.edge_splits["test"].tolist() == [[1], [3]]
        assert g.name == "small" and g.meta["note"] == 1 and not g.directed
    write_graph(root, np.array([0, 0]), np.array([], dtype=np.int32))  # replaces it
    assert load_graph(root).num_nodes == 1 and not (root / "nodes" / "labels.npy").exists()


def test_write_graph_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        write_graph(tmp_path, np.array([0, 0]), np.array([], dtype=np.int32))


def _corrupt(root: Path, rel: str, array: np.ndarray) -> None:
    np.save(root / rel, array)


@pytest.mark.parametrize("rel, array, words", [
    ("graph/indptr.npy", np.array([0, 3, 2, 5, 6]), "indptr.npy: decreases at node 1"),
    ("graph/indptr.npy", np.array([0, 1, 3, 5]), "indptr.npy: has 4 entries, expected num_nodes"),
    ("graph/indptr.npy", np.array([0, 1, 3, 5, 7]), "indptr.npy: ends at 7 but"),
    ("graph/indices.npy", np.array([1, 0, 2, 1, 4, 2], dtype=np.int32),
     "indices.npy: node id 4 at position 4 outside [0, 4)"),
    ("graph/weights.npy", np.ones(5, dtype=np.float32), "weights.npy: has 5 rows"),
    ("nodes/labels.npy", np.array([0, 1, 2, 1]), "labels.npy: label 2 at position 2 outside"),
    ("nodes/features.npy", np.ones((3, 2), dtype=np.float32), "features.npy: has 3 rows"),
    ("splits/train_nodes.npy", np.array([0, 9]), "train_nodes.npy: node id 9"),
    ("splits/valid_edges.npy", np.array([0, 3]), "valid_edges.npy: expected 2-D"),
    ("graph/indices.npy", np.array([1.0, 0.0]), "indices.npy: expected integers"),
])
def test_load_graph_errors_name_the_file(tmp_path, rel, array, words):
    root = small_graph(tmp_path)
    _corrupt(root, rel, array)
    with pytest.raises(DatasetError, match="^" + str(root).replace("\\", "\\\\")) as err:
        load_graph(root)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_neighbour_ids_are_checked_even_without_the_o_e_checks(tmp_path, monkeypatch):
    # training loads with check_ranges=False; a neighbour outside the graph is still named at
    # load, by file reads (through the mapping, its pages would count in the RSS)
    import embedtrain.graph.csr as csr

    root = small_graph(tmp_path)
    _corrupt(root, "graph/indices.npy", np.array([1, 0, 2, 1, 4, 2], dtype=np.int32))
    with pytest.raises(DatasetError, match=r"indices\.npy: node id 4 at position 4 outside"):
        load_graph(root, check_ranges=False)
    _corrupt(root, "graph/indices.npy", np.array([1, 0, 2, 1, 3, 2], dtype=np.int32))
    monkeypatch.setattr(csr, "CHUNK", 4)  # several reads, the last one short
    read = []
    monkeypatch.setattr(np, "fromfile", lambda f, dtype, count: read.append(count) or
                        np.frombuffer(f.read(count * np.dtype(dtype).itemsize), dtype=dtype))
    assert load_graph(root, check_ranges=False).indices.tolist() == [1, 0, 2, 1, 3, 2]
    assert read[:2] == [4, 2]  # the neighbour ids first (labels and splits follow)


def test_load_graph_missing_files(tmp_path):
    root = small_graph(tmp_path)
    (root / "graph" / "indices.npy").unlink()
    with pytest.raises(DatasetError, match=r"indices\.npy: missing \(metadata\.json csr\."):
        load_graph(root)
    (root / "graph" / "indices.npy").write_bytes(b"not numpy")
    with pytest.raises(DatasetError, match=r"indices\.npy: not a readable \.npy file"):
        load_graph(root)
    with pytest.raises(DatasetError, match="graph metadata not found"):
        load_graph(tmp_path / "nowhere")
