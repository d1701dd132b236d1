"""Seed-batch loaders: the seeds of each rank, in batches, collated in worker threads.

The data flow of a GNN batch (PyG's split): the loader (:class:`SeedBatches`) picks the batch's
seed ids (nodes, or edge positions for link prediction) and its generator
``default_rng([seed, epoch, rank, batch])``, and calls a collate in a worker thread; the collate
(:mod:`embedtrain.graph.batch`) runs the samplers (:mod:`embedtrain.graph.link` for the pairs,
:mod:`embedtrain.graph.sampler` for the neighbourhood) and attaches the features and targets.

:func:`node_loader` and :func:`link_loader` put the pieces together for a loaded
:class:`~embedtrain.graph.store.GraphData` from plain arguments; both yield
:class:`~embedtrain.graph.batch.GraphBatch` and follow the trainer's ``EpochData`` protocol
(``len``, ``iter_epoch(epoch, skip_batches)``, ``step_rows``), so a resumed run sees exactly the
batches an uninterrupted one would have.

Example:
    >>> train = node_loader(graph, graph.splits["train"], 1024, [15, 10], seed=0, rank=r,
    ...                     world_size=w, num_workers=2)
    >>> for batch in train.iter_epoch(0):
    ...     ...
"""

from __future__ import annotations

from typing import Callable, Generic, Iterable, Iterator, Optional, Sequence, TypeVar, Union

import numpy as np

from embedtrain.data.prefetch import OrderedPrefetcher
from embedtrain.graph.batch import GraphBatch, link_batch, node_batch
from embedtrain.graph.link import LinkSampler
from embedtrain.graph.sampler import ArrayLike, NeighborSampler, as_numpy
from embedtrain.graph.store import GraphData
from embedtrain.graph.types import NegativeSampling

T = TypeVar("T")


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
        num_workers: threads running ``collate`` ahead of the consumer (0: in the caller), an
            :class:`~embedtrain.data.prefetch.OrderedPrefetcher` (batches in order).
        collate: ``(ids, rng) -> batch``, e.g. ``lambda ids, rng: sampler.sample(ids, rng)``;
            default: the int64 id array itself.
        drop_last: only full batches, as many on every rank (the rest is counted in
            ``dropped_rows``).
        prefetch_batches: ready batches that may wait for the consumer (each worker also holds
            up to one finished batch and the one it is collating).
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
            self.node_ids = as_numpy(node_ids, "node_ids").astype(np.int64, copy=False)
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
        """Batches ``skip_batches, ..., len(self) - 1`` of ``epoch``, in order.

        Returns:
            An iterator with ``close()`` (stops and joins the worker threads when leaving early).
        """
        ids = self.rank_ids(epoch)
        positions = list(range(skip_batches, len(self)))

        def load(b: int):
            chunk = ids[b * self.batch_size:(b + 1) * self.batch_size]
            if self.collate is None:
                return chunk
            return self.collate(chunk, np.random.default_rng([self.seed, epoch, self.rank, b]))

        if self.num_workers == 0 or len(positions) < 2:
            return (load(b) for b in positions)
        # Worker w collates batches w, w + num_workers, ...; the assembler hands them on in
        # batch order. Each batch depends only on (seed, epoch, rank, b), not on its thread.
        return OrderedPrefetcher(positions, load, _identity, num_workers=self.num_workers,
                                 max_ready=self.prefetch_batches, max_loaded=1,
                                 name=f"seed-batches-rank{self.rank}")

    def __iter__(self) -> Iterator[T]:
        return self.iter_epoch(0)


def _identity(batches: Iterable[T]) -> Iterable[T]:
    return batches


def node_loader(graph: GraphData, ids: ArrayLike, batch_size: int, fanouts: Sequence[int], *,
                weighted: bool = False, shuffle: bool = True, seed: int = 0, rank: int = 0,
                world_size: int = 1, num_workers: int = 0,
                drop_last: bool = False, prefetch_batches: int = 4
                ) -> SeedBatches[GraphBatch]:
    """Node-classification batches of ``ids``, this rank's share, with sampled neighbourhoods.

    Args:
        graph: the graph (CSR, features, labels); ``graph.labels`` must be set.
        ids: the seed node ids (e.g. ``graph.splits["train"]``).
        batch_size: seeds per batch (per rank).
        fanouts: neighbours sampled per node at each hop (``-1``: all).
        weighted: sample proportionally to ``graph.weights`` (when the graph has them).
        shuffle, seed, rank, world_size, num_workers, drop_last, prefetch_batches: as
            :class:`SeedBatches` (``seed`` fixes the order and every batch's generator).

    Returns:
        :class:`SeedBatches` yielding :func:`~embedtrain.graph.batch.node_batch` batches.
    """
    sampler = _neighbor_sampler(graph, fanouts, weighted)
    return SeedBatches(ids, batch_size, shuffle=shuffle, seed=seed, rank=rank,
                       world_size=world_size, num_workers=num_workers, drop_last=drop_last,
                       prefetch_batches=prefetch_batches, unit="nodes",
                       collate=lambda b, rng: node_batch(b, rng, sampler, graph))


def link_loader(graph: GraphData, batch_size: int, fanouts: Sequence[int], *,
                edges: Optional[np.ndarray] = None, num_negatives: int = 1,
                negative: NegativeSampling = NegativeSampling.UNIFORM, weighted: bool = False,
                shuffle: bool = True, seed: int = 0, rank: int = 0,
                world_size: int = 1, num_workers: int = 0, drop_last: bool = False,
                prefetch_batches: int = 4) -> SeedBatches[GraphBatch]:
    """Link-prediction batches: positive edges with sampled negatives and their endpoints'
    neighbourhoods, this rank's share.

    Args:
        graph: the graph (CSR with sorted rows, optional features).
        batch_size: positive edges per batch (per rank).
        fanouts: neighbours sampled per endpoint at each hop (``-1``: all).
        edges: ``[2, M]`` positive pairs (e.g. ``graph.edge_splits["valid"]``); None: every CSR
            entry (training).
        num_negatives, negative: negatives per positive and how they are drawn
            (:class:`~embedtrain.graph.link.LinkSampler`).
        weighted, shuffle, seed, rank, world_size, num_workers, drop_last,
            prefetch_batches: as :func:`node_loader`.

    Returns:
        :class:`SeedBatches` over edge positions yielding
        :func:`~embedtrain.graph.batch.link_batch` batches.
    """
    sampler = _neighbor_sampler(graph, fanouts, weighted)
    link = LinkSampler(graph.indptr, graph.indices, num_negatives=num_negatives,
                       negative=negative)
    pairs = None if edges is None else np.asarray(edges)
    if pairs is not None and (pairs.ndim != 2 or pairs.shape[0] != 2):
        raise ValueError(f"edges must be [2, M], got shape {pairs.shape}")
    count = link.num_edges if pairs is None else pairs.shape[1]
    return SeedBatches(count, batch_size, shuffle=shuffle, seed=seed, rank=rank,
                       world_size=world_size, num_workers=num_workers, drop_last=drop_last,
                       prefetch_batches=prefetch_batches, unit="edges",
                       collate=lambda b, rng: link_batch(b, rng, link, sampler, graph, pairs))


def _neighbor_sampler(graph: GraphData, fanouts: Sequence[int], weighted: bool
                      ) -> NeighborSampler:
    # No seed of its own: every batch passes the generator its (seed, epoch, rank, batch) gives.
    return NeighborSampler(graph.indptr, graph.indices, fanouts,
                           weights=graph.weights if weighted else None)
