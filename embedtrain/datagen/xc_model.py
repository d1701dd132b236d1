"""The planted model behind ``embedtrain datagen xc``: its spec, sampling, and exact posteriors.

:class:`XCDataSpec` describes the data set; :class:`XCPlantedModel` draws rows from it (class,
token bag, dense features, related labels) and gives the Bayes posterior's top classes, from
which :mod:`embedtrain.datagen.xc` computes the oracle figures written to ``metadata.json``.
NumPy only (no torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from embedtrain.datagen.ctr import check_fields, is_real
from embedtrain.utils import is_int

TOKEN_COLUMN = "tokens"
_CHUNK_ROWS = 65_536
_ORACLE_CHUNK_ROWS = 4_096   # rows scored together by the oracle (bounds its memory)
_TOP_K = 5
_POOL_EXTRA = 8              # pool members per group beyond _TOP_K (see posterior_topk)
_PRUNE = 1e-12               # multi-label: primaries this unlikely pass nothing to related ones


def dense_names(n: int) -> list[str]:
    """Names of the ``n`` dense columns: ``D1..Dn``."""
    return [f"D{i}" for i in range(1, n + 1)]


@dataclass(frozen=True)
class XCDataSpec:
    """Knobs of the synthetic XC data set; validated on construction (``ValueError``)."""

    classes: int = 100_000
    rows: int = 1_000_000                         # total rows across splits
    vocab: int = 200_000                          # token ids are in [0, vocab)
    tokens_per_row: tuple[int, int] = (8, 32)     # inclusive range of a row's token count
    prototype_tokens: int = 8                     # distinct tokens characteristic of each class
    noise: float = 0.8                            # share of a row's tokens drawn from background
    zipf_a: float = 1.1                           # class frequencies ~ rank**-zipf_a
    background_zipf_a: float = 1.0                # background unigram ~ rank**-background_zipf_a
    multi_label: bool = False
    labels_per_row: tuple[int, int] = (1, 4)      # inclusive range (multi-label only)
    related_classes: int = 8                      # related classes per class (multi-label extras)
    dense_features: int = 4
    dense_groups: int = 64                        # class groups the dense features tell apart
    dense_noise: float = 1.0                      # sd of the dense features around group means
    seed: int = 0
    valid_fraction: float = 0.1
    test_fraction: float = 0.1
    rows_per_row_group: int = 65_536
    rows_per_file: int = 1_000_000                # a split larger than this gets several files
    oracle_rows: int = 100_000                    # the oracle scores at most this many test rows

    def __post_init__(self) -> None:
        for name in ("tokens_per_row", "labels_per_row"):  # e.g. lists from a config file
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    @property
    def groups(self) -> int:
        """Class groups actually used (at most one per class)."""
        return min(self.dense_groups, self.classes)

    @property
    def related(self) -> int:
        """Related classes per class actually used (the smallest group bounds it)."""
        return min(self.related_classes, self.classes // self.groups - 1)

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message naming the first bad field."""
        def is_range(x: Any) -> bool:
            return isinstance(x, tuple) and len(x) == 2 and all(is_int(v) for v in x)

        checks = [
            ("classes", is_int, lambda v: v >= 2, "an integer >= 2"),
            ("rows", is_int, lambda v: v >= 10, "an integer >= 10"),
            ("vocab", is_int, lambda v: v >= 2, "an integer >= 2"),
            ("tokens_per_row", is_range, lambda v: 1 <= v[0] <= v[1], "a pair 1 <= lo <= hi"),
            ("prototype_tokens", is_int, lambda v: 1 <= v <= self.vocab,
             "an integer in [1, vocab]"),
            ("noise", is_real, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("zipf_a", is_real, lambda v: 0 <= v < math.inf, "non-negative and finite"),
            ("background_zipf_a", is_real, lambda v: 0 <= v < math.inf,
             "non-negative and finite"),
            ("multi_label", lambda v: isinstance(v, bool), lambda v: True, "a bool"),
            ("labels_per_row", is_range, lambda v: 1 <= v[0] <= v[1], "a pair 1 <= lo <= hi"),
            ("related_classes", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("dense_features", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("dense_groups", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("dense_noise", is_real, lambda v: 0 < v < math.inf, "positive and finite"),
            ("seed", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("valid_fraction", is_real, lambda v: 0 <= v < 1, "in [0, 1)"),
            ("test_fraction", is_real, lambda v: 0 <= v < 1, "in [0, 1)"),
            ("rows_per_row_group", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("rows_per_file", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("oracle_rows", is_int, lambda v: v >= 0, "a non-negative integer"),
        ]
        check_fields(self, checks)
        if self.valid_fraction + self.test_fraction >= 1:
            raise ValueError("XCDataSpec.valid_fraction + test_fraction must be < 1, got "
                             f"{self.valid_fraction + self.test_fraction!r}")
        if self.multi_label and self.labels_per_row[1] - 1 > self.related:
            raise ValueError(
                f"XCDataSpec.labels_per_row must be at most 1 + related classes per class "
                f"({1 + self.related}: related_classes={self.related_classes}, groups of "
                f">= {self.classes // self.groups} classes), got {self.labels_per_row!r}")


def _zipf_pmf(n: int, a: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -a
    return w / w.sum()


def _distinct_rows(rng: np.random.Generator, n: int, k: int, high: int) -> np.ndarray:
    """``n`` rows of ``k`` distinct ints in ``[0, high)``; rows with repeats are redrawn."""
    out = rng.integers(0, high, size=(n, k), dtype=np.int64)
    s = np.sort(out, axis=1)
    for i in np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1)):
        out[i] = rng.choice(high, size=k, replace=False)
    return out


class _XCChunk(NamedTuple):
    """``n`` generated rows: class ids, tokens (CSR), dense features, labels (CSR)."""

    primary: np.ndarray        # (n,) int64
    offsets: np.ndarray        # (n + 1,) int64 into tokens
    tokens: np.ndarray         # int64
    dense: np.ndarray          # (n, D) float32
    label_offsets: np.ndarray  # (n + 1,) int64 into labels (multi-label; else arange)
    labels: np.ndarray         # int64, each row's labels sorted


class XCPlantedModel:
    """Class prior, prototypes, background, groups and relations, all derived from the spec.

    Attributes (``C`` classes, ``V`` tokens, ``P`` prototype tokens, ``G`` groups, ``r``
    related): ``prior`` (C,), ``background`` (V,) the unigram ``q``, ``prototypes`` (C, P),
    ``group`` (C,), ``group_means`` (G, D), ``related`` (C, r), ``rho`` (P(a given related
    class is a label | primary), 0 single-label), ``noise``, ``dense_noise``; for the oracle
    (:meth:`posterior_topk`) the token -> class index, per-group ``pool`` and
    ``fallback_rows`` (rows it had to score against all classes so far).
    """

    def __init__(self, spec: XCDataSpec):
        self.spec = spec
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0]))
        C, V, P = spec.classes, spec.vocab, spec.prototype_tokens
        self.num_classes, self.vocab = C, V
        self.noise, self.dense_noise = float(spec.noise), float(spec.dense_noise)
        # Class prior: Zipf over ranks, ranks mapped to ids by a permutation.
        pmf = _zipf_pmf(C, spec.zipf_a)
        self.class_cdf = np.cumsum(pmf)
        self.class_of_rank = rng.permutation(C).astype(np.int64)
        self.prior = np.empty(C)
        self.prior[self.class_of_rank] = pmf
        # Background unigram distribution over tokens.
        pmf = _zipf_pmf(V, spec.background_zipf_a)
        self.token_cdf = np.cumsum(pmf)
        self.token_of_rank = rng.permutation(V).astype(np.int64)
        self.background = np.empty(V)
        self.background[self.token_of_rank] = pmf
        self.prototypes = _distinct_rows(rng, C, P, V)
        # Groups (dense means) and relations: the next r members of the group, cyclically.
        G = spec.groups
        self.num_groups = G
        self.group = np.arange(C, dtype=np.int64) % G
        self.group_prior = np.bincount(self.group, weights=self.prior, minlength=G)
        self.group_means = rng.standard_normal((G, spec.dense_features))
        r = spec.related
        order = rng.permutation(C)
        members = order[np.argsort(self.group[order], kind="stable")]  # grouped, shuffled within
        size = np.bincount(self.group, minlength=G)
        start = np.concatenate([[0], np.cumsum(size)[:-1]])
        pos = np.arange(C) - np.repeat(start, size)                    # position within group
        g = self.group[members]
        self.related = np.empty((C, r), np.int64)
        self.related[members] = members[
            start[g][:, None] + (pos[:, None] + np.arange(1, r + 1)) % size[g][:, None]]
        lo, hi = spec.labels_per_row
        self.rho = ((lo + hi) / 2 - 1) / r if spec.multi_label and r else 0.0
        self._build_index()

    def _build_index(self) -> None:
        """Inverted index token -> classes, token weights, base scores and per-group pools."""
        C, P = self.prototypes.shape
        flat = self.prototypes.ravel()
        order = np.argsort(flat, kind="stable")
        self.token_classes = np.repeat(np.arange(C, dtype=np.int64), P)[order]
        self.token_ptr = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=self.vocab))])
        self.token_weight = np.log1p((1 - self.noise) / (P * self.noise * self.background))
        # Score of a class sharing no token with the row, before the group factor e^{d_g}.
        self.base = self.prior.copy()
        if self.rho:
            np.add.at(self.base, self.related.ravel(),
                      self.rho * np.repeat(self.prior, self.related.shape[1]))
        # Per group, its members in decreasing base score, the first R kept as the pool.
        G = self.num_groups
        size = np.bincount(self.group, minlength=G)
        self._set_pool(int(min(_TOP_K + _POOL_EXTRA, size.max())))
        self.fallback_rows = 0  # rows the oracle scored against all classes (see _topk)

    def _set_pool(self, R: int) -> None:
        """Keep each group's ``R`` members of highest base score as the oracle's pool."""
        G, C = self.num_groups, self.num_classes
        order = np.lexsort((-self.base, self.group))
        size = np.bincount(self.group, minlength=G)
        start = np.concatenate([[0], np.cumsum(size)[:-1]])
        self.pool = np.full((G, R), -1, np.int64)
        j = np.arange(C) - np.repeat(start, size)
        keep = j < R
        self.pool[self.group[order][keep], j[keep]] = order[keep]
        self.pool_logbase = np.where(self.pool >= 0, np.log(self.base[self.pool]), -np.inf)
        self.pool_pos = np.full(C, -1, np.int64)
        self.pool_pos[self.pool[self.pool >= 0]] = np.flatnonzero(self.pool.ravel() >= 0)
        self.pool_complete = size <= R          # the pool holds the whole group
        self.pool_size = R

    def draw(self, rng: np.random.Generator, n: int) -> _XCChunk:
        """``n`` rows from the generative model (see the module docstring)."""
        spec = self.spec
        u = rng.random(n) * self.class_cdf[-1]
        rank = np.minimum(np.searchsorted(self.class_cdf, u, side="right"), spec.classes - 1)
        y = self.class_of_rank[rank]
        lengths = rng.integers(spec.tokens_per_row[0], spec.tokens_per_row[1] + 1, size=n)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        row = np.repeat(np.arange(n), lengths)
        is_noise = rng.random(len(row)) < spec.noise
        slot = rng.integers(0, spec.prototype_tokens, size=len(row))
        tokens = self.prototypes[y[row], slot]
        ub = rng.random(int(is_noise.sum())) * self.token_cdf[-1]
        trank = np.minimum(np.searchsorted(self.token_cdf, ub, side="right"), spec.vocab - 1)
        tokens[is_noise] = self.token_of_rank[trank]
        dense = (self.group_means[self.group[y]]
                 + spec.dense_noise * rng.standard_normal((n, spec.dense_features)))
        dense = dense.astype(np.float32)
        if not spec.multi_label:
            return _XCChunk(y, offsets, tokens, dense, np.arange(n + 1, dtype=np.int64), y)
        lo, hi = spec.labels_per_row
        k = rng.integers(lo, hi + 1, size=n)
        r = self.related.shape[1]
        pick = np.argsort(rng.random((n, r)), axis=1)               # a random order of Rel(y)
        extra = self.related[y][np.arange(n)[:, None], pick]
        both = np.concatenate([y[:, None], extra], axis=1)
        both[np.arange(r + 1)[None, :] >= k[:, None]] = np.iinfo(np.int64).max
        both.sort(axis=1)
        labels = both[np.arange(r + 1)[None, :] < k[:, None]]
        label_offsets = np.zeros(n + 1, np.int64)
        np.cumsum(k, out=label_offsets[1:])
        return _XCChunk(y, offsets, tokens, dense, label_offsets, labels)

    def schema(self) -> pa.Schema:
        label = (pa.field("labels", pa.list_(pa.int64())) if self.spec.multi_label
                 else pa.field("label", pa.int64()))
        return pa.schema([label]
                         + [pa.field(n, pa.float32())
                            for n in dense_names(self.spec.dense_features)]
                         + [pa.field(TOKEN_COLUMN, pa.list_(pa.int64()))])

    def table(self, ch: _XCChunk) -> pa.Table:
        if self.spec.multi_label:
            label = pa.ListArray.from_arrays(pa.array(ch.label_offsets), pa.array(ch.labels))
        else:
            label = pa.array(ch.labels)
        cols = ([label] + [pa.array(ch.dense[:, j]) for j in range(ch.dense.shape[1])]
                + [pa.ListArray.from_arrays(pa.array(ch.offsets), pa.array(ch.tokens))])
        return pa.Table.from_arrays(cols, schema=self.schema())

    def posterior_topk(self, offsets: np.ndarray, tokens: np.ndarray, dense: np.ndarray,
                       k: int = _TOP_K) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most probable classes of each row and their posterior (marginals if multi).

        Args:
            offsets: (n + 1,) row offsets into ``tokens``.
            tokens: the rows' token ids, concatenated.
            dense: (n, D) dense features.
            k: classes to return per row (at most the number of classes).

        Returns:
            ``(classes, probs)``, both (n, k), best first: ``p(c | x)`` single-label,
            ``P(c in Y | x)`` multi-label.
        """
        k = min(k, self.num_classes)
        if k > _TOP_K and self.pool_size < min(k + _POOL_EXTRA, self.num_classes):
            self._set_pool(k + _POOL_EXTRA)
        n = len(offsets) - 1
        out_c, out_p = np.empty((n, k), np.int64), np.empty((n, k))
        for lo in range(0, n, _ORACLE_CHUNK_ROWS):
            hi = min(lo + _ORACLE_CHUNK_ROWS, n)
            sl = slice(offsets[lo], offsets[hi])
            out_c[lo:hi], out_p[lo:hi] = self._topk(offsets[lo : hi + 1] - offsets[lo],
                                                    tokens[sl], dense[lo:hi], k)
        return out_c, out_p

    def _topk(self, offsets: np.ndarray, tokens: np.ndarray, dense: np.ndarray, k: int
              ) -> tuple[np.ndarray, np.ndarray]:
        n, C, G = len(offsets) - 1, self.num_classes, self.num_groups
        # Dense log-likelihood ratio per group, d (n, G).
        x = dense.astype(np.float64)
        d = np.zeros((n, G))
        for j in range(x.shape[1]):
            d -= (x[:, j, None] - self.group_means[None, :, j]) ** 2
        d /= 2 * self.dense_noise ** 2
        # Candidates: (row, class) pairs sharing a token, s = summed token weights.
        row_of_tok = np.repeat(np.arange(n), np.diff(offsets))
        first, count = self.token_ptr[tokens], np.diff(self.token_ptr)[tokens]
        ends = np.cumsum(count)
        idx = np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - count - first, count)
        key = np.repeat(row_of_tok, count) * C + self.token_classes[idx]
        ukey, inv = np.unique(key, return_inverse=True)
        s = np.bincount(inv, weights=np.repeat(self.token_weight[tokens], count),
                        minlength=len(ukey))
        c_row, c_cls = np.divmod(ukey, C)
        c_d = d[c_row, self.group[c_cls]]
        logp = np.log(self.prior[c_cls]) + c_d + s
        # Row scale M: everything below is divided by e^M, so nothing overflows.
        group_term = d + np.log(np.maximum(self.group_prior, 1e-300))
        M = group_term.max(axis=1)
        np.maximum.at(M, c_row, logp)
        v = np.exp(logp - M[c_row]) * -np.expm1(-s)   # pi e^{d} (e^s - 1) / e^M
        Z = np.exp(group_term - M[:, None]).sum(axis=1) + np.bincount(c_row, v, minlength=n)
        # Touched classes: candidates, and in multi-label their related classes.
        if self.rho:
            # Related classes of candidates that are all but impossible primaries (posterior
            # below _PRUNE) are left out: no marginal moves by more than 1e-9, and rows need not
            # touch r times as many classes.
            big = v > _PRUNE * Z[c_row]
            r = self.related.shape[1]
            t_key = np.concatenate([ukey, np.repeat(c_row[big], r) * C
                                    + self.related[c_cls[big]].ravel()])
            t_key, inv = np.unique(t_key, return_inverse=True)
            delta = np.bincount(inv, np.concatenate([v, np.repeat(self.rho * v[big], r)]),
                                minlength=len(t_key))
            t_row, t_cls = np.divmod(t_key, C)
        else:
            t_row, t_cls, delta = c_row, c_cls, v
        # Log scores (scaled by e^-M) of touched classes; one that underflows stays finite, so
        # that every row keeps at least k real classes ahead of the -inf padding below.
        with np.errstate(divide="ignore"):
            t_log = np.log(self.base[t_cls] * np.exp(d[t_row, self.group[t_cls]] - M[t_row])
                           + delta)
        t_log = np.maximum(t_log, -1e300)
        # Untouched classes: the pool (per group, best base first), touched members masked out.
        R = self.pool_size
        pool = (self.pool_logbase[None] + (d - M[:, None])[:, :, None]).reshape(n, G * R)
        in_pool = self.pool_pos[t_cls] >= 0
        pool[t_row[in_pool], self.pool_pos[t_cls[in_pool]]] = -np.inf
        # A group whose pool lost more than R - k members to the touched ones may hide an
        # untouched class of the top k past its pool (checked below).
        hidden = np.bincount(t_row[in_pool] * G + self.group[t_cls[in_pool]],
                             minlength=n * G).reshape(n, G)
        short = (R - hidden < k) & ~self.pool_complete[None]
        # Touched classes as a padded (n, width) matrix next to the pool; k rounds of argmax.
        starts = np.searchsorted(t_row, np.arange(n + 1))
        width = max(int(np.diff(starts).max(initial=0)), 1)
        col = np.arange(len(t_row)) - starts[t_row]
        t_mat = np.full((n, width), -1, np.int64)
        t_mat[t_row, col] = t_cls
        scores = np.full((n, width + G * R), -np.inf)
        scores[t_row, col] = t_log
        scores[:, width:] = pool
        pool_flat = self.pool.ravel()
        rows = np.arange(n)
        cls, score = np.empty((n, k), np.int64), np.empty((n, k))
        for j in range(k):
            a = scores.argmax(axis=1)
            score[:, j] = scores[rows, a]
            cls[:, j] = np.where(a < width, t_mat[rows, np.minimum(a, width - 1)],
                                 pool_flat[np.maximum(a - width, 0)])
            scores[rows, a] = -np.inf
        # Such a class scores at most its group's last pool member: the top k stands unless
        # that bound reaches the k-th score. Otherwise (rare) the row is scored against all C.
        bound = self.pool_logbase[:, -1][None] + d - M[:, None]
        unsure = (short & (bound >= score[:, -1:])).any(axis=1)
        self.fallback_rows += int(unsure.sum())
        for i in np.flatnonzero(unsure):
            full = np.log(self.base) + d[i, self.group] - M[i]
            sel = slice(starts[i], starts[i + 1])
            full[t_cls[sel]] = t_log[sel]
            top = np.argsort(-full, kind="stable")[:k]
            cls[i], score[i] = top, full[top]
        return cls, np.exp(score) / Z[:, None]


def planted_description(spec: XCDataSpec) -> str:
    """One-line human description of the planted generative model."""
    lo, hi = spec.tokens_per_row
    text = (f"class ~ Zipf(a={spec.zipf_a}) over {spec.classes} permuted ids; each class has "
            f"{spec.prototype_tokens} prototype tokens (uniform over {spec.vocab}); a row has "
            f"U{{{lo}..{hi}}} tokens, each from the background Zipf(a={spec.background_zipf_a}) "
            f"with probability {spec.noise}, else uniform from its class's prototype; "
            f"{spec.dense_features} dense features = mean of the class's group (one of "
            f"{spec.groups}, class mod groups, means N(0, I)) + N(0, {spec.dense_noise}^2)")
    if spec.multi_label:
        lo, hi = spec.labels_per_row
        text += (f"; U{{{lo}..{hi}}} labels: the class plus distinct related classes (each class "
                 f"has {spec.related} related classes in its group); tokens and dense features "
                 f"depend on the first class only")
    return text
