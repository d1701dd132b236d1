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
  are scored exactly (one matmul for all the queries probing it). No top-k runs over those
  scores (on CPU it cost as much as the matmul): a lower bound of each query's ``k``-th best
  score, from a few of its candidates, skips the probed clusters that cannot reach it (centroid
  score plus the query's norm times the cluster's radius) and keeps only the scores that do;
  the few kept are merged per query. The result is the exact top-k of the probed clusters.

Written in torch (no FAISS): it runs on the head's device (CPU here, CUDA on GPUs) and, being
deterministic for a given generator, a resumed run rebuilds the same index.

Example:
    >>> index = ClusteredIndex(weight, clusters=1024, probe=64, generator=g)
    >>> scores, rows = index.search(features, k=10)   # rows of ``weight``, [B, 10] each
    >>> recall_at_k(rows, blocked_topk(features, weight, 10)[1])
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

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


def _means_and_radii(members: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    """Each cluster's mean ``[clusters, D]`` and largest distance from it ``[clusters]`` (float32),
    for ``members`` stored cluster by cluster (``sizes`` rows each), ``_BLOCK`` rows at a time."""
    cluster = torch.repeat_interleave(torch.arange(len(sizes), device=members.device), sizes)
    sums = members.new_zeros((len(sizes), members.shape[1]), dtype=torch.float32)
    for start in range(0, members.shape[0], _BLOCK):
        sums.index_add_(0, cluster[start:start + _BLOCK], members[start:start + _BLOCK].float())
    means = sums / sizes.clamp(min=1)[:, None]
    radii = torch.zeros(len(sizes), dtype=torch.float32, device=members.device)
    for start in range(0, members.shape[0], _BLOCK):
        at = cluster[start:start + _BLOCK]
        far = (members[start:start + _BLOCK].float() - means[at]).norm(dim=1)
        radii.scatter_reduce_(0, at, far, "amax")
    return means, radii


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
            self.means = self.centroids
            self.radii, self.max_norm = self.half_norms, 0.0
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
        self.max_norm = float(norms.max().sqrt())
        self.means, self.radii = _means_and_radii(self.sorted, sizes.to(vectors.device))

    @property
    def sizes(self) -> Tensor:
        """Classes per cluster."""
        return self.offsets.diff()

    @torch.no_grad()
    def search(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """``(scores, rows)``, ``[B, k]`` each: each query's best ``k`` classes among its probed
        clusters' (rows of the indexed vectors, best first; ``(-inf, -1)`` where fewer than ``k``
        found).

        Exact over the probed clusters, without a top-k over every score (on CPU that costs as
        much as the products): each query carries a lower bound of its ``k``-th best score
        (:meth:`_lower_bound`); a probed cluster whose centroid score plus ``|q| x`` radius is
        below it is skipped, and of a scored cluster only the scores reaching it are kept.
        """
        b = queries.shape[0]
        if self.rows == 0 or b == 0 or k == 0:
            return (queries.new_full((b, k), -math.inf),
                    torch.full((b, k), -1, dtype=torch.long, device=queries.device))
        probes = (queries @ self.centroids.t() - self.half_norms).topk(self.probe, dim=1).indices
        # a float32 rounding margin: a score computed by products of other shapes may differ
        margin = 1e-4 * queries.norm(dim=1) * self.max_norm
        # the most a member of a probed cluster can score: q.mean + |q| radius
        reach = ((queries @ self.means.t()).gather(1, probes)
                 + queries.norm(dim=1, keepdim=True) * self.radii[probes] + margin[:, None])
        theta = self._lower_bound(queries, probes, k) - margin
        scores, rows = _best_k(*self._scan(queries, probes, reach, theta), b, k)
        return scores, torch.where(rows >= 0, self.ids[rows.clamp(min=0)], rows)

    def _scan(self, queries: Tensor, probes: Tensor, reach: Tensor,
              theta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(query, score, row)`` of every member of the ``probes`` clusters (row of ``sorted``)
        scoring at least its query's ``theta``; clusters whose ``reach`` is below it unscored."""
        pair_query, slot = (reach >= theta[:, None]).nonzero(as_tuple=True)
        # the pairs cluster by cluster, each query's vector and bound gathered once
        clusters = probes[pair_query, slot]
        order = torch.sort(clusters, stable=True).indices
        pair_query = pair_query[order]
        pair_vectors, pair_theta = queries[pair_query], theta[pair_query]
        found: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        for lo, hi, a, z in self._spans(clusters[order]):
            s = pair_vectors[a:z] @ self.sorted[lo:hi].to(queries.dtype).t()
            hit = (s.amax(dim=1) >= pair_theta[a:z]).nonzero().squeeze(1)
            if len(hit):
                s = s[hit]
                i, j = (s >= pair_theta[a:z][hit, None]).nonzero(as_tuple=True)
                for out, part in zip(found, (hit[i] + a, s[i, j], j + lo)):
                    out.append(part)
        if not found[0]:
            return pair_query[:0], queries.new_empty(0), pair_query[:0]
        return pair_query[torch.cat(found[0])], torch.cat(found[1]), torch.cat(found[2])

    def _spans(self, clusters: Tensor) -> Iterator[tuple[int, int, int, int]]:
        """For ``clusters`` in ascending order: ``(lo, hi, a, z)`` of each cluster with members,
        ``sorted[lo:hi]`` its members and ``clusters[a:z]`` its entries."""
        touched, counts = torch.unique_consecutive(clusters, return_counts=True)
        offsets, a = self.offsets.tolist(), 0
        for cluster, count in zip(touched.tolist(), counts.tolist()):
            lo, hi = offsets[cluster], offsets[cluster + 1]
            if hi > lo:
                yield lo, hi, a, a + count
            a += count

    def _lower_bound(self, queries: Tensor, probes: Tensor, k: int) -> Tensor:
        """``[B]``: at most each query's ``k``-th best score among its probed clusters' members
        (``-inf``: fewer than ``k``), the larger of two such bounds: the ``k``-th best of the
        first ``k`` members of every probed cluster, and the ``k``-th best of the nearest one."""
        b = queries.shape[0]
        slot = torch.arange(k, device=queries.device)
        present = slot < self.sizes[:, None].to(queries.device)  # [clusters, k]
        first_rows = torch.where(present, self.offsets[:-1, None].to(slot.device) + slot, 0)
        scores = queries @ self.sorted[first_rows.reshape(-1)].to(queries.dtype).t()
        probed = torch.zeros(b, self.clusters, dtype=torch.bool, device=queries.device)
        probed.scatter_(1, probes, True)
        scores.masked_fill_(~(probed[:, :, None] & present).reshape(b, -1), -math.inf)
        theta = scores.topk(min(k, scores.shape[1]), dim=1).values[:, -1]
        nearest = probes[:, 0]
        order = torch.sort(nearest, stable=True).indices
        for lo, hi, a, z in self._spans(nearest[order]):
            if hi - lo >= k:
                who = order[a:z]
                best = (queries[who] @ self.sorted[lo:hi].to(queries.dtype).t()).topk(k, dim=1)
                theta[who] = torch.maximum(theta[who], best.values[:, -1])
        return theta


def _best_k(query: Tensor, score: Tensor, row: Tensor, b: int, k: int) -> tuple[Tensor, Tensor]:
    """``(scores, rows)`` ``[b, k]``: each query's ``k`` best of the ``(query, score, row)``
    found, best first (ties in the order found); ``(-inf, -1)`` where fewer."""
    order = torch.sort(score, descending=True, stable=True).indices
    order = order[torch.sort(query[order], stable=True).indices]
    query, score, row = query[order], score[order], row[order]
    counts = torch.bincount(query, minlength=b)
    place = torch.arange(len(query), device=query.device) - (counts.cumsum(0) - counts)[query]
    keep = place < k
    scores = score.new_full((b, k), -math.inf)
    rows = torch.full((b, k), -1, dtype=torch.long, device=score.device)
    scores[query[keep], place[keep]] = score[keep]
    rows[query[keep], place[keep]] = row[keep]
    return scores, rows


def recall_at_k(found: Tensor, exact: Tensor) -> float:
    """Mean over queries of ``|found ∩ exact| / |exact|`` (ids ``-1`` are padding)."""
    hits = ((found[:, :, None] == exact[:, None, :]) & (exact[:, None, :] >= 0)).any(dim=1)
    wanted = (exact >= 0).sum(dim=1).clamp(min=1)
    return float((hits.sum(dim=1) / wanted).mean()) if exact.numel() else 1.0
