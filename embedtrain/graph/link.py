"""Link-prediction pairs: positive edges of a CSR graph and sampled negatives for each.

:class:`LinkSampler` turns positive edges (CSR positions, :meth:`LinkSampler.csr_edges`, or a
split's held-out ``[2, M]`` pairs) into a :class:`LinkBatch`: the distinct endpoints, which are
the seeds the neighbour sampler (:mod:`embedtrain.graph.sampler`) then expands, and the positive
and negative pairs as positions among them. Negatives are uniform over the nodes or proportional
to ``degree ** 0.75``, redrawn when they hit an edge of their source node.

Data flow: loader (:class:`~embedtrain.graph.loader.SeedBatches` over edge ids) -> this sampler
-> neighbour sampler on the endpoints -> :func:`~embedtrain.graph.batch.link_batch` attaches the
features.

Example:
    >>> link = LinkSampler(indptr, indices, num_negatives=5, negative=NegativeSampling.DEGREE)
    >>> batch = link.sample(link.csr_edges(np.array([0, 10, 20])), rng=np.random.default_rng(0))
    >>> batch.pos_index.shape, batch.neg_index.shape
    (torch.Size([2, 3]), torch.Size([2, 15]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from embedtrain.graph.sampler import ArrayLike, RngLike, as_numpy
from embedtrain.graph.types import NegativeSampling


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
    """

    node_ids: torch.Tensor
    pos_index: torch.Tensor
    neg_index: torch.Tensor


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
        self.indptr = as_numpy(indptr, "indptr").astype(np.int64, copy=False)
        self.indices = as_numpy(indices, "indices")
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
        e = as_numpy(edge_ids, "edge_ids").astype(np.int64, copy=False)
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
