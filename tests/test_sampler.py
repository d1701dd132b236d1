"""The neighbour sampler: fanouts, real edges only, marginal distributions (uniform and weighted),
seeding, memory-mapped CSR, blocks feeding PyG's SAGEConv exactly, seed batches across ranks, and
link-prediction negatives."""

from __future__ import annotations

import math
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

from embedtrain.graph import (
    GraphData,
    LinkSampler,
    NegativeSampling,
    NeighborSampler,
    SeedBatches,
    link_loader,
)
from embedtrain.models.gnn import GraphSAGE


# ------------------------------------------------------------------------------------- helpers
def random_csr(num_nodes: int, avg_degree: float, seed: int = 0, hubs: int = 3,
               weights: bool = False):
    """A small CSR with sorted, duplicate-free rows, no self-loops, a few hub rows and some empty
    rows (power-law-ish row lengths)."""
    rng = np.random.default_rng(seed)
    deg = np.minimum(rng.pareto(1.5, num_nodes) * avg_degree / 2, num_nodes - 1).astype(np.int64)
    deg[rng.choice(num_nodes, hubs, replace=False)] = num_nodes // 2
    row = np.repeat(np.arange(num_nodes), deg)
    key = np.unique(row * num_nodes + rng.integers(0, num_nodes, len(row)))
    row, col = key // num_nodes, key % num_nodes
    keep = row != col
    row, col = row[keep], col[keep]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=num_nodes))])
    out = (indptr, col.astype(np.int32))
    if weights:
        out += (rng.random(len(col)).astype(np.float32) + 0.05,)
    return out


def csr_from_rows(rows: list[list[int]], weights: list[list[float]] | None = None):
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    indices = np.array([v for r in rows for v in r], dtype=np.int64)
    if weights is None:
        return indptr, indices
    return indptr, indices, np.array([w for r in weights for w in r], dtype=np.float32)


def chi2_upper(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def hop_edges(blocks, h: int) -> np.ndarray:
    """The edges sampled at hop ``h`` (1-based) in global ids: [2, e] (source, target)."""
    first = blocks.num_edges_per_hop[h - 2] if h > 1 else 0
    e = blocks.edge_index[h - 1][:, first:].numpy()
    return blocks.n_id.numpy()[e]


def neighbour_sets(indptr, indices) -> list[set]:
    return [set(indices[indptr[u]:indptr[u + 1]].tolist()) for u in range(len(indptr) - 1)]


# ------------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("weighted", [False, True])
def test_fanouts_respected_and_only_real_edges(weighted):
    indptr, indices, *w = random_csr(800, 8, seed=1, weights=weighted)
    nbrs = neighbour_sets(indptr, indices)
    deg = np.diff(indptr)
    fanouts = [5, 3, -1]
    sampler = NeighborSampler(indptr, indices, fanouts, weights=w[0] if w else None)
    seeds = np.random.default_rng(0).choice(800, 64, replace=False)
    b = sampler.sample(seeds, step=0)
    n, n_id = b.num_nodes_per_hop, b.n_id.numpy()
    assert b.n_id.dtype == torch.int64 and n_id[:64].tolist() == seeds.tolist()
    assert len(set(n_id.tolist())) == len(n_id) == n[-1]  # each node once
    assert b.num_hops == 3 and len(n) == 4 and b.num_seeds == 64
    for h, fanout in enumerate(fanouts, start=1):
        ei = b.edge_index[h - 1]
        assert ei.dtype == torch.int64 and ei.shape == (2, b.num_edges_per_hop[h - 1])
        assert int(ei[0].max()) < n[h] and int(ei[1].max()) < n[h - 1]
        if h > 1:  # cumulative views: hop h starts with hop h - 1
            assert torch.equal(ei[:, :b.num_edges_per_hop[h - 2]], b.edge_index[h - 2])
        src, dst = hop_edges(b, h)
        frontier = n_id[n[h - 2]:n[h - 1]] if h > 1 else seeds
        assert set(dst.tolist()) <= set(frontier.tolist())
        for u in frontier:
            got = src[dst == u].tolist()
            want = deg[u] if fanout < 0 else min(deg[u], fanout)
            assert len(got) == want and len(set(got)) == want  # min(deg, fanout), distinct
            assert set(got) <= nbrs[u]  # never a non-neighbour
        # the nodes new at hop h are exactly the sampled neighbours not seen before
        seen = set(n_id[:n[h - 1]].tolist())
        assert set(n_id[n[h - 1]:n[h]].tolist()) == set(src.tolist()) - seen


def test_replace_draws_exactly_fanout_and_duplicate_seeds():
    indptr, indices = csr_from_rows([[1, 2], [0], [], [0, 1, 2]])
    b = NeighborSampler(indptr, indices, [4], replace=True).sample(np.array([0, 3, 2, 0]), step=1)
    src, dst = hop_edges(b, 1)
    assert b.n_id[:4].tolist() == [0, 3, 2, 0]
    counts = np.bincount(b.edge_index[0][1].numpy(), minlength=4)
    assert counts.tolist() == [4, 4, 0, 4]  # every target with neighbours gets exactly 4 draws
    assert all(v in {1, 2} for v in src[dst == 0]) and all(v in {0, 1, 2} for v in src[dst == 3])


def test_bad_input_is_rejected():
    indptr, indices = csr_from_rows([[1], [0]])
    with pytest.raises(ValueError, match="fanouts"):
        NeighborSampler(indptr, indices, [0])
    with pytest.raises(ValueError, match="indptr"):
        NeighborSampler(indptr, indices[:1], [1])
    with pytest.raises(ValueError, match=r"seed ids must be in \[0, 2\)"):
        NeighborSampler(indptr, indices, [1]).sample(np.array([2]))


# ------------------------------------------------------------------------------- distributions
@pytest.mark.parametrize("degree,fanout", [(20, 5), (6, 5), (40, 15)])
def test_uniform_marginals(degree, fanout):
    """Each neighbour is kept with probability fanout / degree (one call, the node repeated as
    many independent targets)."""
    rows = [list(range(1, degree + 1))] + [[0]] * degree
    indptr, indices = csr_from_rows(rows)
    draws = 6000
    b = NeighborSampler(indptr, indices, [fanout]).sample(np.zeros(draws, np.int64), step=3)
    src, _ = hop_edges(b, 1)
    counts = np.bincount(src, minlength=degree + 1)[1:]
    p = fanout / degree
    # Indicator covariance of a uniform f-subset: p(1-p) d/(d-1) (I - J/d): scaled Pearson ~ chi2
    stat = ((counts - draws * p) ** 2).sum() / (draws * p * (1 - p)) * (degree - 1) / degree
    assert stat < chi2_upper(degree - 1), (stat, counts)
    assert counts.sum() == draws * fanout


def test_uniform_subsets_are_uniform():
    """Not only marginals: all C(5, 2) pairs are equally likely."""
    indptr, indices = csr_from_rows([[1, 2, 3, 4, 5]] + [[0]] * 5)
    draws = 5000
    b = NeighborSampler(indptr, indices, [2]).sample(np.zeros(draws, np.int64), step=0)
    src, dst = b.edge_index[0].numpy()
    pairs = np.sort(b.n_id.numpy()[src].reshape(-1, 1)[np.argsort(dst, kind="stable")]
                    .reshape(draws, 2), axis=1)
    index = {pair: i for i, pair in enumerate(combinations(range(1, 6), 2))}
    counts = np.bincount([index[tuple(p)] for p in pairs.tolist()], minlength=10)
    stat = ((counts - draws / 10) ** 2 / (draws / 10)).sum()
    assert stat < chi2_upper(9), counts


def successive_inclusion(w: np.ndarray, fanout: int) -> np.ndarray:
    """Exact inclusion probabilities of weighted sampling without replacement (successive
    draws proportional to the remaining weights), by enumerating ordered draws."""
    out = np.zeros(len(w))

    def walk(taken: tuple, prob: float) -> None:
        if len(taken) == fanout:
            out[list(taken)] += prob
            return
        rest = w.sum() - w[list(taken)].sum()
        for i in range(len(w)):
            if i not in taken:
                walk(taken + (i,), prob * w[i] / rest)

    walk((), 1.0)
    return out


@pytest.mark.parametrize("degree,fanout", [(3, 1), (8, 1), (6, 2), (12, 2)])
def test_weighted_inclusion_matches_exact(degree, fanout):
    """Short rows take the exact path (Efraimidis-Spirakis), rows longer than 4 x fanout the
    rejection path; both must match the exact successive-sampling probabilities
    (for fanout 1: w_i / sum w)."""
    w = np.linspace(1.0, 4.0, degree) ** 2
    rows = [list(range(1, degree + 1))] + [[0]] * degree
    indptr, indices, weights = csr_from_rows(rows, [w.tolist()] + [[1.0]] * degree)
    draws = 8000
    b = NeighborSampler(indptr, indices, [fanout], weights=weights).sample(
        np.zeros(draws, np.int64), step=5)
    src, _ = hop_edges(b, 1)
    counts = np.bincount(src, minlength=degree + 1)[1:]
    assert counts.sum() == draws * fanout
    exact = successive_inclusion(w.astype(np.float32).astype(np.float64), fanout)
    if fanout == 1:
        np.testing.assert_allclose(exact, w / w.sum(), rtol=1e-6)
    # independent binomial tests per neighbour, each at |z| < 4
    z = (counts - draws * exact) / np.sqrt(draws * exact * (1 - exact))
    assert np.abs(z).max() < 4, (z, counts, exact * draws)
    assert (np.diff(counts[::max(1, degree // 3)]) > 0).all()  # ordered by weight


def test_weighted_with_replacement_and_fallback():
    """A very skewed long row makes rejection fail, so the exact path takes over."""
    w = np.array([1000.0] + [0.001] * 39)
    rows = [list(range(1, 41))] + [[0]] * 40
    indptr, indices, weights = csr_from_rows(rows, [w.tolist()] + [[1.0]] * 40)
    b = NeighborSampler(indptr, indices, [2], weights=weights).sample(np.zeros(500, np.int64), 0)
    src, _ = hop_edges(b, 1)
    assert np.bincount(src, minlength=41)[1] == 500  # the heavy edge is always in
    b = NeighborSampler(indptr, indices, [3], weights=weights, replace=True).sample(
        np.zeros(500, np.int64), 0)
    src, _ = hop_edges(b, 1)
    assert len(src) == 1500 and (src == 1).mean() > 0.99


# ------------------------------------------------------------------ seeding, memory-mapped CSR
def test_reproducible_by_step_and_generator():
    indptr, indices = random_csr(500, 10, seed=2)
    sampler = NeighborSampler(indptr, indices, [6, 4], seed=7)
    seeds = np.arange(0, 500, 9)
    a, b = sampler.sample(seeds, step=3), sampler.sample(seeds, step=3)
    c = sampler.sample(seeds, step=4)
    assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index[-1], b.edge_index[-1])
    assert not torch.equal(a.edge_index[-1], c.edge_index[-1])
    other = NeighborSampler(indptr, indices, [6, 4], seed=8).sample(seeds, step=3)
    assert not torch.equal(a.edge_index[-1], other.edge_index[-1])
    g1 = sampler.sample(torch.from_numpy(seeds), rng=np.random.default_rng(1))
    g2 = sampler.sample(seeds, rng=np.random.default_rng(1))
    assert torch.equal(g1.edge_index[-1], g2.edge_index[-1])


def test_memory_mapped_csr_gives_the_same_blocks(tmp_path):
    indptr, indices, weights = random_csr(600, 10, seed=3, weights=True)
    for name, array in [("indptr", indptr), ("indices", indices), ("weights", weights)]:
        np.save(tmp_path / f"{name}.npy", array)
    mapped = [np.load(tmp_path / f"{n}.npy", mmap_mode="r") for n in ("indptr", "indices",
                                                                        "weights")]
    assert isinstance(mapped[1], np.memmap)
    seeds = np.arange(0, 600, 7)
    for w_mem, w_map in [(None, None), (weights, mapped[2])]:
        ram = NeighborSampler(indptr, indices, [5, 5], weights=w_mem).sample(seeds, step=1)
        mm = NeighborSampler(mapped[0], mapped[1], [5, 5], weights=w_map).sample(seeds, step=1)
        assert torch.equal(ram.n_id, mm.n_id) and torch.equal(ram.edge_index[1], mm.edge_index[1])


# --------------------------------------------------------------------------- blocks and layers
def _sage(hidden=(16, 4)):
    """GraphSAGE on 8 node features alone (no node-id table), SAGEConv layers of ``hidden``."""
    torch.manual_seed(0)
    return GraphSAGE(num_nodes=0, num_features=8, embedding_dim=0, hidden=list(hidden), out_dim=3)


def _full_graph(model, x, edge_index):
    """The model's layers run over one edge list at every layer (no sampling, no trimming)."""
    h = model.convs[1](torch.relu(model.convs[0](x, edge_index)), edge_index)
    return model.out(h)


def test_blocks_with_all_neighbours_equal_full_graph_sage():
    """fanout -1: GraphSAGE over the blocks gives the full-graph outputs at the seeds."""
    indptr, indices = random_csr(300, 6, seed=4, hubs=1)
    model = _sage().eval()
    x = torch.randn(300, 8)
    row = torch.from_numpy(np.repeat(np.arange(300), np.diff(indptr)))
    full_edges = torch.stack([torch.from_numpy(indices.astype(np.int64)), row])  # source->row
    full = _full_graph(model, x, full_edges)
    seeds = np.array([5, 17, 0, 250, 99])
    blocks = NeighborSampler(indptr, indices, [-1, -1]).sample(seeds, step=0)
    out = model(blocks, features=x[blocks.n_id])
    assert out.shape == (5, 3)
    torch.testing.assert_close(out, full[torch.from_numpy(seeds)], rtol=1e-5, atol=1e-5)


def test_sampled_blocks_equal_sage_on_the_sampled_graph():
    """With fanouts, the layered forward equals a plain full-graph SAGEConv over the sampled
    edges (each node's sample reused by every layer), at the seeds."""
    indptr, indices = random_csr(400, 12, seed=5)
    model = _sage().eval()
    x = torch.randn(400, 8)
    blocks = NeighborSampler(indptr, indices, [4, 3]).sample(np.arange(0, 400, 13), step=2)
    xs = x[blocks.n_id]
    plain = _full_graph(model, xs, blocks.edge_index[-1])[:blocks.num_seeds]
    torch.testing.assert_close(model(blocks, features=xs), plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"draws 2 hop.*has 3 layer\(s\) a hop: gnn.fanouts "
                                         r"and gnn.hidden must have the same length"):
        _sage((16, 16, 4))(blocks, features=xs)


# ------------------------------------------------------------------------------- seed batches
@pytest.mark.parametrize("num_ids,world_size,batch", [(103, 3, 8), (7, 4, 2), (64, 2, 16)])
def test_seed_batches_cover_every_id_once_across_ranks(num_ids, world_size, batch):
    ids = np.arange(1000, 1000 + num_ids)
    ranks = [SeedBatches(ids, batch, seed=1, rank=r, world_size=world_size)
             for r in range(world_size)]
    assert len({len(r) for r in ranks}) == 1  # equal batch counts
    epochs = [list(r.iter_epoch(2)) for r in ranks]
    got = np.concatenate([b for batches in epochs for b in batches])
    assert sorted(got.tolist()) == ids.tolist()  # every id exactly once, no padding
    # Step b of all ranks together is one slice of the epoch's permutation (the global batch).
    order = ids[np.random.default_rng([1, 2]).permutation(num_ids)]
    for b in range(len(ranks[0])):
        step = np.concatenate([batches[b] for batches in epochs])
        expect = order[b * batch * world_size:(b + 1) * batch * world_size]
        assert sorted(step.tolist()) == sorted(expect.tolist())
        assert ranks[0].step_rows(b) == (len(expect), 0)
    assert sum(ranks[0].step_rows(b)[0] for b in range(len(ranks[0]))) == num_ids
    e2, e3 = ranks[0].rank_ids(2), ranks[0].rank_ids(3)
    assert not np.array_equal(e2, e3)  # reshuffled per epoch


def test_seed_batches_workers_and_resume_give_the_same_batches():
    sampler = NeighborSampler(*random_csr(300, 8, seed=6), [4, 2])
    make = lambda w: SeedBatches(np.arange(300), 32, seed=3, rank=1, world_size=2,  # noqa: E731
                                 num_workers=w, collate=lambda s, g: sampler.sample(s, g))
    ref = [b.edge_index[-1] for b in make(0).iter_epoch(1)]
    threaded = [b.edge_index[-1] for b in make(2).iter_epoch(1)]
    resumed = [b.edge_index[-1] for b in make(2).iter_epoch(1, skip_batches=2)]
    assert len(ref) == len(make(0)) == 5
    assert all(torch.equal(a, b) for a, b in zip(ref, threaded))
    assert all(torch.equal(a, b) for a, b in zip(ref[2:], resumed)) and len(resumed) == 3
    early = make(2).iter_epoch(0)
    next(early)
    early.close()  # leaving early stops the threads
    unshuffled = SeedBatches(np.arange(10), 4, shuffle=False, drop_last=True)
    assert [b.tolist() for b in unshuffled.iter_epoch(0)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ------------------------------------------------------------------------------ link sampling
def test_link_sampler_shapes_and_negatives_are_not_neighbours():
    indptr, indices = random_csr(200, 6, seed=7, hubs=2)
    nbrs = neighbour_sets(indptr, indices)
    link = LinkSampler(indptr, indices, num_negatives=3)
    rng = np.random.default_rng(0)
    u = rng.integers(0, 200, 5000)
    v = rng.integers(0, 200, 5000)
    assert link.has_edge(u, v).tolist() == [int(b) in nbrs[a] for a, b in zip(u, v)]
    edge_ids = rng.choice(len(indices), 64, replace=False)
    pos = link.csr_edges(edge_ids)
    assert all(int(b) in nbrs[a] for a, b in pos.T)
    batch = link.sample(pos, rng)
    nodes = batch.node_ids.numpy()
    assert batch.pos_index.shape == (2, 64) and batch.neg_index.shape == (2, 192)
    assert (np.diff(nodes) > 0).all()
    assert np.array_equal(nodes[batch.pos_index.numpy()], pos)
    nu, nv = nodes[batch.neg_index.numpy()]
    assert np.array_equal(nu, np.repeat(pos[0], 3))
    assert not any(b == a or b in nbrs[a] for a, b in zip(nu.tolist(), nv.tolist()))


def test_negative_frequencies_uniform_and_by_degree():
    degrees = [1, 2, 4, 8, 16, 32, 64, 8]
    rows = [[v for v in range(70) if v != u][:d] for u, d in enumerate(degrees)]
    rows += [[]] * (70 - len(rows))
    indptr, indices = csr_from_rows(rows)
    pos = np.zeros((2, 20000), np.int64)
    deg = np.diff(indptr).astype(np.float64)
    for kind, expect in [(NegativeSampling.UNIFORM, np.full(70, 1 / 70)),
                         (NegativeSampling.DEGREE, deg ** 0.75 / (deg ** 0.75).sum())]:
        link = LinkSampler(indptr, indices, num_negatives=1, negative=kind, exclude_edges=False)
        batch = link.sample(pos, np.random.default_rng(1))
        neg = batch.node_ids.numpy()[batch.neg_index[1].numpy()]
        counts = np.bincount(neg, minlength=70)
        cells = expect > 0
        assert counts[~cells].sum() == 0  # degree-based never picks isolated nodes
        e = 20000 * expect[cells]
        stat = ((counts[cells] - e) ** 2 / e).sum()
        assert stat < chi2_upper(int(cells.sum()) - 1), (kind, counts)
    with pytest.raises(TypeError, match="NegativeSampling"):
        LinkSampler(indptr, indices, negative="degree")


def test_link_loader_covers_every_csr_edge_once_with_blocks():
    indptr, indices = random_csr(150, 5, seed=8)
    graph = GraphData(root=Path("."), name="t", num_nodes=150, directed=False, indptr=indptr,
                      indices=indices)
    batches = list(link_loader(graph, 50, [3, 2], num_negatives=2, seed=2).iter_epoch(0))
    seen = []
    for b in batches:
        ends = b.blocks.n_id[:b.blocks.num_seeds]  # the distinct endpoints, sorted
        assert (ends.diff() > 0).all() and b.features is None
        assert b.negatives.shape == (2, 2 * b.pairs.shape[1])
        u, v = ends[b.pairs].numpy()
        seen += list(zip(u.tolist(), v.tolist()))
    row = np.repeat(np.arange(150), np.diff(indptr))
    assert sorted(seen) == sorted(zip(row.tolist(), indices.tolist()))
    split = np.array([[0, 1, 2], [3, 4, 5]])
    only = list(link_loader(graph, 2, [1], edges=split, shuffle=False).iter_epoch(0))
    assert [b.blocks.n_id[b.pairs].tolist() for b in only] == [[[0, 1], [3, 4]], [[2], [5]]]
