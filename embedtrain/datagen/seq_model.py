"""The planted model behind ``embedtrain datagen seq``: its spec, sampling, and the exact oracle.

:class:`SeqDataSpec` describes the data set; :class:`SeqPlantedModel` draws users' event
sequences from it and ranks the next item of a history the Bayes-optimal way
(:meth:`SeqPlantedModel.oracle_topk`), from which :mod:`embedtrain.datagen.seq` computes the
oracle HR@10 / NDCG@10 written to ``metadata.json``. NumPy only (no torch).

Item ids are ``1..N``; arrays indexed by item have ``N + 1`` rows, row 0 (padding) all zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from embedtrain.datagen.ctr import check_fields, is_real
from embedtrain.utils import is_int

TOP_K = 10                     # the oracle ranks the top 10 (HR@10, NDCG@10)
TRANSITIONS = ("item", "cluster")  # what a successor is: an item, or a cluster of items
FIRST_POP = 0.5                # first event: FIRST_POP * pop_z + (1 - FIRST_POP) * g
_CANDIDATE_CELLS = 1 << 22     # oracle rows scored together x candidates per row (memory bound)


@dataclass(frozen=True)
class SeqDataSpec:
    """Knobs of the synthetic sequential-recommendation data set; validated on construction.

    ``successor_prob`` + ``interest_prob`` + ``global_prob`` (``a``, ``b``, ``c``) must sum to 1:
    the next item follows the previous one's successors, the user's interest cluster, or global
    popularity. ``transition`` says what a successor is: ``item`` (each item has ``successors``
    successor items, a sparse Markov chain over the items) or ``cluster`` (each cluster has
    ``successors`` successor clusters, never itself, and the next item is drawn from the chosen
    one's popularity: a sparse Markov chain over the item clusters; ``successor_locality`` is
    not used). Bad values raise a one-line ``ValueError`` naming the field.
    """

    users: int = 100_000
    items: int = 50_000                   # item ids 1..items (0 is padding)
    clusters: int = 50                    # K interest clusters of (nearly) equal size
    min_length: int = 5                   # events per user, at least
    max_length: int = 50                  # L: history length kept in the splits' rows
    max_events: int = 200                 # events per user, at most
    mean_extra_events: float = 15.0       # mean of the geometric count above min_length
    successors: int = 4                   # S successors per item, weights S..1 (normalised)
    successor_locality: float = 0.8       # a successor comes from the item's own cluster
    transition: str = "item"              # item | cluster: successor items or clusters
    successor_prob: float = 0.5           # a
    interest_prob: float = 0.35           # b
    global_prob: float = 0.15             # c
    item_zipf_a: float = 1.0              # within-cluster popularity ~ rank**-a
    cluster_zipf_a: float = 0.5           # cluster weights ~ rank**-a
    seed: int = 0
    rows_per_row_group: int = 65_536
    rows_per_file: int = 1_000_000        # a split larger than this gets several part files

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message naming the first bad field."""
        per_cluster = max(TOP_K, self.successors + 1) if is_int(self.successors) else TOP_K
        prob = (is_real, lambda v: 0 < v < 1, "in (0, 1)")
        checks = [
            ("users", is_int, lambda v: v >= 10, "an integer >= 10"),
            ("clusters", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("successors", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("transition", lambda v: isinstance(v, str), lambda v: v in TRANSITIONS,
             f"one of {', '.join(TRANSITIONS)}"),
            ("items", is_int, lambda v: v >= per_cluster * self.clusters,
             f"an integer >= {per_cluster} * clusters (= {per_cluster * self.clusters}: at "
             f"least max(10, successors + 1) items per cluster)"),
            ("max_events", is_int, lambda v: v >= 3, "an integer >= 3"),
            ("min_length", is_int, lambda v: 3 <= v <= self.max_events,
             f"an integer in [3, max_events={self.max_events}]"),
            ("max_length", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("mean_extra_events", is_real, lambda v: 0 <= v < math.inf,
             "non-negative and finite"),
            ("successor_locality", is_real, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("successor_prob", *prob),
            ("interest_prob", *prob),
            ("global_prob", *prob),
            ("item_zipf_a", is_real, lambda v: 0 < v < math.inf, "positive and finite"),
            ("cluster_zipf_a", is_real, lambda v: 0 <= v < math.inf, "non-negative and finite"),
            ("seed", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("rows_per_row_group", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("rows_per_file", is_int, lambda v: v >= 1, "an integer >= 1"),
        ]
        check_fields(self, checks)
        if self.transition == "cluster" and self.successors >= self.clusters:
            raise ValueError(f"SeqDataSpec.successors must be < clusters (= {self.clusters}) "
                             f"with transition 'cluster', got {self.successors!r}")
        total = self.successor_prob + self.interest_prob + self.global_prob
        if abs(total - 1) > 1e-9:
            raise ValueError("SeqDataSpec.successor_prob + SeqDataSpec.interest_prob + "
                             "SeqDataSpec.global_prob must sum to 1, "
                             f"got {total!r}")


def _zipf_pmf(n: int, a: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -a
    return w / w.sum()


class SeqChunk(NamedTuple):
    """Some users' full event sequences: ``items[offsets[i]:offsets[i + 1]]`` is user
    ``first_user + i``'s, oldest first; ``interest`` their latent clusters."""

    first_user: int
    interest: np.ndarray   # (n,) int64
    offsets: np.ndarray    # (n + 1,) int64
    items: np.ndarray      # int64, ids in 1..N


class SeqPlantedModel:
    """Clusters, popularities, successors and cluster weights, all derived from the spec's seed.

    Attributes (``N`` items, ``K`` clusters, ``S`` successors; item arrays have ``N + 1`` rows,
    row 0 the padding): ``cluster`` and ``rank`` (within-cluster popularity rank, 0 the most
    popular), ``pop`` (``pop_cluster(j)(j)``), ``g`` (global popularity), ``succ`` (N + 1, S)
    successor items (``transition: item``; (N + 1, 0) otherwise) or ``cluster_succ`` (K, S)
    successor clusters (``transition: cluster``; (K, 0) otherwise), ``succ_weight`` (S,),
    ``weight`` (K,) the cluster weights ``w``; for the oracle ``pool`` (K, 10), each cluster's 10
    most popular items.
    """

    def __init__(self, spec: SeqDataSpec):
        self.spec = spec
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0]))
        N, K, S = spec.items, spec.clusters, spec.successors
        self.num_items, self.num_clusters = N, K
        self.a, self.b, self.c = spec.successor_prob, spec.interest_prob, spec.global_prob
        # Clusters and within-cluster ranks: position i of a random permutation of the items
        # is in cluster i mod K with rank i // K (sizes differ by at most one).
        perm = rng.permutation(N).astype(np.int64) + 1
        pos = np.arange(N, dtype=np.int64)
        self.cluster = np.zeros(N + 1, np.int64)
        self.rank = np.zeros(N + 1, np.int64)
        self.cluster[perm], self.rank[perm] = pos % K, pos // K
        self.weight = np.empty(K)
        self.weight[rng.permutation(K)] = _zipf_pmf(K, spec.cluster_zipf_a)
        raw = np.zeros(N + 1)
        raw[1:] = (self.rank[1:] + 1.0) ** -spec.item_zipf_a
        norm = np.bincount(self.cluster[1:], weights=raw[1:], minlength=K)
        self.pop = raw / norm[self.cluster]
        self.pop[0] = 0.0
        self.g = self.weight[self.cluster] * self.pop
        # Items by (cluster, rank): cluster k is by_cluster[start[k]:start[k + 1]], best first.
        self.by_cluster = np.lexsort((self.rank[1:], self.cluster[1:])).astype(np.int64) + 1
        size = np.bincount(self.cluster[1:], minlength=K)
        self.start = np.concatenate([[0], np.cumsum(size)]).astype(np.int64)
        self.size = size
        # Sampling tables: cluster k's pop CDF shifted by k (one monotone array for all
        # clusters), the global CDF, the cluster-weight CDF.
        self._pop_key = self.cluster[self.by_cluster] + np.concatenate(
            [np.cumsum(self.pop[self.by_cluster[lo:hi]]) for lo, hi in zip(self.start[:-1],
                                                                           self.start[1:])])
        self._g_cdf = np.cumsum(self.g[1:])
        self._w_cdf = np.cumsum(self.weight)
        self.succ_weight = np.arange(S, 0, -1, dtype=np.float64) / (S * (S + 1) / 2)
        self._succ_cdf = np.cumsum(self.succ_weight)
        if spec.transition == "item":
            self.succ, self.cluster_succ = self._draw_successors(rng), np.zeros((K, 0), np.int64)
        else:
            self.succ = np.zeros((N + 1, 0), np.int64)
            self.cluster_succ = np.stack([rng.choice(np.delete(np.arange(K), k), S, replace=False)
                                          for k in range(K)])
        # transfer[k, k']: the weight of cluster k' among cluster k's successors
        self.transfer = np.zeros((K, K))
        np.add.at(self.transfer, (np.arange(K)[:, None], self.cluster_succ),
                  self.succ_weight[: self.cluster_succ.shape[1]])
        # The oracle's pool: every cluster's TOP_K most popular items (sizes are >= TOP_K).
        self.pool = self.by_cluster[self.start[:-1, None] + np.arange(TOP_K)]
        self.pool_pos = np.full(N + 1, -1, np.int64)
        self.pool_pos[self.pool.ravel()] = np.arange(K * TOP_K)

    def _draw_successors(self, rng: np.random.Generator) -> np.ndarray:
        """(N + 1, S) successors: slot by slot, each from the item's cluster with probability
        ``successor_locality`` (uniform) else uniform over all items, redrawn until it is neither
        the item nor an earlier slot's successor."""
        N, S = self.num_items, self.spec.successors
        succ = np.zeros((N + 1, S), np.int64)
        item = np.arange(1, N + 1, dtype=np.int64)
        for s in range(S):
            todo = np.arange(N)
            while len(todo):
                j = item[todo]
                k = self.cluster[j]
                local = rng.random(len(todo)) < self.spec.successor_locality
                inside = self.by_cluster[self.start[k] + (rng.random(len(todo))
                                                          * self.size[k]).astype(np.int64)]
                anywhere = rng.integers(1, N + 1, size=len(todo))
                pick = np.where(local, inside, anywhere)
                bad = (pick == j) | (succ[j, :s] == pick[:, None]).any(axis=1)
                succ[j[~bad], s] = pick[~bad]
                todo = todo[bad]
        return succ

    # -- sampling -------------------------------------------------------------------------------

    def _from_cluster(self, z: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Items drawn from ``pop_z`` for each cluster in ``z``, by uniforms ``u``."""
        i = np.searchsorted(self._pop_key, z + u, side="right")
        i = np.clip(i, self.start[z], self.start[z + 1] - 1)   # float round-off at a boundary
        return self.by_cluster[i]

    def _from_global(self, u: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self._g_cdf, u * self._g_cdf[-1], side="right")
        return np.minimum(i, self.num_items - 1) + 1

    def draw(self, rng: np.random.Generator, first_user: int, n: int) -> SeqChunk:
        """``n`` users' sequences (see :mod:`embedtrain.datagen.seq`), all drawn from ``rng``."""
        spec = self.spec
        u = rng.random(n) * self._w_cdf[-1]
        z = np.minimum(np.searchsorted(self._w_cdf, u, side="right"), self.num_clusters - 1)
        extra = rng.geometric(1.0 / (1.0 + spec.mean_extra_events), size=n) - 1
        length = np.minimum(spec.min_length + extra, spec.max_events).astype(np.int64)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(length, out=offsets[1:])
        x = np.zeros(offsets[-1], np.int64)
        order = np.argsort(-length, kind="stable")   # longest first: the active users, a prefix
        start, zs, desc = offsets[:-1][order], z[order], length[order]
        comp, v = rng.random(n), rng.random(n)
        x[start] = np.where(comp < FIRST_POP, self._from_cluster(zs, v), self._from_global(v))
        for t in range(1, int(desc[0]) if n else 0):
            m = int(np.searchsorted(-desc, -t, side="left"))  # users with length > t
            at = start[:m] + t
            prev = x[at - 1]
            comp, v = rng.random(m), rng.random(m)
            out = np.empty(m, np.int64)
            s = comp < self.a
            slot = np.minimum(np.searchsorted(self._succ_cdf, v[s] * self._succ_cdf[-1],
                                              side="right"), spec.successors - 1)
            if spec.transition == "item":
                out[s] = self.succ[prev[s], slot]
            else:  # an item of the successor cluster, by its popularity (a draw of its own)
                out[s] = self._from_cluster(self.cluster_succ[self.cluster[prev[s]], slot],
                                            rng.random(int(s.sum())))
            p = ~s & (comp < self.a + self.b)
            out[p] = self._from_cluster(zs[:m][p], v[p])
            q = ~s & ~p
            out[q] = self._from_global(v[q])
            x[at] = out
        return SeqChunk(first_user, z.astype(np.int64), offsets, x)

    # -- the oracle -----------------------------------------------------------------------------

    def event_evidence(self, offsets: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Per event ``x_t``: ``log P(x_t | .., k = cluster(x_t)) - log P(x_t | .., k')`` for any
        other ``k'`` (the same for all of them); what the event adds to its cluster's log
        posterior."""
        first = np.zeros(len(items), bool)
        first[offsets[:-1][np.diff(offsets) > 0]] = True
        prev = np.concatenate([[0], items[:-1]])
        prev[first] = 0
        a_term = self.a * self.successor_probs(prev, items[:, None])[:, 0]
        pop, g = self.pop[items], self.g[items]
        later = np.log1p(self.b * pop / (a_term + self.c * g))
        return np.where(first, np.log1p(pop / g), later)  # first: (.5 pop + .5 g) / (.5 g)

    def posterior(self, rows: np.ndarray, clusters: np.ndarray, evidence: np.ndarray,
                  n_rows: int) -> np.ndarray:
        """(n_rows, K) posteriors over the interest cluster from per-event ``evidence`` of the
        events' ``clusters``, an event of row ``rows[i]`` each."""
        K = self.num_clusters
        log = np.bincount(rows * K + clusters, weights=evidence, minlength=n_rows * K)
        log = log.reshape(n_rows, K) + np.log(self.weight)
        log -= log.max(axis=1, keepdims=True)
        post = np.exp(log)
        return post / post.sum(axis=1, keepdims=True)

    def successor_probs(self, prev: np.ndarray, items: np.ndarray) -> np.ndarray:
        """``succ(prev[r])[items[r, i]]``, (R, M): the successor component's probability of each
        candidate after ``prev`` (R,) (the padding id 0 as ``prev``: 0, or garbage in
        ``transition: cluster``, where callers mask first events)."""
        if self.spec.transition == "item":
            follow = self.succ[prev][:, None, :] == items[:, :, None]   # row 0 (padding) never
            return (follow * self.succ_weight).sum(axis=2)
        return self.transfer[self.cluster[prev][:, None], self.cluster[items]] * self.pop[items]

    def next_probs(self, post: np.ndarray, last: np.ndarray, items: np.ndarray) -> np.ndarray:
        """``P(next = items[r, i] | history r)`` for posteriors ``post`` (R, K), last items
        ``last`` (R,) and candidate ``items`` (R, M)."""
        a_term = self.a * self.successor_probs(last, items)
        post_c = np.take_along_axis(post, self.cluster[items], axis=1)
        return a_term + self.b * post_c * self.pop[items] + self.c * self.g[items]

    def oracle_topk(self, post: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The Bayes-optimal top 10 of each history, given its cluster posterior and last item.

        Exact without scoring all ``N`` items: an item that is neither a successor of ``last``
        nor among its cluster's 10 most popular scores strictly less than each of those 10
        (same cluster posterior, smaller ``pop`` and ``g``), so the ``S + 10 K`` candidates hold
        the top 10. With ``transition: cluster`` every score is ``pop(j)`` times a factor of
        ``cluster(j)``, so the ``10 K`` pool items alone hold it. Ties rank the smaller item id
        first.

        Args:
            post: (R, K) posteriors over the user's interest cluster.
            last: (R,) the histories' last items.

        Returns:
            ``(items, probs)``, both (R, 10), best first.
        """
        R, S = len(last), self.succ.shape[1]
        out_i, out_p = np.empty((R, TOP_K), np.int64), np.empty((R, TOP_K))
        step = max(1, _CANDIDATE_CELLS // (S + self.pool.size))
        for lo in range(0, R, step):
            hi = min(lo + step, R)
            out_i[lo:hi], out_p[lo:hi] = self._topk(post[lo:hi], last[lo:hi])
        return out_i, out_p

    def _topk(self, post: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        R, S = len(last), self.succ.shape[1]                # S = 0: transition cluster
        succ, pool = self.succ[last], self.pool.ravel()
        neg = np.empty((R, S + len(pool)))                  # minus the candidates' scores
        neg[:, :S] = self.next_probs(post, last, succ)
        if S:  # a pool item's successor term, if any, is its successor column's
            neg[:, S:] = (self.b * post[:, self.cluster[pool]] * self.pop[pool]
                          + self.c * self.g[pool])
        else:
            neg[:, S:] = self.next_probs(post, last, np.broadcast_to(pool, (R, len(pool))))
        np.negative(neg, out=neg)
        rr, ss = np.nonzero(self.pool_pos[succ] >= 0)        # a successor in the pool:
        neg[rr, S + self.pool_pos[succ[rr, ss]]] = np.inf    # its successor column counts

        def item(r: np.ndarray, col: np.ndarray) -> np.ndarray:
            if not S:
                return pool[col]
            return np.where(col < S, succ[r, np.minimum(col, S - 1)], pool[np.maximum(col - S, 0)])

        rows = np.arange(R)[:, None]
        best = np.argpartition(neg, TOP_K, axis=1)[:, : TOP_K + 1]
        top_s, top_i = np.take_along_axis(neg, best, 1), item(rows, best)
        order = np.lexsort((top_i, top_s))
        top_s, top_i = np.take_along_axis(top_s, order, 1), np.take_along_axis(top_i, order, 1)
        for r in np.flatnonzero(top_s[:, TOP_K - 1] == top_s[:, TOP_K]):  # a tie at the cut
            every = item(np.full(neg.shape[1], r), np.arange(neg.shape[1]))
            o = np.lexsort((every, neg[r]))[:TOP_K]
            top_i[r, :TOP_K], top_s[r, :TOP_K] = every[o], neg[r, o]
        return top_i[:, :TOP_K], -top_s[:, :TOP_K]


def rank_metrics(top: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: HR@k (1.0 if ``target`` is in ``top``, (R, k) best first) and NDCG@k
    (``1 / log2(rank + 1)`` at its 1-based rank, else 0)."""
    hit = top == target[:, None]
    rank = np.argmax(hit, axis=1) + 1
    found = hit.any(axis=1)
    return found.astype(np.float64), np.where(found, 1.0 / np.log2(rank + 1.0), 0.0)


def planted_description(spec: SeqDataSpec) -> str:
    """One-line human description of the planted sequence model."""
    S = spec.successors
    return (f"{spec.items} items in {spec.clusters} equal clusters; within a cluster popularity "
            f"pop_k ~ Zipf(a={spec.item_zipf_a}) over a random order, cluster weights w ~ "
            f"Zipf(a={spec.cluster_zipf_a}), global popularity g(j) = w_cluster(j) pop(j); "
            + (f"each item has {S} distinct successors with weights {S}..1 (normalised), each "
               f"from its cluster with probability {spec.successor_locality} else from all items"
               if spec.transition == "item" else
               f"each cluster has {S} distinct successor clusters (not itself) with weights "
               f"{S}..1 (normalised), succ(previous) = the popularity of one of its cluster's")
            + f"; a user has "
            f"an interest cluster z ~ w, first item ~ {FIRST_POP} pop_z + {1 - FIRST_POP} g, "
            f"then next ~ {spec.successor_prob} succ(previous) + {spec.interest_prob} pop_z + "
            f"{spec.global_prob} g; events per user = {spec.min_length} + Geometric(mean "
            f"{spec.mean_extra_events}), at most {spec.max_events}")
