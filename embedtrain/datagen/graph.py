"""Deterministic synthetic graphs with planted communities (a degree-corrected block model).

The node labels are the communities; the graph carries most of the signal and the node features
only part of it, so a GNN has something to find that an MLP on the features alone cannot. The
metadata records how much: the edges' homophily, the accuracy of the Bayes-optimal classifier on
the features alone, and that of a Bayes classifier that also sees the one-hop neighbours'
features.

The generative model (all parameters derived from the spec's seed):

- ``K`` communities of sizes ``~ rank**-community_size_exponent`` (0: equal), assigned to random
  nodes. The label of a node is its community.
- Node propensities ``theta ~ Pareto`` with tail index ``degree_exponent - 1`` (so expected
  degrees follow a power law ``P(k) ~ k**-degree_exponent``), capped at the structural cut-off
  (an expected degree of ``sqrt(N * avg_degree)``, beyond which multi-edges would swamp a node)
  and normalised to mean 1 within each community.
- ``E = N * avg_degree / 2`` undirected edges: the first endpoint ``u`` is drawn over all nodes
  ``~ theta``; with probability ``1 - mixing`` the second endpoint is drawn within ``u``'s
  community ``~ theta``, else from another community (chosen by size) ``~ theta``. Self-loops and
  repeated edges are dropped (counted), so the graph has slightly fewer edges than drawn and a
  homophily slightly below ``1 - mixing``.
- Features (``features``), either
  ``gaussian`` (the default): ``x = mu_label + feature_noise * N(0, I)``, ``mu_k`` random unit
  vectors, drawn in float32 and stored as ``feature_dtype`` (float32, or float16: the same draws
  rounded, half the bytes; the Bayes figures are computed on the stored values). The
  Bayes-optimal classifier on features alone picks ``argmax_k log pi_k + <mu_k, x> /
  feature_noise**2``; with the defaults (16 communities, 32 dims, noise 0.5) it is right ~57% of
  the time, against ~90% for the one-hop Bayes classifier (average degree 10);
  or ``bow``: sparse bag-of-words rows as in a citation graph, ``words_per_node`` distinct words
  of a ``vocab``-word vocabulary stored as 0/1 floats (``vocab`` columns; ``feature_dim`` and
  ``feature_noise`` unused), whose distribution mixes a Zipfian background common to all
  communities with the community's topic words (``topic_share`` of the weight;
  :class:`~embedtrain.datagen.graph_words.TopicWords`). Their likelihood is exact, so the Bayes
  figures below keep their meaning: with 7 communities, 1,433 words, 18 words a node and the
  default ``topic_share`` 0.15, the feature-only Bayes classifier is right ~67% of the time.
- Node splits are random; ``link_fraction`` of the distinct edges are held out (half valid, half
  test) as link-prediction positives and are not in the CSR.

The draws are vectorised: endpoint counts per node come from one multinomial and are expanded
with ``np.repeat``, shuffled once, and matched to second endpoints drawn the same way per
community; no step loops over edges or nodes. On two loaded cores, 1M nodes with average degree
20 (20M CSR entries) generate in ~12 s with a peak RSS of 1.1 GB; 10M nodes (200M CSR entries)
in ~105 s with 4.0 GB (the edge keys of :func:`~embedtrain.graph.csr.csr_from_edges`
dominate).

Example:
    >>> from embedtrain.datagen import GraphDataSpec, generate_graph
    >>> meta = generate_graph(GraphDataSpec(nodes=20_000, seed=1), "/tmp/graph", progress=False)
    >>> meta["num_classes"], meta["generator"]["homophily"] > 0.6
    (16, True)
"""

from __future__ import annotations

import math
import enum
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
from tqdm import tqdm

from embedtrain.datagen.ctr import check_fields, is_real
from embedtrain.datagen.graph_words import (
    BACKGROUND_ZIPF_A, MAX_TABLE_CELLS, MAX_WORDS, TopicWords, topic_size)
from embedtrain.graph.csr import csr_from_edges, hold_out_edges, row_blocks
from embedtrain.graph.csr_external import (
    ENTRY_BYTES,
    ScratchDir,
    csr_from_edge_chunks,
    memory_budget,
)
from embedtrain.graph.store import FeatureDtype, FeatureRangeError, cast_features, write_graph
from embedtrain.utils import is_int, phase_bar

_FEATURE_CHUNK = 1 << 20     # nodes per feature chunk (also fixes the per-chunk random streams)
_EDGE_CHUNK = 1 << 26        # edges drawn at once (~1.5 GB of working memory at most)
_ONE_HOP_NODES = 20_000      # test nodes scored by the one-hop Bayes classifier
_HILL_TAIL = 0.01            # share of the nodes in the tail of the Hill estimate
_WORD_CHUNK = 1 << 16        # nodes per bag-of-words chunk (V floats a node, drawn word by word)


class NodeFeatures(enum.Enum):
    """What the node features are (``GraphDataSpec.features``)."""

    GAUSSIAN = "gaussian"  # feature_dim dims: the class mean plus Gaussian noise
    BOW = "bow"            # vocab 0/1 columns: words_per_node distinct words of a topic mixture


@dataclass(frozen=True)
class GraphDataSpec:
    """Knobs of the synthetic graph; validated on construction (``ValueError``)."""

    nodes: int = 100_000
    avg_degree: float = 10.0              # expected neighbours per node, before dropped edges
    communities: int = 16                 # = classes
    degree_exponent: float = 2.5          # P(degree k) ~ k**-degree_exponent in the tail
    mixing: float = 0.3                   # share of a node's edges leaving its community
    feature_dim: int = 32
    feature_noise: float = 0.5            # sd of the features around their unit class means
    community_size_exponent: float = 0.0  # sizes ~ rank**-exponent; 0: equal sizes
    seed: int = 0
    valid_fraction: float = 0.1
    test_fraction: float = 0.1
    link_fraction: float = 0.0            # share of edges held out for link prediction
    feature_dtype: FeatureDtype = FeatureDtype.FLOAT32  # the features' type on disk
    features: NodeFeatures = NodeFeatures.GAUSSIAN  # gaussian, or bow (bag-of-words rows)
    vocab: int = 1_433                    # bow: words in the vocabulary (= feature columns)
    words_per_node: int = 18              # bow: distinct words of every node
    topic_share: float = 0.15             # bow: a community's word weight on its topic words

    @property
    def num_features(self) -> int:
        """The stored feature columns: ``vocab`` (bow) or ``feature_dim`` (gaussian)."""
        return self.vocab if self.features is NodeFeatures.BOW else self.feature_dim

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message naming the first bad field."""
        checks = [
            ("nodes", is_int, lambda v: 2 <= v < 2**31, "an integer in [2, 2**31)"),
            ("avg_degree", is_real, lambda v: 0 < v <= self.nodes - 1,
             "positive and at most nodes - 1"),
            ("communities", is_int, lambda v: 1 <= v <= min(self.nodes, 32_767),
             "an integer in [1, min(nodes, 32767)]"),
            ("degree_exponent", is_real, lambda v: 2 < v < math.inf,
             "above 2 (finite mean degree) and finite"),
            ("mixing", is_real, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("feature_dim", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("feature_noise", is_real, lambda v: 0 < v < math.inf, "positive and finite"),
            ("community_size_exponent", is_real, lambda v: 0 <= v < math.inf,
             "non-negative and finite"),
            ("seed", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("valid_fraction", is_real, lambda v: 0 <= v < 1, "in [0, 1)"),
            ("test_fraction", is_real, lambda v: 0 <= v < 1, "in [0, 1)"),
            ("link_fraction", is_real, lambda v: 0 <= v < 1, "in [0, 1)"),
            ("feature_dtype", lambda v: isinstance(v, FeatureDtype), lambda v: True,
             "a FeatureDtype (" + ", ".join(d.value for d in FeatureDtype) + ")"),
            ("features", lambda v: isinstance(v, NodeFeatures), lambda v: True,
             "a NodeFeatures (" + ", ".join(f.value for f in NodeFeatures) + ")"),
        ]
        if self.features is NodeFeatures.BOW:
            checks += [
                ("vocab", is_int, lambda v: 1 <= v < 2**31, "a positive integer"),
                ("words_per_node", is_int, lambda v: 1 <= v <= min(self.vocab, MAX_WORDS),
                 f"an integer in [1, min(vocab, {MAX_WORDS})]"),
                ("topic_share", is_real, lambda v: 0 <= v <= 1, "in [0, 1]"),
            ]
        check_fields(self, checks)
        cells = self.communities * (self.vocab + 1) * (self.words_per_node + 1)
        if self.features is NodeFeatures.BOW and cells > MAX_TABLE_CELLS:
            raise ValueError(f"GraphDataSpec.vocab: communities * (vocab + 1) * (words_per_node "
                             f"+ 1) must be at most {MAX_TABLE_CELLS:,} (the word sampler's "
                             f"tables), got {cells:,}")
        if self.valid_fraction + self.test_fraction >= 1:
            raise ValueError("GraphDataSpec.valid_fraction + test_fraction must be < 1, got "
                             f"{self.valid_fraction + self.test_fraction!r}")
        if self.mixing > 0 and self.communities < 2:
            raise ValueError("GraphDataSpec.mixing must be 0 with a single community, got "
                             f"{self.mixing!r}")


class PlantedGraph:
    """Communities, propensities and class means, all derived from the spec.

    Nodes are also numbered by *position*: community by community (ids ascending within each),
    so that community ``k`` holds positions ``starts[k]:starts[k + 1]``.
    """

    def __init__(self, spec: GraphDataSpec):
        n, k = spec.nodes, spec.communities
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0]))
        share = np.arange(1, k + 1, dtype=np.float64) ** -spec.community_size_exponent
        sizes = np.maximum(np.floor(share / share.sum() * n).astype(np.int64), 1)
        sizes[0] += n - sizes.sum()  # the largest community absorbs the rounding
        self.sizes = sizes
        self.starts = np.zeros(k + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        comm_dtype = np.int16 if k < 2**15 else np.int32
        self.community = rng.permutation(np.repeat(np.arange(k, dtype=comm_dtype), sizes))
        self.by_position = np.argsort(self.community, kind="stable").astype(
            np.int32 if n < 2**31 else np.int64)   # position -> node id
        self.position_community = np.repeat(np.arange(k, dtype=comm_dtype), sizes)
        alpha = spec.degree_exponent - 1
        raw = (1.0 - rng.random(n)) ** (-1.0 / alpha)     # Pareto(alpha), minimum 1
        cutoff = math.sqrt(n * spec.avg_degree)         # structural cut-off of the degrees
        cap = cutoff / spec.avg_degree * (alpha / (alpha - 1))
        self.capped = int(np.count_nonzero(raw > cap))
        raw = np.minimum(raw, cap)
        theta = raw[self.by_position]                     # by position
        means = np.add.reduceat(theta, self.starts[:-1]) / sizes
        self.theta = theta / np.repeat(means, sizes)      # mean 1 in every community
        self.mass = sizes.astype(np.float64)              # sum of theta per community
        self.prior = sizes / n
        self.words: Optional[TopicWords] = None
        if spec.features is NodeFeatures.BOW:  # a stream of its own; the class means unused
            self.words = TopicWords(k, spec.vocab, spec.words_per_node, spec.topic_share,
                                    [spec.seed, 6])
            self.class_means = np.zeros((k, 0), dtype=np.float32)
            return
        mu = rng.standard_normal((k, spec.feature_dim))
        self.class_means = (mu / np.maximum(np.linalg.norm(mu, axis=1, keepdims=True), 1e-12)
                            ).astype(np.float32)

    def draw_edges(self, spec: GraphDataSpec) -> tuple[np.ndarray, np.ndarray]:
        """``E = N * avg_degree / 2`` undirected edges as ``(src, dst)`` node ids (all chunks of
        :meth:`edge_chunks` together)."""
        parts = list(self.edge_chunks(spec))
        if len(parts) == 1:
            return parts[0]
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def edge_chunks(self, spec: GraphDataSpec) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The edges in chunks of at most :data:`_EDGE_CHUNK`, each drawn as the whole list
        would be (a multinomial split of its edges over the nodes): the sum of independent
        multinomials is the multinomial of the sum, so chunking changes no distribution. The
        first chunk's stream is the unchunked generator's, so graphs of one chunk are unchanged."""
        e = int(round(spec.nodes * spec.avg_degree / 2))
        chunks = max(1, -(-e // _EDGE_CHUNK))
        for j in range(chunks):
            size = e * (j + 1) // chunks - e * j // chunks
            seed = [spec.seed, 1] if j == 0 else [spec.seed, 1, j]
            yield self._draw(spec, size, np.random.default_rng(np.random.SeedSequence(seed)))

    def _draw(self, spec: GraphDataSpec, e: int, rng: np.random.Generator
              ) -> tuple[np.ndarray, np.ndarray]:
        """``e`` edges of the model, drawn with ``rng``."""
        n, k = spec.nodes, spec.communities
        idx = self.by_position.dtype
        # First endpoints: counts per node from one multinomial, expanded, then shuffled so that
        # their order says nothing about them (the second endpoints are matched by order).
        counts = rng.multinomial(e, self.theta / self.theta.sum())
        u_pos = np.repeat(np.arange(n, dtype=idx), counts)
        del counts
        rng.shuffle(u_pos)
        target = self.position_community[u_pos]
        leave = np.flatnonzero(rng.random(e, dtype=np.float32) >= 1 - spec.mixing)
        if leave.shape[0]:
            # another community, chosen by size: a point in [0, N - mass_c), skipping c's block
            own = target[leave]
            x = rng.random(leave.shape[0]) * (n - self.mass[own])
            x += (x >= self.starts[own]) * self.mass[own]
            target[leave] = np.minimum(np.searchsorted(self.starts[1:], x, side="right"), k - 1)
            del own, x
        del leave
        # Second endpoints: per community, counts per node from a multinomial, expanded in
        # position order and handed to that community's edges in their (random) order.
        by_target = np.argsort(target, kind="stable")
        needed = np.bincount(target, minlength=k)
        del target
        v_sorted = np.empty(e, dtype=idx)
        at = 0
        for c in range(k):  # communities, not edges
            lo, hi = self.starts[c], self.starts[c + 1]
            theta = self.theta[lo:hi]
            per_node = rng.multinomial(needed[c], theta / theta.sum())
            v_sorted[at:at + needed[c]] = np.repeat(np.arange(lo, hi, dtype=idx), per_node)
            at += needed[c]
        v_pos = np.empty(e, dtype=idx)
        v_pos[by_target] = v_sorted
        del by_target, v_sorted
        src = self.by_position[u_pos]
        del u_pos
        dst = self.by_position[v_pos]
        return src, dst

    def features(self, spec: GraphDataSpec, labels: np.ndarray) -> np.ndarray:
        """``[N, F]`` features in ``spec.feature_dtype``, drawn in float32 chunk by chunk (each
        chunk its own stream), so a float16 set holds the float32 set's values rounded.

        Raises:
            ValueError: a float16 feature out of range (a huge ``feature_noise``), naming it.
        """
        out = np.empty((spec.nodes, spec.num_features), dtype=spec.feature_dtype.numpy)
        for lo, hi, part in self.feature_chunks(spec, labels):
            out[lo:hi] = part
        return out

    def feature_chunks(self, spec: GraphDataSpec, labels: np.ndarray
                       ) -> Iterator[tuple[int, int, np.ndarray]]:
        """:meth:`features` a chunk of :data:`_FEATURE_CHUNK` nodes (bag-of-words:
        :data:`_WORD_CHUNK`) at a time: ``(lo, hi, rows)``."""
        n, f = spec.nodes, spec.feature_dim
        if self.words is not None:
            for i, lo in enumerate(range(0, n, _WORD_CHUNK)):
                hi = min(lo + _WORD_CHUNK, n)
                rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 3, i]))
                rows = self.words.sample(rng, labels[lo:hi])  # 0/1: exact in float16 too
                yield lo, hi, rows.astype(spec.feature_dtype.numpy, copy=False)
            return
        for i, lo in enumerate(range(0, n, _FEATURE_CHUNK)):
            hi = min(lo + _FEATURE_CHUNK, n)
            rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 3, i]))
            noise = rng.standard_normal((hi - lo, f), dtype=np.float32)
            noise *= np.float32(spec.feature_noise)
            noise += self.class_means[labels[lo:hi]]
            try:
                yield lo, hi, cast_features(noise, spec.feature_dtype, first_row=lo)
            except FeatureRangeError as e:
                raise ValueError(f"GraphDataSpec.feature_dtype: {e}, drawn with feature_noise "
                                 f"{spec.feature_noise:g}; use float32 or less noise") from None

    def write_features(self, spec: GraphDataSpec, labels: np.ndarray, path: Path
                       ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`features` written to the ``.npy`` file ``path`` a chunk at a time (plain
        writes: no page of it is held by this process), with :meth:`feature_bayes`'s predictions
        made on each chunk as written. Returns ``(features memory-mapped read-only, preds)``."""
        shape = (spec.nodes, spec.num_features)
        pred = np.empty(spec.nodes, dtype=np.int64)
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {
                "descr": np.lib.format.dtype_to_descr(np.dtype(spec.feature_dtype.numpy)),
                "fortran_order": False, "shape": shape})
            for lo, hi, part in self.feature_chunks(spec, labels):
                part.tofile(f)
                pred[lo:hi] = self.feature_bayes(spec, part)
        return np.load(path, mmap_mode="r"), pred

    def log_likelihoods(self, spec: GraphDataSpec, x: np.ndarray) -> np.ndarray:
        """``log p(x | k)`` up to a term constant in ``k`` (gaussian: the class means have equal
        norms; bow: exact)."""
        if self.words is not None:
            return self.words.log_likelihoods(x)
        return (x @ self.class_means.T).astype(np.float64) / spec.feature_noise**2

    def feature_bayes(self, spec: GraphDataSpec, x: np.ndarray) -> np.ndarray:
        """Predictions of the Bayes-optimal classifier that sees only the features."""
        pred = np.empty(x.shape[0], dtype=np.int64)
        log_prior = np.log(self.prior)
        for lo in range(0, x.shape[0], _FEATURE_CHUNK):
            part = x[lo:lo + _FEATURE_CHUNK]
            pred[lo:lo + part.shape[0]] = np.argmax(
                self.log_likelihoods(spec, part) + log_prior, axis=1)
        return pred

    def one_hop_bayes(self, spec: GraphDataSpec, nodes: np.ndarray, indptr: np.ndarray,
                      indices: np.ndarray, features: np.ndarray, homophily: float) -> np.ndarray:
        """Predictions of the Bayes classifier that sees a node's and its neighbours' features.

        Each neighbour is taken to be in the node's community with probability ``homophily``,
        else in another community chosen by size, independently of the other neighbours (as
        the model draws them).
        """
        k = spec.communities
        log_prior = np.log(self.prior)
        starts, ends = indptr[nodes], indptr[nodes + 1]
        lengths = ends - starts
        total = int(lengths.sum())
        group = np.repeat(np.arange(nodes.shape[0]), lengths)
        offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        nbrs = np.asarray(indices[offsets + np.arange(total)])
        score = self.log_likelihoods(spec, np.asarray(features[nodes])) + log_prior
        if total and k > 1:
            ll = self.log_likelihoods(spec, np.asarray(features[nbrs]))
            top = ll.max(axis=1, keepdims=True)
            like = np.exp(ll - top)                         # p(x_v | k), scaled per row
            other = (like @ self.prior)[:, None] - like * self.prior[None, :]
            other /= (1.0 - self.prior)[None, :]
            term = np.log(homophily * like + (1.0 - homophily) * other) + top
            np.add.at(score, group, term)
        return np.argmax(score, axis=1)


def _splits(spec: GraphDataSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 4]))
    perm = rng.permutation(spec.nodes)
    n_test = round(spec.test_fraction * spec.nodes)
    n_valid = round(spec.valid_fraction * spec.nodes)
    return {"train": np.sort(perm[n_test + n_valid:]).astype(np.int64),
            "valid": np.sort(perm[n_test:n_test + n_valid]).astype(np.int64),
            "test": np.sort(perm[:n_test]).astype(np.int64)}


def homophily(indptr: np.ndarray, indices: np.ndarray, labels: np.ndarray) -> float:
    """Share of the CSR entries (self-loops excluded) joining two nodes of one label."""
    same = other = 0
    for lo, hi in row_blocks(indptr):
        rows = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(indptr[lo:hi + 1]))
        cols = np.asarray(indices[indptr[lo]:indptr[hi]])
        keep = rows != cols
        eq = int(np.count_nonzero(labels[rows[keep]] == labels[cols[keep]]))
        same, other = same + eq, other + int(np.count_nonzero(keep)) - eq
    return same / (same + other) if same + other else float("nan")


def degree_statistics(indptr: np.ndarray) -> dict[str, Any]:
    """Mean, median, max, p99, isolated nodes and a Hill estimate of the tail's exponent.

    The Hill estimate uses the top 1% of the degrees (at least 10 nodes): ``gamma = 1 + k /
    sum(log(d_i / d_(k+1)))``, which is near ``degree_exponent`` for a power-law tail (the
    structural cut-off and the dropped multi-edges bend the far tail, so it reads a bit high).
    """
    deg = np.diff(indptr)
    n = deg.shape[0]
    mean = float(deg.mean()) if n else 0.0
    out: dict[str, Any] = {
        "mean": round(mean, 4), "median": float(np.median(deg)) if n else 0.0,
        "max": int(deg.max()) if n else 0, "p99": float(np.percentile(deg, 99)) if n else 0.0,
        "max_over_mean": round(float(deg.max()) / mean, 2) if mean else None,
        "isolated_nodes": int(np.count_nonzero(deg == 0)),
    }
    k = max(10, int(_HILL_TAIL * n))
    if n > k:
        top = np.partition(deg, n - k - 1)[n - k - 1:].astype(np.float64)
        threshold = top.min()
        tail = np.log(top[top > threshold] / threshold) if threshold > 0 else np.empty(0)
        if tail.shape[0] and tail.sum() > 0:
            out["hill_exponent"] = round(1.0 + tail.shape[0] / float(tail.sum()), 3)
            out["hill_tail_nodes"] = int(tail.shape[0])
    return out


def planted_description(spec: GraphDataSpec) -> str:
    """One-line human description of the planted model."""
    if spec.features is NodeFeatures.BOW:
        features = (f"{spec.words_per_node} distinct words of {spec.vocab} (0/1 columns), "
                    f"P(words | k) ~ prod of p_k(word), p_k = {1 - spec.topic_share:g} Zipf("
                    f"{BACKGROUND_ZIPF_A}) background + {spec.topic_share:g} uniform on the "
                    f"community's {topic_size(spec.communities, spec.vocab, spec.words_per_node)}"
                    f" topic words")
    else:
        features = (f"unit class mean + N(0, {spec.feature_noise:g}^2 I) in {spec.feature_dim} "
                    f"dims")
    return (f"degree-corrected SBM: {spec.communities} communities (sizes ~ rank^-"
            f"{spec.community_size_exponent}), theta ~ Pareto(tail {spec.degree_exponent - 1:g}) "
            f"capped at expected degree sqrt(N*avg_degree), {spec.avg_degree:g} expected "
            f"neighbours, {1 - spec.mixing:.0%} of edges inside the community; label = "
            f"community; features = {features}")


def _log(bar: tqdm, what: str) -> None:
    """One phase done: ``what`` is shown after the bar's phase count and elapsed time."""
    bar.set_postfix_str(what, refresh=False)
    bar.update()


def generate_graph(spec: GraphDataSpec, out_dir: str | Path, progress: bool = True,
                   memory_gb: Optional[float] = None) -> dict:
    """Writes a synthetic graph data set (the format of :mod:`embedtrain.graph.store`) to ``out_dir``.

    An earlier graph data set there is replaced; the same spec always gives identical files.

    Args:
        spec: size, communities, degrees, features, splits.
        out_dir: destination folder (created if missing).
        progress: show a progress bar on stderr (phases done, elapsed time, the last phase).
        memory_gb: GiB the CSR build may sort in memory (default a quarter of the RAM). A graph
            needing more is drawn in chunks and built out of core
            (:func:`~embedtrain.graph.csr_external.csr_from_edge_chunks`), its features written to a
            memory map: the same files, in bounded memory.

    Returns:
        The metadata written to ``metadata.json``; ``metadata["generator"]`` holds the spec and
        the planted figures (``homophily``, ``feature_bayes_accuracy``,
        ``one_hop_bayes_accuracy``, ``degree`` statistics, the edge counts).

    Example:
        >>> meta = generate_graph(GraphDataSpec(nodes=10_000), "/tmp/g", progress=False)
        >>> round(meta["generator"]["feature_bayes_accuracy"]["test"], 1)  # doctest: +SKIP
        0.6
    """
    spec.validate()
    phases = 5 if spec.link_fraction > 0 else 4
    scratch = ScratchDir(out_dir)
    with phase_bar(phases, "datagen graph", disable=not progress) as bar:
        try:
            return _generate(spec, out_dir, bar, memory_budget(memory_gb), scratch)
        finally:
            scratch.close()


def _generate(spec: GraphDataSpec, out_dir: str | Path, bar: tqdm, budget: int,
              scratch: ScratchDir) -> dict:
    model = PlantedGraph(spec)
    labels = model.community.astype(np.int64)
    edges = int(round(spec.nodes * spec.avg_degree / 2))
    features = None
    if 2 * edges * ENTRY_BYTES <= budget:
        src, dst = model.draw_edges(spec)
        drawn = int(src.shape[0])
        _log(bar, f"{drawn:,} edges drawn")
        indptr, indices, _, counts = csr_from_edges(src, dst, spec.nodes)
        del src, dst
    else:  # drawn a chunk at a time into the out-of-core build
        def chunks():
            for src, dst in model.edge_chunks(spec):
                bar.set_postfix_str("drawing edges", refresh=True)
                yield src, dst, None

        indptr, indices, _, counts = csr_from_edge_chunks(
            chunks(), spec.nodes, scratch.path() / "csr", memory_budget=budget,
            progress=lambda msg: bar.set_postfix_str(msg, refresh=True))
        drawn = counts.input_edges
        _log(bar, f"{drawn:,} edges drawn")
        if spec.num_features:
            features, pred = model.write_features(spec, labels, scratch.path() / "features.npy")
    _log(bar, f"CSR of {indices.shape[0]:,} entries")
    edge_splits: Optional[dict[str, np.ndarray]] = None
    if spec.link_fraction > 0:
        indptr, indices, _, edge_splits = hold_out_edges(
            indptr, indices, None, directed=False, valid_fraction=spec.link_fraction / 2,
            test_fraction=spec.link_fraction / 2, seed=spec.seed)
        _log(bar, "link-prediction edges held out")
    splits = _splits(spec)
    if features is None:
        features = model.features(spec, labels)
        pred = model.feature_bayes(spec, features)
    h = homophily(indptr, indices, labels)
    test = splits["test"] if splits["test"].shape[0] else np.arange(spec.nodes)
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 5]))
    sample = np.sort(rng.choice(test, size=min(_ONE_HOP_NODES, test.shape[0]), replace=False))
    one_hop = model.one_hop_bayes(spec, sample, indptr, indices, features, h)
    _log(bar, "features and oracle figures")

    def acc(p: np.ndarray, nodes: np.ndarray) -> Optional[float]:
        return round(float(np.mean(p == labels[nodes])), 4) if nodes.shape[0] else None

    generator = {
        "model": "degree-corrected stochastic block model",
        "spec": {**asdict(spec), "feature_dtype": spec.feature_dtype.value,
                 "features": spec.features.value},
        "planted": planted_description(spec),
        "community_sizes": model.sizes.tolist(),
        "edges_drawn": drawn,
        "edge_counts": counts.as_dict(),
        "link_held_out": {k: int(v.shape[1]) for k, v in (edge_splits or {}).items()},
        "capped_propensities": model.capped,
        "homophily": round(h, 4),
        "expected_homophily": round(1 - spec.mixing, 4),
        "feature_bayes_accuracy": {"all": acc(pred, np.arange(spec.nodes)),
                                   "test": acc(pred[splits["test"]], splits["test"])},
        "one_hop_bayes_accuracy": {"test": acc(one_hop, sample), "nodes": int(sample.shape[0])},
        "degree": degree_statistics(indptr),
    }
    stored = features if spec.num_features else None
    meta = write_graph(out_dir, indptr, indices, features=stored,
                       labels=labels, num_classes=spec.communities, splits=splits,
                       edge_splits=edge_splits, directed=False, name="synthetic_graph",
                       extra_meta={"generator": generator}, feature_dtype=spec.feature_dtype)
    _log(bar, f"wrote {out_dir}")
    return meta
