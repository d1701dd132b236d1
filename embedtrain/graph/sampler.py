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
layers runs its first layer over hop ``H`` and its last over hop 1 (:func:`sage_forward`)::

    for layer, h in zip(convs, range(H, 0, -1)):
        x = layer((x[:num_nodes_per_hop[h]], x[:num_nodes_per_hop[h - 1]]), edge_index[h - 1])
    # x[:num_seeds] are the seeds' outputs

Example:
    >>> indptr = np.array([0, 2, 4, 5, 6]); indices = np.array([1, 2, 0, 3, 0, 1])
    >>> sampler = NeighborSampler(indptr, indices, fanouts=[1, -1], seed=0)
    >>> blocks = sampler.sample(np.array([0]), step=0)
    >>> blocks.num_nodes_per_hop[0], len(blocks.edge_index), int(blocks.edge_index[0].shape[1])
    (1, 2, 1)

:class:`SeedBatches` splits seed ids into per-rank batches (the trainer's ``EpochData``) and can
run the sampler in worker threads; :class:`LinkSampler` and :func:`edge_batches` make positive
and negative node pairs for link prediction.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, Optional, Sequence, TypeVar, Union

import numpy as np
import torch

ArrayLike = Union[np.ndarray, torch.Tensor, Sequence[int]]
RngLike = Union[np.random.Generator, int, None]
T = TypeVar("T")

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


def sage_forward(convs: Sequence[Callable[..., torch.Tensor]], x: torch.Tensor,
                 blocks: SampledBlocks,
                 activation: Callable[[torch.Tensor], torch.Tensor] = torch.relu) -> torch.Tensor:
    """Runs bipartite message-passing layers (e.g. PyG ``SAGEConv``) over sampled blocks.

    Args:
        convs: one layer per hop, first layer first; each is called as
            ``conv((x_source, x_target), edge_index)`` with PyG's ``[2, E]`` source -> target
            edges and returns the targets' outputs.
        x: input features of the block's nodes, ``[n_total, F]`` in ``blocks.n_id`` order
            (``features[blocks.n_id]``).
        blocks: the sampled blocks, with as many hops as ``convs``.
        activation: applied between layers (not after the last).

    Returns:
        The seeds' outputs, ``[num_seeds, F_out]``.

    Example:
        >>> from torch_geometric.nn import SAGEConv
        >>> convs = [SAGEConv(8, 16), SAGEConv(16, 4)]
        >>> out = sage_forward(convs, features[blocks.n_id], blocks)   # [num_seeds, 4]
    """
    if len(convs) != blocks.num_hops:
        raise ValueError(f"{len(convs)} layers for blocks of {blocks.num_hops} hops")
    n = blocks.num_nodes_per_hop
    for layer, conv in enumerate(convs):
        h = blocks.num_hops - layer
        x = conv((x[:n[h]], x[:n[h - 1]]), blocks.edge_index[h - 1])
        if layer < len(convs) - 1:
            x = activation(x)
    return x[:blocks.num_seeds]


def _as_numpy(a: ArrayLike, name: str) -> np.ndarray:
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
        self.indptr = _as_numpy(indptr, "indptr")
        self.indices = _as_numpy(indices, "indices")
        self.weights = None if weights is None else _as_numpy(weights, "weights")
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
        seeds = _as_numpy(seeds, "seeds").astype(np.int64, copy=False)
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


class SeedBatches(Generic[T]):
    """Seed ids of one rank, in batches, per epoch: the trainer's ``EpochData``.

    An epoch permutes all ids with ``(seed, epoch)`` (the same order on every rank) and gives
    rank ``r`` the entries ``r, r + world_size, ...``: every id lands on exactly one rank once per
    epoch, with no padding, and step ``b``'s batches of all ranks together are one contiguous
    slice of the permutation (what one rank with the global batch would take). All ranks yield
    ``len()`` batches (the ranks' shares differ by at most one id, so only the last batch of a rank
    can be shorter than the others' or, when fewer ids than ranks are left, empty: tasks give an
    empty batch a zero loss). Batch ``b`` of the epoch is ``collate(ids, rng)`` with ``rng =
    default_rng([seed, epoch, rank, b])``, so a batch is the same whatever ``num_workers`` is and
    when resuming with ``skip_batches``.

    Args:
        node_ids: the seed ids (e.g. the training nodes), or ``n`` for ``0..n-1``.
        batch_size: seeds per batch (per rank).
        shuffle: permute the ids each epoch (else keep their order).
        seed: base seed of the permutation and of the batches' generators.
        rank, world_size: this rank and the number of ranks.
        num_workers: threads running ``collate`` ahead of the consumer (0: in the caller).
        collate: ``(ids, rng) -> batch``, e.g. ``lambda ids, rng: sampler.sample(ids, rng)``;
            default: the int64 id array itself.
        drop_last: only full batches, as many on every rank (the rest is counted in
            ``dropped_rows``).
        prefetch_batches: ready batches the workers may hold.
        unit: what a seed is, for messages (``"nodes"``, ``"edges"``).

    Example:
        >>> batches = SeedBatches(train_nodes, 1024, rank=r, world_size=w, num_workers=2,
        ...                       collate=lambda ids, rng: sampler.sample(ids, rng))
        >>> for blocks in batches.iter_epoch(3, skip_batches=10):
        ...     ...
    """

    def __init__(self, node_ids: Union[ArrayLike, int], batch_size: int, shuffle: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 collate: Optional[Callable[[np.ndarray, np.random.Generator], T]] = None,
                 drop_last: bool = False, prefetch_batches: int = 4,
                 unit: str = "seeds") -> None:
        self.unit = unit
        if isinstance(node_ids, (int, np.integer)):
            self.node_ids: Optional[np.ndarray] = None
            self.num_ids = int(node_ids)
        else:
            self.node_ids = _as_numpy(node_ids, "node_ids").astype(np.int64, copy=False)
            self.num_ids = len(self.node_ids)
        if self.num_ids == 0:
            raise ValueError("no seed ids: an empty split would train on nothing")
        if batch_size < 1 or not 0 <= rank < world_size or num_workers < 0:
            raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size, num_workers >= 0; "
                             f"got {batch_size}, {rank}, {world_size}, {num_workers}")
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.collate, self.drop_last, self.prefetch_batches = collate, drop_last, prefetch_batches
        #: Ids of every rank per epoch (``ceil((n - r) / world_size)``).
        self.rank_rows = [len(range(r, self.num_ids, world_size)) for r in range(world_size)]
        self.num_rank_ids = self.rank_rows[rank]

    @property
    def total_rows(self) -> int:
        """Seed ids per epoch over all ranks."""
        return self.num_ids

    @property
    def num_rows(self) -> int:
        """This rank's seed ids per epoch."""
        return self.num_rank_ids

    def __len__(self) -> int:
        if self.drop_last:
            return min(self.rank_rows) // self.batch_size
        return -(-max(self.rank_rows) // self.batch_size)

    def step_rows(self, index: int) -> tuple[int, int]:
        """``(seeds, padding)`` of batch ``index`` over all ranks (never any padding)."""
        b = self.batch_size
        if index >= len(self):
            return 0, 0
        if self.drop_last or index < len(self) - 1:  # only the last batch can be short
            return b * self.world_size, 0
        return sum(min(b, max(0, n - index * b)) for n in self.rank_rows), 0

    @property
    def dropped_rows(self) -> int:
        """Seed ids ``drop_last`` leaves out per epoch, over all ranks."""
        return self.num_ids - len(self) * self.batch_size * self.world_size if self.drop_last else 0

    def rank_ids(self, epoch: int) -> np.ndarray:
        """This rank's ids for ``epoch``, in batch order."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_ids)
        else:
            order = np.arange(self.num_ids, dtype=np.int64)
        mine = order[self.rank::self.world_size]
        return mine if self.node_ids is None else self.node_ids[mine]

    def iter_epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[T]:
        """Yields batches ``skip_batches, ..., len(self) - 1`` of ``epoch``."""
        ids = self.rank_ids(epoch)
        positions = list(range(skip_batches, len(self)))

        def load(b: int):
            chunk = ids[b * self.batch_size:(b + 1) * self.batch_size]
            if self.collate is None:
                return chunk
            return self.collate(chunk, np.random.default_rng([self.seed, epoch, self.rank, b]))

        if self.num_workers == 0 or len(positions) < 2:
            return (load(b) for b in positions)
        return _in_order(load, positions, self.num_workers,
                         self.num_workers + self.prefetch_batches, f"seed-batches-rank{self.rank}")

    def __iter__(self) -> Iterator[T]:
        return self.iter_epoch(0)


def _in_order(fn: Callable[[int], T], positions: Sequence[int], num_workers: int, window: int,
              name: str) -> Iterator[T]:
    """``fn(p) for p in positions`` computed by ``num_workers`` threads, at most ``window`` ahead.

    (A thread pool rather than ``embedtrain.data.prefetch``, whose package import pulls in
    torchrec: sampling is NumPy work that releases the GIL and needs no more than this.)
    """
    with ThreadPoolExecutor(num_workers, thread_name_prefix=name) as pool:
        todo = iter(positions)
        pending = collections.deque(pool.submit(fn, p) for p in itertools.islice(todo, window))
        try:
            while pending:
                result = pending.popleft().result()
                for p in itertools.islice(todo, 1):
                    pending.append(pool.submit(fn, p))
                yield result
        finally:  # the consumer stopped early (or a batch failed): drop what has not started
            for future in pending:
                future.cancel()


class NegativeSampling(enum.Enum):
    """How negative destinations are drawn for link prediction."""

    UNIFORM = "uniform"  # every node alike
    DEGREE = "degree"  # proportional to degree ** 0.75 (word2vec's unigram ** 0.75)


@dataclass
class LinkBatch:
    """Positive and negative node pairs of a link-prediction batch, in local ids.

    Attributes:
        node_ids: LongTensor ``[n]``: the distinct endpoints (sorted global ids): the seeds of
            the neighbour sampler, whose ``blocks.n_id[:n]`` are these nodes in this order.
        pos_index: LongTensor ``[2, B]``: positive pairs (row 0: the CSR row node ``u``; row 1:
            its neighbour ``v``) as positions in ``node_ids``.
        neg_index: LongTensor ``[2, B * k]``: negatives; row 0 repeats each positive's ``u``
            ``k`` times, row 1 holds the sampled negatives.
        blocks: the neighbour sample of ``node_ids`` when :func:`edge_batches` was given a sampler.
    """

    node_ids: torch.Tensor
    pos_index: torch.Tensor
    neg_index: torch.Tensor
    blocks: Optional[SampledBlocks] = None


class LinkSampler:
    """Positive edges of a CSR graph with ``num_negatives`` sampled negatives each.

    Args:
        indptr, indices: the CSR (rows sorted ascending, as the graph data set format requires,
            for ``exclude_edges``).
        num_negatives: negatives per positive.
        negative: uniform over nodes, or proportional to ``degree ** degree_power``.
        exclude_edges: redraw (up to ``max_redraws`` rounds) negatives that equal their ``u`` or
            are neighbours of it (a vectorised bisection of ``u``'s sorted row); rare leftovers
            (``u`` adjacent to nearly everything) are kept.
        degree_power: exponent of the degree distribution.
        max_redraws: rounds of redrawing for ``exclude_edges``.

    Example:
        >>> link = LinkSampler(indptr, indices, num_negatives=5, negative=NegativeSampling.DEGREE)
        >>> batch = link.sample(link.csr_edges(np.array([0, 10, 20])), rng=np.random.default_rng(0))
    """

    def __init__(self, indptr: ArrayLike, indices: ArrayLike, num_negatives: int = 1,
                 negative: NegativeSampling = NegativeSampling.UNIFORM,
                 exclude_edges: bool = True, degree_power: float = 0.75,
                 max_redraws: int = 8) -> None:
        self.indptr = _as_numpy(indptr, "indptr").astype(np.int64, copy=False)
        self.indices = _as_numpy(indices, "indices")
        self.num_nodes = len(self.indptr) - 1
        if num_negatives < 0:
            raise ValueError(f"num_negatives must be >= 0, got {num_negatives}")
        if not isinstance(negative, NegativeSampling):
            raise TypeError(f"negative must be a NegativeSampling, got {negative!r}")
        self.num_negatives, self.negative = num_negatives, negative
        self.exclude_edges, self.max_redraws = exclude_edges, max_redraws
        self._cdf: Optional[np.ndarray] = None
        if negative is NegativeSampling.DEGREE:
            cdf = np.cumsum(np.diff(self.indptr).astype(np.float64) ** degree_power)
            if cdf[-1] <= 0:
                raise ValueError("degree-based negatives need a graph with edges")
            self._cdf = cdf / cdf[-1]

    @property
    def num_edges(self) -> int:
        return len(self.indices)

    def csr_edges(self, edge_ids: ArrayLike) -> np.ndarray:
        """The edges at CSR positions ``edge_ids`` as ``[2, B]`` (row node, neighbour)."""
        e = _as_numpy(edge_ids, "edge_ids").astype(np.int64, copy=False)
        u = np.searchsorted(self.indptr, e, side="right") - 1
        return np.stack([u, self.indices[e].astype(np.int64)])

    def has_edge(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Whether ``v`` is in ``u``'s (sorted) row, elementwise; bisection over all pairs."""
        lo, hi = self.indptr[u].copy(), self.indptr[u + 1].copy()
        while True:  # ~log2(max degree) rounds
            open_ = lo < hi
            if not open_.any():
                break
            mid = (lo + hi) // 2
            below = np.zeros(len(u), dtype=bool)
            below[open_] = self.indices[mid[open_]] < v[open_]
            lo = np.where(open_ & below, mid + 1, lo)
            hi = np.where(open_ & ~below, mid, hi)
        found = lo < self.indptr[u + 1]
        found[found] = self.indices[lo[found]] == v[found]
        return found

    def _draw(self, n: int, gen: np.random.Generator) -> np.ndarray:
        if self._cdf is None:
            return gen.integers(0, self.num_nodes, n)
        return np.searchsorted(self._cdf, gen.random(n), side="right").clip(max=self.num_nodes - 1)

    def sample(self, pos_edges: ArrayLike, rng: RngLike = None) -> LinkBatch:
        """Negatives for the positive pairs ``pos_edges`` (``[2, B]`` global ids).

        Returns:
            :class:`LinkBatch` over the distinct endpoints.
        """
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        pos = (pos_edges.numpy() if isinstance(pos_edges, torch.Tensor)
               else np.asarray(pos_edges)).astype(np.int64)
        if pos.ndim != 2 or pos.shape[0] != 2:
            raise ValueError(f"pos_edges must be [2, B], got shape {pos.shape}")
        u = np.repeat(pos[0], self.num_negatives)
        neg = self._draw(len(u), gen)
        if self.exclude_edges:
            for _ in range(self.max_redraws):
                bad = np.flatnonzero((neg == u) | self.has_edge(u, neg))
                if not len(bad):
                    break
                neg[bad] = self._draw(len(bad), gen)
        nodes, inverse = np.unique(np.concatenate([pos[0], pos[1], neg]), return_inverse=True)
        b = pos.shape[1]
        local = torch.from_numpy(inverse.astype(np.int64))
        return LinkBatch(
            node_ids=torch.from_numpy(nodes),
            pos_index=torch.stack([local[:b], local[b:2 * b]]),
            neg_index=torch.stack([local[:b].repeat_interleave(self.num_negatives),
                                   local[2 * b:]]),
        )


def edge_batches(link: LinkSampler, batch_size: int, edges: Optional[ArrayLike] = None,
                 sampler: Optional[NeighborSampler] = None, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, num_workers: int = 0,
                 drop_last: bool = False) -> SeedBatches[LinkBatch]:
    """Batches of positive edges with negatives (and their neighbour samples), per rank.

    Args:
        link: draws the negatives.
        batch_size: positive edges per batch (per rank).
        edges: ``[2, M]`` positive pairs (e.g. a split's edges); default: every CSR edge.
        sampler: if given, each batch also carries ``sampler.sample(node_ids)`` as ``blocks``.
        shuffle, seed, rank, world_size, num_workers, drop_last: as :class:`SeedBatches`.

    Returns:
        :class:`SeedBatches` yielding :class:`LinkBatch` (the trainer's ``EpochData``).
    """
    pairs = None
    if edges is not None:
        pairs = (edges.numpy() if isinstance(edges, torch.Tensor) else np.asarray(edges))
        if pairs.ndim != 2 or pairs.shape[0] != 2:
            raise ValueError(f"edges must be [2, M], got shape {pairs.shape}")

    def collate(edge_ids: np.ndarray, gen: np.random.Generator) -> LinkBatch:
        pos = link.csr_edges(edge_ids) if pairs is None else pairs[:, edge_ids]
        batch = link.sample(pos, gen)
        if sampler is not None:
            batch.blocks = sampler.sample(batch.node_ids.numpy(), gen)
        return batch

    count = link.num_edges if pairs is None else pairs.shape[1]
    return SeedBatches(count, batch_size, shuffle=shuffle, seed=seed, rank=rank,
                       world_size=world_size, num_workers=num_workers, collate=collate,
                       drop_last=drop_last)


__all__ = ["LinkBatch", "LinkSampler", "NegativeSampling", "NeighborSampler", "SampledBlocks",
           "SeedBatches", "edge_batches", "sage_forward"]
