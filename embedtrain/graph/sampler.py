"""Vectorised multi-hop neighbour sampling over a CSR graph, returning index-only blocks.

The graph is the CSR of the graph data set format: ``indptr`` int64 ``[N + 1]``, ``indices``
int32/int64 ``[E]`` (the neighbours of ``u`` are ``indices[indptr[u]:indptr[u + 1]]``, the nodes
``u`` aggregates messages from), optionally ``weights`` float32 ``[E]``. Any of them may be
``np.memmap`` arrays: a batch reads only ``indptr`` at its frontier nodes and the index (and
weight) entries it samples, never a whole array.

How one hop is sampled, for the whole frontier at once (NumPy, no Python loop over nodes):

- a node whose degree is at most the fanout (or fanout ``-1``) keeps all its neighbours: one
  segmented ``arange`` over the frontier's CSR rows;
- uniform, without replacement: Floyd's algorithm on a ``[fanout, nodes]`` matrix, one row of
  picks per step (``fanout`` vectorised steps), which draws a uniform ``fanout``-subset of each
  node's slots while reading only the slots it keeps;
- weighted, without replacement (successive sampling: each pick proportional to the weights not
  yet picked): rows longer than ``4 x fanout`` make i.i.d. weighted picks by rejection (uniform
  proposals accepted with probability ``w / max w of the row``; the row maxima take one pass over
  the weights, on first use) and keep the first ``fanout`` distinct ones, reading about
  ``fanout x max / mean`` weights; shorter rows, and long rows whose proposals fell short, use
  Efraimidis-Spirakis keys ``-log(u) / w`` over all their weights (the ``fanout`` smallest per
  row from one ``argsort``);
- with replacement: ``fanout`` independent draws per node with neighbours.

New nodes are relabelled to local ids through a per-thread dense ``node -> local id`` array
(filled with -1 once, reset at the touched entries after each batch): a gather finds the sampled
neighbours without an id, a sort of just those deduplicates them (so each hop's new nodes are in
ascending global id order, which makes the next hop's and the feature gathers run in address
order), a scatter gives them ids, and a last gather labels every edge. No hash map, and no sort
of all sampled edges.

Block layout (:class:`SampledBlocks`), PyG's hierarchical layout: ``n_id`` holds the seeds
first, then the nodes first reached at hop 1, hop 2, ...; ``num_nodes_per_hop[h]`` counts the
nodes within ``h`` hops. Each node is sampled once, at the hop after it is first reached, with
that hop's fanout; ``edge_index[h - 1]`` holds the edges sampled at hops ``1..h`` (row 0: the
sampled neighbour, the message source; row 1: the node it was sampled for, the target), so its
targets are exactly the nodes within ``h - 1`` hops, each with its full sample. A GNN of ``H``
layers runs its first layer over hop ``H`` and its last over hop 1
(:class:`~embedtrain.models.gnn.GraphSAGE`)::

    for layer, h in zip(convs, range(H, 0, -1)):
        x = layer((x[:num_nodes_per_hop[h]], x[:num_nodes_per_hop[h - 1]]), edge_index[h - 1])
    # x[:num_seeds] are the seeds' outputs

Example:
    >>> indptr = np.array([0, 2, 4, 5, 6]); indices = np.array([1, 2, 0, 3, 0, 1])
    >>> sampler = NeighborSampler(indptr, indices, fanouts=[1, -1], seed=0)
    >>> blocks = sampler.sample(np.array([0]), step=0)
    >>> blocks.num_nodes_per_hop[0], len(blocks.edge_index), int(blocks.edge_index[0].shape[1])
    (1, 2, 1)

Where this sits in the data flow (PyG's split): a loader (:mod:`embedtrain.graph.loader`) splits
seed ids into batches and calls, per batch, a collate (:mod:`embedtrain.graph.batch`) that runs
this sampler (for links, :mod:`embedtrain.graph.link` first draws the pairs whose endpoints are
the seeds) and then attaches the sampled nodes' features and the targets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch

ArrayLike = Union[np.ndarray, torch.Tensor, Sequence[int]]
RngLike = Union[np.random.Generator, int, None]

_LONG_ROW = 4  # weighted rows longer than this x fanout are drawn by rejection
_PROPOSALS = 4  # uniform proposals per pick tried for a long row before the exact fallback


@dataclass
class SampledBlocks:
    """Index-only result of :meth:`NeighborSampler.sample` (see the module docstring's layout).

    Attributes:
        n_id: LongTensor ``[n_total]``: global node ids; the seeds first (in the given order,
            duplicates kept), then the nodes first reached at hop 1, 2, ... (each hop sorted).
        num_nodes_per_hop: cumulative node counts ``[num_seeds, <= 1 hop, <= 2 hops, ...]``.
        edge_index: one LongTensor ``[2, e_h]`` per hop ``h = 1..H`` of local ids (row 0 the
            source: a sampled neighbour, ``< num_nodes_per_hop[h]``; row 1 the target,
            ``< num_nodes_per_hop[h - 1]``). ``edge_index[h - 1]`` holds the edges of hops
            ``1..h``: column slices of one ``[2, E]`` array (so ``edge_index[h - 1]`` starts with
            ``edge_index[h - 2]``; all but the last are strided views). Within a hop, edges are
            in no particular order.
        num_seeds: number of seeds.
        num_edges_per_hop: cumulative edge counts, ``edge_index[h - 1].shape[1]``.
    """

    n_id: torch.Tensor
    num_nodes_per_hop: list[int]
    edge_index: list[torch.Tensor]
    num_seeds: int
    num_edges_per_hop: list[int] = field(default_factory=list)

    @property
    def num_hops(self) -> int:
        return len(self.edge_index)

    @property
    def num_sampled_edges(self) -> int:
        """Edges sampled in this batch (all hops)."""
        return self.num_edges_per_hop[-1] if self.num_edges_per_hop else 0


def as_numpy(a: ArrayLike, name: str) -> np.ndarray:
    """``a`` (array, tensor or sequence) as a 1-D NumPy array, without copying a memory map;
    raises ``ValueError`` naming ``name`` if it is not 1-D."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    # np.asarray of a memmap is a plain ndarray over the same mapping: no copy, no read.
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return a


def _segmented_arange(counts: np.ndarray) -> np.ndarray:
    """``concat(arange(c) for c in counts)``, vectorised."""
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def _rng(rng: RngLike, seed: int, step: Optional[int], fallback: np.random.Generator
         ) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is not None:
        step = int(rng)
    if step is not None:
        return np.random.default_rng([seed, step])
    return fallback


class NeighborSampler:
    """Multi-hop neighbour sampler over a (possibly memory-mapped) CSR graph.

    Args:
        indptr: int64 ``[N + 1]`` row offsets.
        indices: int32/int64 ``[E]`` neighbour ids (row ``u`` lists the nodes ``u`` aggregates
            from).
        fanouts: neighbours to sample per node at each hop (``-1``: all of them).
        weights: optional positive float ``[E]`` edge weights; sampling is then proportional to
            weight (without replacement: successive sampling). Zero weights are picked last.
        replace: draw with replacement (exactly ``fanout`` draws per node with neighbours).
        seed: base seed of the ``step``-seeded generators and of the default stream.

    The sampler holds references to the arrays and a lazily made per-thread relabel array (``N``
    int32 per thread that samples), so one instance can serve several loader threads (pass each
    call its ``rng``/``step``: the default stream is not thread-safe).

    Example:
        >>> sampler = NeighborSampler(indptr, indices, fanouts=[15, 10])
        >>> blocks = sampler.sample(seed_nodes, step=batch_index)
    """

    def __init__(self, indptr: ArrayLike, indices: ArrayLike, fanouts: Sequence[int],
                 weights: Optional[ArrayLike] = None, replace: bool = False,
                 seed: int = 0) -> None:
        self.indptr = as_numpy(indptr, "indptr")
        self.indices = as_numpy(indices, "indices")
        self.weights = None if weights is None else as_numpy(weights, "weights")
        if self.indptr.dtype != np.int64:
            self.indptr = self.indptr.astype(np.int64)
        if self.indices.dtype not in (np.int32, np.int64):
            raise ValueError(f"indices must be int32 or int64, got {self.indices.dtype}")
        self.num_nodes = len(self.indptr) - 1
        if self.num_nodes < 0 or int(self.indptr[-1]) != len(self.indices):
            raise ValueError(f"indptr[-1] = {int(self.indptr[-1]) if len(self.indptr) else None} "
                             f"but indices has {len(self.indices)} entries")
        if self.weights is not None and len(self.weights) != len(self.indices):
            raise ValueError(f"weights has {len(self.weights)} entries, indices "
                             f"{len(self.indices)}")
        self.fanouts = [int(f) for f in fanouts]
        if not self.fanouts or any(f == 0 or f < -1 for f in self.fanouts):
            raise ValueError(f"fanouts must be a non-empty list of positive ints or -1, got "
                             f"{list(fanouts)}")
        self.replace, self.seed = replace, seed
        self._max_weight: Optional[np.ndarray] = None  # per-row max weight, made on first use
        self._default_rng = np.random.default_rng(seed)
        self._local = threading.local()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_local")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _local_of(self) -> np.ndarray:
        table = getattr(self._local, "table", None)
        if table is None:
            dtype = np.int32 if self.num_nodes < 2**31 else np.int64
            table = self._local.table = np.full(self.num_nodes, -1, dtype=dtype)
        return table

    def sample(self, seeds: ArrayLike, rng: RngLike = None, step: Optional[int] = None
               ) -> SampledBlocks:
        """Samples the ``len(fanouts)``-hop neighbourhood of ``seeds``.

        Args:
            seeds: global node ids (int array or tensor); duplicates are kept as separate targets
                (a neighbour equal to a seed maps to one of its positions).
            rng: a ``np.random.Generator`` to draw from, or an int used like ``step``.
            step: draws from ``default_rng([seed, step])``: the same ``(seed, step)`` gives the
                same blocks (e.g. ``step`` = a batch's position in the run). With neither, the
                sampler's own stream (seeded by ``seed``) is used.

        Returns:
            :class:`SampledBlocks` with ``len(fanouts)`` hops.
        """
        gen = _rng(rng, self.seed, step, self._default_rng)
        seeds = as_numpy(seeds, "seeds").astype(np.int64, copy=False)
        if len(seeds) and (seeds.min() < 0 or seeds.max() >= self.num_nodes):
            raise ValueError(f"seed ids must be in [0, {self.num_nodes}), got "
                             f"[{seeds.min()}, {seeds.max()}]")
        local_of = self._local_of()
        parts, hops = [seeds], []
        num_nodes, num_edges = [len(seeds)], [0]
        try:
            local_of[seeds] = np.arange(len(seeds), dtype=local_of.dtype)
            frontier, first_local = seeds, 0
            for fanout in self.fanouts:
                rows, nbr = self._sample_hop(frontier, fanout, gen)
                # The new nodes: neighbours without a local id yet, deduplicated by a sort of
                # just those (no hash map, no sort of all sampled edges); sorted ids also make
                # the next hop's and the feature gathers run in address order.
                fresh = np.sort(nbr[np.take(local_of, nbr) < 0].astype(local_of.dtype))
                if len(fresh) > 1:
                    fresh = fresh[np.concatenate([[True], fresh[1:] != fresh[:-1]])]
                fresh = fresh.astype(np.int64)
                local_of[fresh] = np.arange(num_nodes[-1], num_nodes[-1] + len(fresh),
                                            dtype=local_of.dtype)
                src = np.take(local_of, nbr)
                rows += first_local
                hops.append((src, rows))
                parts.append(fresh)
                first_local = num_nodes[-1]
                num_nodes.append(num_nodes[-1] + len(fresh))
                num_edges.append(num_edges[-1] + len(src))
                frontier = fresh
        finally:
            for p in parts:
                local_of[p] = -1
        edges = np.empty((2, num_edges[-1]), dtype=np.int64)
        for (src, dst), a, b in zip(hops, num_edges, num_edges[1:]):
            edges[0, a:b], edges[1, a:b] = src, dst
        edge_index = torch.from_numpy(edges)
        return SampledBlocks(
            n_id=torch.from_numpy(np.concatenate(parts)),
            num_nodes_per_hop=num_nodes,
            edge_index=[edge_index[:, :e] for e in num_edges[1:]],
            num_seeds=len(seeds),
            num_edges_per_hop=num_edges[1:],
        )

    def _sample_hop(self, frontier: np.ndarray, fanout: int, gen: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The frontier's sampled neighbours: (row in ``frontier``, global id), int64 each.

        Rows that keep all their neighbours come first, then the sampled rows pick by pick."""
        start = np.take(self.indptr, frontier)
        deg = np.take(self.indptr, frontier + 1) - start
        if fanout < 0:
            whole, drawn = np.arange(len(frontier)), np.empty(0, dtype=np.int64)
        elif self.replace:
            whole, drawn = np.empty(0, dtype=np.int64), np.flatnonzero(deg > 0)
        else:
            many = deg > fanout
            whole, drawn = np.flatnonzero(~many), np.flatnonzero(many)
        count = deg[whole]
        ends = np.cumsum(count)
        # Consecutive slots of each whole row: start + (i - first output index of the row).
        rows = [np.repeat(whole, count)]
        pos = [np.repeat(start[whole] - (ends - count), count)
               + np.arange(ends[-1] if len(ends) else 0)]
        if len(drawn):
            offsets = self._choose(frontier[drawn], start[drawn], deg[drawn], fanout, gen)
            rows.append(np.tile(drawn, fanout))
            pos.append((start[drawn] + offsets).ravel())
        nbr = np.take(self.indices, np.concatenate(pos))
        return np.concatenate(rows), nbr.astype(np.int64, copy=False)

    def _choose(self, nodes: np.ndarray, start: np.ndarray, deg: np.ndarray, fanout: int,
                gen: np.random.Generator) -> np.ndarray:
        """``[fanout, rows]`` offsets into each row's slots (distinct unless ``replace``)."""
        if self.weights is not None:
            return self._choose_weighted(nodes, start, deg, fanout, gen)
        u = gen.random((fanout, len(deg)))
        if self.replace:
            return (u * deg).astype(np.int64)
        # Floyd: for j = d - f .. d - 1 draw t in [0, j]; take t, or j if t is already taken.
        # Pick by pick (fanout is small), each step over all rows at once.
        small = np.int32 if len(deg) == 0 or deg.max() < 2**31 - 1 else np.int64
        out = np.empty((fanout, len(deg)), dtype=small)  # int32: half the bytes to compare
        top = (deg - fanout).astype(small)
        for k in range(fanout):
            t = (u[k] * (top + 1)).astype(small)
            if k:
                np.copyto(t, top, where=(out[:k] == t).any(axis=0))
            out[k] = t
            top += 1
        return out

    def _choose_weighted(self, nodes: np.ndarray, start: np.ndarray, deg: np.ndarray,
                         fanout: int, gen: np.random.Generator) -> np.ndarray:
        """``[fanout, rows]`` offsets drawn with probability proportional to weight.

        Without replacement this is successive sampling: each pick proportional to the weights
        not yet picked, which is also the sequence of distinct items in i.i.d. weighted draws.
        Long rows get such i.i.d. draws by rejection (uniform proposals accepted with
        probability ``w / max w`` of the row), reading about ``fanout x max / mean`` weights
        instead of the whole row; rows that are short, or did not get ``fanout`` picks from
        their proposals, are done exactly over all their weights.
        """
        out = np.empty((fanout, len(deg)), dtype=np.int64)
        exact = np.flatnonzero(deg <= _LONG_ROW * fanout)
        long_rows = np.flatnonzero(deg > _LONG_ROW * fanout)
        if len(long_rows):
            picks, ok = self._rejection_picks(nodes[long_rows], start[long_rows],
                                              deg[long_rows], fanout, gen)
            out[:, long_rows[ok]] = picks
            exact = np.concatenate([exact, long_rows[~ok]])
        if len(exact):
            out[:, exact] = self._exact_weighted(start[exact], deg[exact], fanout, gen)
        return out

    def _row_max(self) -> np.ndarray:
        if self._max_weight is None:  # one pass over the weights, on first use
            starts = self.indptr[:-1]
            full = np.flatnonzero(np.diff(self.indptr) > 0)
            row_max = np.zeros(self.num_nodes, dtype=np.float64)
            if len(full):
                row_max[full] = np.maximum.reduceat(self.weights, starts[full])
            self._max_weight = row_max
        return self._max_weight

    def _rejection_picks(self, nodes: np.ndarray, start: np.ndarray, deg: np.ndarray,
                         fanout: int, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Picks of the rows whose ``_PROPOSALS x fanout`` proposals gave ``fanout`` (distinct)
        accepted offsets (``[fanout, ok rows]``), and which rows those are."""
        shape = (len(deg), _PROPOSALS * fanout)
        offset = (gen.random(shape) * deg[:, None]).astype(np.int64)
        w = np.take(self.weights, start[:, None] + offset)
        accept = gen.random(shape) * np.take(self._row_max(), nodes)[:, None] < w
        if not self.replace:
            # Later repeats of an accepted offset do not count (rejected ones get distinct
            # negative stand-ins so they never match).
            key = np.where(accept, offset, -1 - np.arange(shape[1]))
            order = np.argsort(key, axis=1, kind="stable")
            ordered = np.take_along_axis(key, order, axis=1)
            repeat = np.zeros(shape, dtype=bool)
            np.put_along_axis(repeat, order[:, 1:], ordered[:, 1:] == ordered[:, :-1], axis=1)
            accept &= ~repeat
        rank = np.cumsum(accept, axis=1)
        ok = rank[:, -1] >= fanout
        take = accept & (rank <= fanout) & ok[:, None]
        return offset[take].reshape(-1, fanout).T, ok

    def _exact_weighted(self, start: np.ndarray, deg: np.ndarray, fanout: int,
                        gen: np.random.Generator) -> np.ndarray:
        row = np.repeat(np.arange(len(deg), dtype=np.int64), deg)
        within = _segmented_arange(deg)
        w = np.take(self.weights, start[row] + within).astype(np.float64)
        if self.replace:
            # Draw by bisection into the rows' concatenated cumulative weights.
            cum = np.cumsum(w)
            first = np.cumsum(deg) - deg
            base = np.concatenate([[0.0], cum])[first]
            target = base + gen.random((fanout, len(deg))) * (cum[first + deg - 1] - base)
            hit = np.searchsorted(cum, target, side="right")
            return np.clip(hit - first, 0, deg - 1)
        # Efraimidis-Spirakis: the `fanout` smallest Exp(w) keys of a row are a successive
        # sample; one argsort of row + key / (1 + key) (each row in its own unit interval).
        with np.errstate(divide="ignore", invalid="ignore"):
            key = -np.log(gen.random(len(w))) / w
            frac = key / (1.0 + key)
        cap = 1.0 - 2.0**-30  # infinite keys (zero weights) sort last in their row
        order = np.argsort(row + np.where(np.isnan(frac), cap, np.minimum(frac, cap)))
        keep = within < fanout  # positions of the sorted array: each row's `fanout` first
        return within[order[keep]].reshape(len(deg), fanout).T
