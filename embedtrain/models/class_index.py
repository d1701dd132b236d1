"""A clustered (inverted-file) index of class vectors: approximate top-k in sub-linear time.

Dynamic class selection and ANCE/NGAME-style hard negatives look up, every step, the classes that
score highest against each example. An exact search scores all ``n`` classes of the slice
(``B x n x D`` flops a step, a third of the full softmax's). The clustered index partitions the
class vectors with k-means into ``clusters`` lists (an IVF index, as FAISS's ``IndexIVFFlat``);
a query scores the ``clusters`` centroids, then only the classes of its ``probe`` best clusters
(``B x probe x n / clusters x D`` flops): the search cost grows with ``sqrt(n)`` when
``clusters ~ sqrt(n)`` and a fixed share of them is probed.

* Build (every refresh): the maximum-inner-product search is turned into a nearest-neighbour
  one (Bachrach et al., 2014: one more coordinate ``sqrt(M^2 - |w|^2)`` per class vector, ``M``
  the largest norm, 0 for queries), then k-means (Lloyd's iterations, assignment to the
  nearest centroid) on a uniform sample of at most ``sample_per_cluster`` points per cluster,
  seeded by ``generator``; every vector is assigned once and the vectors are stored cluster by
  cluster (one copy of the slice, as the exact index's snapshot).
* Search: a query probes its nearest centroids in that space; each probed cluster's classes
  are scored exactly (one matmul for all the queries probing it); the per-cluster top-k are
  merged per query.

Written in torch (no FAISS): it runs on the head's device (CPU here, CUDA on GPUs) and, being
deterministic for a given generator, a resumed run rebuilds the same index.

Example:
    >>> index = ClusteredIndex(weight, clusters=1024, probe=64, generator=g)
    >>> scores, rows = index.search(features, k=10)   # rows of ``weight``, [B, 10] each
    >>> recall_at_k(rows, blocked_topk(features, weight, 10)[1])
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

_BLOCK = 65_536  # vectors assigned to centroids at once (memory: this x clusters floats)


def default_clusters(rows: int) -> int:
    """``ceil(sqrt(rows))`` clusters: build (``rows x clusters``) and search (``probe x rows /
    clusters`` per query) costs balance around it."""
    return max(1, math.isqrt(max(rows - 1, 0)) + 1)


def _nearest(points: Tensor, centroids: Tensor, half_norms: Tensor) -> Tensor:
    """Index of each point's nearest centroid (L2), ``_BLOCK`` points at a time."""
    out = torch.empty(points.shape[0], dtype=torch.long, device=points.device)
    for start in range(0, points.shape[0], _BLOCK):
        scores = points[start:start + _BLOCK].to(centroids.dtype) @ centroids.t() - half_norms
        out[start:start + _BLOCK] = scores.argmax(dim=1)
    return out


@torch.no_grad()
def kmeans(points: Tensor, clusters: int, iterations: int = 8,
           generator: Optional[torch.Generator] = None) -> Tensor:
    """Centroids ``[clusters, D]`` of ``points`` by Lloyd's algorithm from random distinct points.

    A cluster that loses all its points keeps its centroid (it stays empty or wins some back).
    """
    n = points.shape[0]
    k = min(clusters, n)
    start = torch.randperm(n, generator=generator)[:k].to(points.device)
    centroids = points[start].clone()
    for _ in range(iterations):
        assign = _nearest(points, centroids, 0.5 * (centroids * centroids).sum(1))
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(centroids).index_add_(0, assign, points)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None].to(points.dtype)
    return centroids


class ClusteredIndex:
    """k-means clusters of ``vectors`` (rows of a class slice) searched ``probe`` at a time.

    Args:
        vectors: ``[n, D]`` class vectors (a snapshot; the index keeps its own reordered copy).
        clusters: lists to build (at most ``n``).
        probe: clusters each query searches (at most ``clusters``).
        iterations: k-means iterations.
        sample_per_cluster: k-means trains on at most this many points per cluster.
        generator: seeds the k-means sample and its starting centroids.
    """

    def __init__(self, vectors: Tensor, clusters: int, probe: int, iterations: int = 8,
                 sample_per_cluster: int = 64, generator: Optional[torch.Generator] = None) -> None:
        if clusters < 1 or probe < 1:
            raise ValueError(f"clustered index: need clusters >= 1 and probe >= 1, "
                             f"got {clusters} and {probe}")
        vectors = vectors.detach()
        n = vectors.shape[0]
        self.rows = n
        self.clusters = min(clusters, max(n, 1))
        self.probe = min(probe, self.clusters)
        if n == 0:
            self.centroids = vectors.new_zeros((1, vectors.shape[1]), dtype=torch.float32)
            self.half_norms = vectors.new_zeros(1, dtype=torch.float32)
            self.sorted = vectors
            self.ids = torch.zeros(0, dtype=torch.long, device=vectors.device)
            self.offsets = torch.zeros(2, dtype=torch.long)
            return
        # Inner products as distances (Bachrach et al., 2014): each vector gets one more
        # coordinate, sqrt(M^2 - |w|^2) with M the largest norm, and a query a 0 there; then
        # |q - w'|^2 = |q|^2 + M^2 - 2 q.w, so the nearest vectors are the best-scoring classes,
        # and the lists are clusters of that space, ranked for a query by q.c - |c'|^2 / 2.
        # (a bfloat16 slice stays bfloat16; k-means and the scores work in float32 by block)
        norms = torch.cat([v.float().pow(2).sum(1) for v in vectors.split(_BLOCK)])
        lift = (norms.max() - norms).clamp(min=0).sqrt()[:, None]
        points = torch.cat([vectors, lift.to(vectors.dtype)], dim=1)
        sample_size = min(n, sample_per_cluster * self.clusters)
        if sample_size < n:
            sample = torch.randperm(n, generator=generator)[:sample_size].to(vectors.device)
            train = points[sample].float()
        else:
            train = points.float()
        centroids = kmeans(train, self.clusters, iterations, generator)
        self.clusters = centroids.shape[0]
        self.probe = min(self.probe, self.clusters)
        self.half_norms = 0.5 * (centroids * centroids).sum(1)
        assign = _nearest(points, centroids, self.half_norms)
        del points, train
        self.centroids = centroids[:, :vectors.shape[1]].contiguous()
        self.ids = torch.sort(assign, stable=True).indices  # rows of vectors, cluster by cluster
        self.sorted = vectors[self.ids]
        sizes = torch.bincount(assign, minlength=self.clusters).cpu()
        self.offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])

    @property
    def sizes(self) -> Tensor:
        """Classes per cluster."""
        return self.offsets.diff()

    @torch.no_grad()
    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(scores, rows)``, ``[B, k]`` each: each query's best ``k`` classes among its probed
        clusters' (rows of the indexed vectors; ``(-inf, -1)`` where fewer than ``k`` found)."""
        b, p = queries.shape[0], self.probe
        scores = queries.new_full((b, p, k), -math.inf)
        rows = torch.full((b, p, k), -1, dtype=torch.long, device=queries.device)
        if self.rows == 0 or b == 0 or k == 0:
            return scores[:, 0], rows[:, 0]
        nearest = queries @ self.centroids.t() - self.half_norms  # -|q - c'|^2 / 2 + const
        probes = nearest.topk(p, dim=1).indices  # [B, P]
        flat = probes.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # (query, slot) pairs grouped by cluster
        touched, counts = torch.unique_consecutive(flat[order], return_counts=True)
        pair_query = order // p
        offsets = self.offsets.tolist()
        first = 0
        for cluster, count in zip(touched.tolist(), counts.tolist()):
            pairs = order[first:first + count]
            first += count
            lo, hi = offsets[cluster], offsets[cluster + 1]
            if hi == lo:
                continue
            top = min(k, hi - lo)
            members = self.sorted[lo:hi].to(queries.dtype)
            s, c = (queries[pair_query[first - count:first]] @ members.t()).topk(
                top, dim=1)
            scores.view(b * p, k)[pairs, :top] = s
            rows.view(b * p, k)[pairs, :top] = self.ids[lo + c]
        best, where = scores.view(b, p * k).topk(min(k, p * k), dim=1)
        return best, rows.view(b, p * k).gather(1, where)


def recall_at_k(found: Tensor, exact: Tensor) -> float:
    """Mean over queries of ``|found ∩ exact| / |exact|`` (ids ``-1`` are padding)."""
    hits = ((found[:, :, None] == exact[:, None, :]) & (exact[:, None, :] >= 0)).any(dim=1)
    wanted = (exact >= 0).sum(dim=1).clamp(min=1)
    return float((hits.sum(dim=1) / wanted).mean()) if exact.numel() else 1.0
