"""The planted click models of :mod:`embedtrain.datagen.ctr` (``CTRDataSpec.structure``).

``criteo`` (:class:`_CriteoClicks`, the default) mixes dense, per-id, head, pairwise-table,
dense-by-id and multi-hot terms; ``fm`` (:class:`_FMClicks`) is shaped like user-item interaction
logs: per-id biases plus latent-factor interactions between user-like and item-like fields. Each
term is scaled to a chosen standard deviation under the data distribution.
"""
from __future__ import annotations

import math
from enum import Enum
from typing import Callable, NamedTuple

import numpy as np

_TARGET_CTR = 0.25

# The planted model. Every weight is the standard deviation of that term's
# contribution to the logit under the data distribution (effect tables are
# standardised with the Zipf frequencies), so the signal sits on ids that occur
# often enough to be learned and the oracle AUC barely depends on the seed.
_DENSE_LINEAR = {"I1": 0.35, "I3": 0.30, "I6": -0.25}
_DENSE_TANH = ("I9", 0.40)                   # w * tanh(1.5 * z)
_MAIN_EFFECTS = {"C8": 0.45, "C9": 0.40, "C13": 0.40, "C17": 0.35, "C20": 0.35, "C21": 0.30}
_HEAD_EFFECT = ("C4", 100, 0.30)             # only the 100 most frequent ids matter
_PAIR = ("C1", "C12", 0.45)                  # per-(id_a, id_b) table; C1, C12 have no other effect
# z(I2) * (0.25 + slope[C23 id]), slope sd 0.15: a centred slope alone (no main
# effect) was not picked up by a DLRM within one epoch, a modulated one is.
_DENSE_X_CAT = ("I2", "C23", 0.25, 0.15)
_MULTI_HOT_EFFECT = ("C24", 0.60)            # mean of per-id effects over the list

# The fm structure (see _FMClicks). Fields with 1k-50k ids, all single-valued; sds as above.
_FM_DENSE = {"I1": 0.30, "I3": 0.30}
_FM_USER = ("C3", "C11", "C18")              # 6,271 / 35,416 / 9,668 ids
_FM_ITEM = ("C7", "C14", "C22")              # 14,903 / 4,068 / 22,974 ids
_FM_BIAS_ONLY = ("C10", "C21")               # 1,712 / 1,111 ids
_FM_BIAS_SD = 0.40                           # per field: 8 fields, variance 1.28
_FM_PAIR_SD = 0.38                           # per (user, item) field pair: 9 pairs, variance 1.30
_FM_RANK = 8
_FM_SUPPORT = 50                             # ids carrying a bias or factors, per field
_FM_ZIPF_EXPONENT = 1.7                      # of these 8 fields' ids (the others: the spec's)


class CTRStructure(Enum):
    """Which planted click model ``embedtrain datagen ctr --structure`` draws labels from."""

    CRITEO = "criteo"   # dense, per-id, head, pair-table, dense-by-id and multi-hot terms
    FM = "fm"           # per-id biases + user x item latent-factor interactions (_FMClicks)


def _standardize(e: np.ndarray, w: np.ndarray, sd: float, support: int | None = None
                 ) -> np.ndarray:
    """Scale effects ``e`` so that E_w[e] = 0 and Std_w[e] = sd; ids past ``support`` get 0."""
    e = e.astype(np.float64).ravel()
    w = w.ravel()
    if support is not None:
        e[support:] = 0.0
    k = slice(0, support)
    e[k] -= np.dot(w[k], e[k]) / w[k].sum()
    return sd * e / math.sqrt(np.dot(w, e * e))


def _whitened_factors(e: np.ndarray, w: np.ndarray, support: int) -> np.ndarray:
    """Factor rows ``e`` (ids x rank) with E_w[e] = 0 and E_w[e e^T] = I; ids past ``support``
    get 0 (``w``: the id probabilities, ``e``'s rows in the same order)."""
    e = e.astype(np.float64).copy()
    e[support:] = 0.0
    k = slice(0, support)
    e[k] -= w[k] @ e[k] / w[k].sum()
    vals, vecs = np.linalg.eigh(e[k].T @ (w[k, None] * e[k]))
    e[k] = e[k] @ (vecs / np.sqrt(vals)) @ vecs.T  # symmetric whitening: the least change
    return e


class _Chunk(NamedTuple):
    """Raw draws for n rows; categorical values are Zipf ranks (0 = most frequent)."""

    dense: np.ndarray                # (13, n) counts
    ranks: dict[str, np.ndarray]     # per feature; flattened list elements for multi-hot
    lengths: dict[str, np.ndarray]   # list lengths of the multi-hot features


_DenseZ = Callable[[str], np.ndarray]  # a dense feature's standardised log1p(count), by name


class _CriteoClicks:
    """The default planted model (``structure: criteo``): the terms ``planted_description``
    lists, each scaled to the sd its constant above gives."""

    zipf_exponents: dict[str, float] = {}  # every field's ids follow the spec's exponent

    def __init__(self, rng: np.random.Generator, vocab: dict[str, int],
                 pmf: dict[str, np.ndarray]):
        normal = rng.standard_normal
        self.main = {c: _standardize(normal(vocab[c]), pmf[c], sd)
                     for c, sd in _MAIN_EFFECTS.items()}
        c, top, sd = _HEAD_EFFECT
        self.head = _standardize(normal(vocab[c]), pmf[c], sd, support=top)
        a, b, sd = _PAIR
        joint = np.outer(pmf[a], pmf[b])
        self.pair = _standardize(normal(joint.shape), joint, sd).reshape(joint.shape)
        c, sd = _DENSE_X_CAT[1], _DENSE_X_CAT[3]
        self.slope = _standardize(normal(vocab[c]), pmf[c], sd)
        c, sd = _MULTI_HOT_EFFECT
        self.multi = _standardize(normal(vocab[c]), pmf[c], sd)

    def logit(self, ch: _Chunk, z: _DenseZ, out: np.ndarray) -> np.ndarray:
        """``out`` (the intercept, per row) plus the terms; adds in place."""
        n = ch.dense.shape[1]
        for name, w in _DENSE_LINEAR.items():
            out += w * z(name)
        out += _DENSE_TANH[1] * np.tanh(1.5 * z(_DENSE_TANH[0]))
        for name, eff in self.main.items():
            out += eff[ch.ranks[name]]
        out += self.head[ch.ranks[_HEAD_EFFECT[0]]]
        out += self.pair[ch.ranks[_PAIR[0]], ch.ranks[_PAIR[1]]]
        d, c, base, _ = _DENSE_X_CAT
        out += z(d) * (base + self.slope[ch.ranks[c]])
        name = _MULTI_HOT_EFFECT[0]
        length = ch.lengths[name]
        rows = np.repeat(np.arange(n), length)
        sums = np.bincount(rows, weights=self.multi[ch.ranks[name]], minlength=n)
        return out + sums / np.maximum(length, 1)  # an empty list contributes 0

    @staticmethod
    def description() -> str:
        dense = " ".join(f"{w:+.2f}*z({n})" for n, w in _DENSE_LINEAR.items())
        mains = ", ".join(f"{c}:{sd}" for c, sd in _MAIN_EFFECTS.items())
        (t, wt), (xd, xc, xb, xs) = _DENSE_TANH, _DENSE_X_CAT
        (hc, top, hs), (pa_, pb, ps), (mc, ms) = _HEAD_EFFECT, _PAIR, _MULTI_HOT_EFFECT
        return (f"logit = b {dense} {wt:+.2f}*tanh(1.5*z({t})) "
                f"+ z({xd})*({xb} + slope[{xc}] (sd {xs})) "
                f"+ per-id effects (sd) on {mains} + effects on the top {top} ids of {hc} "
                f"(sd {hs}) + pairwise table {pa_}x{pb} (sd {ps}) + mean of per-id effects over "
                f"the {mc} list (sd {ms}); z = standardised log1p(count); sds are under the data "
                f"distribution; b gives CTR~{_TARGET_CTR}; all other features are noise")


class _FMClicks:
    """A planted model shaped like user-item interaction logs (``structure: fm``)::

        logit = b + 0.30 z(I1) + 0.30 z(I3) + sum_f bias_f[id_f]
                  + sum_{u in C3,C11,C18} sum_{i in C7,C14,C22} <U_u[id_u], V_i[id_i]>

    - first order: a per-id bias (sd 0.40 per field) on the user-like fields C3, C11, C18, the
      item-like fields C7, C14, C22 and C10, C21 (1,111 to 35,416 ids each);
    - pairwise: rank-8 latent factors, U on the user-like fields and V on the item-like ones;
      each of the 9 (user, item) field pairs contributes sd 0.38. The sum over the pairs is the
      dot product of the summed user factors and the summed item factors (a two-tower score);
    - every other feature is noise.

    Learnable from ~1M rows: the ids of these 8 fields are Zipf with exponent 1.7 (the other
    fields keep the spec's ``zipf_exponent``), and only the 50 most frequent ids of each carry a
    bias or factors, the rest 0. The 50th id has probability 6.3e-4, so from 1M rows (800k
    training rows) each carrying id is expected in ~500 training rows or more; the carrying ids
    cover 96% of a field's rows. (With the spec's exponent 1.1 and the top 200 ids, ids seen too
    rarely to learn held ~1/3 of the rows, and a model of exactly these terms, well regularised,
    stayed 0.009-0.016 below the oracle AUC at 1M rows; with these settings it gets within
    ~0.003-0.004: `benchmarks/bench_fm_reference.py`.)

    Scales: biases are standardised like the criteo terms (zero mean, sd 0.40 under the id
    distribution). Factors are drawn U, V ~ N(0, 1) on the carrying ids, then centred and
    whitened under the field's id distribution (E[U] = 0, E[U U^T] = I), so the variance of
    <U_u[a], V_i[b]> is exactly the rank; one common factor (0.38^2 / 8)^(1/4) on every U and V
    gives each pair sd 0.38, and a factorisation model with one embedding per id can represent
    the planted model exactly. All terms are zero-mean and uncorrelated (the fields are drawn
    independently), so the logit's variance is 0.18 (dense) + 1.28 (first order) + 1.30 (pairwise)
    = 2.76 (sd 1.66), about half of it pairwise; the oracle AUC is ~0.83.
    """

    zipf_exponents = {c: _FM_ZIPF_EXPONENT for c in (*_FM_USER, *_FM_ITEM, *_FM_BIAS_ONLY)}

    def __init__(self, rng: np.random.Generator, vocab: dict[str, int],
                 pmf: dict[str, np.ndarray]):
        normal = rng.standard_normal
        self.bias = {c: _standardize(normal(vocab[c]), pmf[c], _FM_BIAS_SD, support=_FM_SUPPORT)
                     for c in (*_FM_USER, *_FM_ITEM, *_FM_BIAS_ONLY)}
        scale = (_FM_PAIR_SD ** 2 / _FM_RANK) ** 0.25
        self.factors = {c: scale * _whitened_factors(normal((vocab[c], _FM_RANK)), pmf[c],
                                                     _FM_SUPPORT)
                        for c in (*_FM_USER, *_FM_ITEM)}

    def logit(self, ch: _Chunk, z: _DenseZ, out: np.ndarray) -> np.ndarray:
        """``out`` (the intercept, per row) plus the terms; adds in place."""
        for name, w in _FM_DENSE.items():
            out += w * z(name)
        for name, b in self.bias.items():
            out += b[ch.ranks[name]]
        user = sum(self.factors[c][ch.ranks[c]] for c in _FM_USER)
        item = sum(self.factors[c][ch.ranks[c]] for c in _FM_ITEM)
        out += np.einsum("nk,nk->n", user, item)  # = the sum of the 9 pairs' dot products
        return out

    @staticmethod
    def description() -> str:
        dense = " ".join(f"{w:+.2f}*z({n})" for n, w in _FM_DENSE.items())
        users, items = ", ".join(_FM_USER), ", ".join(_FM_ITEM)
        return (f"logit = b {dense} + per-id biases (sd {_FM_BIAS_SD} per field) on "
                f"{users}, {items}, {', '.join(_FM_BIAS_ONLY)} + sum over user fields u in "
                f"({users}) and item fields i in ({items}) of <U_u[id_u], V_i[id_i]> (rank "
                f"{_FM_RANK}, sd {_FM_PAIR_SD} per pair); ids of these 8 fields are "
                f"Zipf({_FM_ZIPF_EXPONENT}) and only the top {_FM_SUPPORT} of a field carry a "
                f"bias or factors; z = standardised log1p(count); sds are under "
                f"the data distribution; b gives CTR~{_TARGET_CTR}; all other features are noise")


_CLICK_MODELS = {CTRStructure.CRITEO: _CriteoClicks, CTRStructure.FM: _FMClicks}
