"""A drifting CTR data set with raw 64-bit ids: new ids are born over time and old ones die.

Why: an offline vocabulary (``encoding: vocab``) is built on the training split and maps every
id it has not seen to one "unknown" bucket; modulo hashing (``encoding: hash``) folds ids into a
fixed table where unrelated ids collide. When ids keep arriving, both go stale: most lookups of
the later splits hit ids the vocabulary never saw. Dynamic (collision-free, evicting) tables take
the raw int64 ids as they are. This generator makes that situation measurable, with a planted
click model so that the best possible AUC is known.

Design (all of it deterministic from the seed):

- Rows are in time order over ``periods`` periods: row ``i`` is in period
  ``floor(i * periods / rows)`` (an int32 ``period`` column, which the metadata does not list as
  a feature; the reader ignores it, ``embedtrain ingest`` can split on it with
  ``split: {method: time, column: period}``). The splits are cut at period boundaries: train the
  first periods, then valid, then test (``valid_fraction`` / ``test_fraction`` of the periods).
- ``dense_features`` float32 columns ``I1..``, standard normal, with a modest linear effect.
- ``sparse_features`` single-valued categorical columns ``C1..`` of raw int64 ids. Feature ``f``
  gets ``n_f`` new ids each period (``new_ids_per_period`` times a per-feature scale), and an id
  is alive for ``lifetime`` periods from its birth; ids born in the ``lifetime - 1`` periods
  before period 0 are alive at the start, so the first periods are not special. So ``lifetime *
  n_f`` ids are alive at any time, ``(periods + lifetime - 1) * n_f`` exist in all. A row draws
  its id among the ids alive in its period with Zipf popularity: the alive ids are ranked by a
  random key fixed per id, and rank ``r`` has probability ~ ``1 / (r + 1) ** zipf_exponent``
  (a newborn id is as likely to be a head id as an old one).
- Raw id values: a splitmix64-style mix of (seed, feature, id index) on 63 bits, where every step
  is a bijection of ``[0, 2^63)``; the value ``2^63 - 1`` (kept by the dynamic tables for empty
  slots) is skipped by cycle walking. So the ids of one feature are distinct by construction,
  lie in ``[0, 2^63 - 1)``, and look like hashed raw ids (no order, no small values).
- Click model: ``logit = b + sum_d w_d * x_d + sum_f e_f[id]`` with an independent effect
  ``e_f[id] ~ N(0, sd_f)`` per id; labels ~ Bernoulli(sigmoid(logit)). ``b`` is solved on a
  separate calibration draw so that the CTR is ~25%. The metadata records the oracle AUC / log
  loss of the true probabilities per split (the keys :func:`embedtrain.datagen.generate_ctr`
  writes) and a ``drift`` section: per feature the distinct ids of each split and of each
  period, and ``unseen_in_train_share``, the share of valid/test lookups whose id never occurs
  in train: what an offline vocabulary maps to its unknown bucket.

Output layout as :func:`embedtrain.datagen.generate_ctr`: ``train/``, ``valid/``, ``test/``
``part-NNNNN.parquet`` files and ``metadata.json``; sparse entries carry ``"raw": true`` and
``num_embeddings`` = the distinct ids of the training split. Rows are generated in chunks of at
most 250,000 (memory stays well under 1 GB for millions of rows).

Example:
    >>> from embedtrain.datagen import DriftDataSpec, generate_ctr_drift
    >>> meta = generate_ctr_drift(DriftDataSpec(rows=20_000), "/tmp/drift", progress=False)
    >>> meta["splits"]["test"]["files"]
    ['test/part-00000.parquet']
    >>> meta["drift"]["unseen_in_train_share"]["test"] > 0.5  # doctest: +SKIP
    True
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa

from embedtrain.datagen.ctr import (
    SIZE_CHECKS, SPLIT_FILE_CHECKS, SPLITS, SplitWriter, _sigmoid, check_fields, is_real,
    log_loss, prepare_out_dir, roc_auc)
from embedtrain.utils import is_int, progress_bar

_CHUNK_ROWS = 250_000
_CALIBRATION_ROWS = 50_000
_TARGET_CTR = 0.25
TIME_COLUMN = "period"
RAW_ID_LIMIT = 2**63 - 1  # raw ids lie in [0, RAW_ID_LIMIT), as the reader checks

# Per-feature knobs, cycled when there are more features: the new-id rate relative to
# new_ids_per_period (a spread of vocabulary sizes) and the sd of the per-id effects.
_ID_SCALES = (4.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.05)
_EFFECT_SD = (0.35, 0.4, 0.45, 0.35, 0.4, 0.45, 0.5, 0.3)
_DENSE_WEIGHTS = (0.3, -0.25, 0.2, -0.15)


@dataclass(frozen=True)
class DriftDataSpec:
    """Knobs of the drifting data set; validated on construction (``ValueError``)."""

    rows: int = 1_000_000            # total rows across splits, in time order
    seed: int = 0
    periods: int = 20                # time periods; splits are cut at period boundaries
    lifetime: int = 4                # periods an id stays alive from its birth
    new_ids_per_period: int = 2_000  # per feature, times the feature's scale (_ID_SCALES)
    dense_features: int = 4
    sparse_features: int = 8
    zipf_exponent: float = 1.05      # popularity ~ 1 / (rank + 1) ** a among the alive ids
    valid_fraction: float = 0.1      # of the periods (rounded, at least 1 if > 0)
    test_fraction: float = 0.1
    rows_per_row_group: int = 65_536
    rows_per_file: int = 1_000_000

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message naming the first bad field."""
        checks = [
            *SIZE_CHECKS,
            ("periods", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("lifetime", is_int, lambda v: v >= 1, "an integer >= 1"),
            # ~40 bytes per id are kept in memory: up to 4 * 23 * 1e6 ids for the largest feature
            ("new_ids_per_period", is_int, lambda v: 1 <= v <= 10**6,
             "an integer in [1, 1000000]"),
            ("dense_features", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("sparse_features", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("zipf_exponent", is_real, lambda v: 0 <= v < math.inf, "non-negative and finite"),
            *SPLIT_FILE_CHECKS,
        ]
        check_fields(self, checks)
        if self.rows < self.periods:
            raise ValueError(f"DriftDataSpec.rows must be >= periods ({self.periods}), "
                             f"got {self.rows!r}")
        n_train = split_periods(self)["train"]
        if n_train < 1:
            raise ValueError("DriftDataSpec.valid_fraction + test_fraction leave no training "
                             f"period out of {self.periods}")

    @property
    def dense_names(self) -> list[str]:
        return [f"I{i}" for i in range(1, self.dense_features + 1)]

    @property
    def sparse_names(self) -> list[str]:
        return [f"C{i}" for i in range(1, self.sparse_features + 1)]


def split_periods(spec: DriftDataSpec) -> dict[str, int]:
    """Periods per split: ``round(periods * fraction)`` (at least 1 for a positive fraction)."""
    def count(fraction: float) -> int:
        return max(1, math.floor(spec.periods * fraction + 0.5)) if fraction > 0 else 0

    n_valid, n_test = count(spec.valid_fraction), count(spec.test_fraction)
    return {"train": spec.periods - n_valid - n_test, "valid": n_valid, "test": n_test}


def period_splits(spec: DriftDataSpec) -> np.ndarray:
    """The split (0 train, 1 valid, 2 test) of each period, shape (periods,)."""
    n = split_periods(spec)
    return np.repeat(np.arange(3), [n["train"], n["valid"], n["test"]])


def period_starts(spec: DriftDataSpec) -> np.ndarray:
    """First row of each period and ``rows`` last, shape (periods + 1,): row ``i`` is in period
    ``floor(i * periods / rows)``, so period ``t`` starts at ``ceil(t * rows / periods)``."""
    t = np.arange(spec.periods + 1, dtype=np.int64)
    return -(-t * spec.rows // spec.periods)


def new_ids(spec: DriftDataSpec, feature: int) -> int:
    """New ids per period of sparse feature ``feature`` (0-based)."""
    scale = _ID_SCALES[feature % len(_ID_SCALES)]
    return max(1, int(round(spec.new_ids_per_period * scale)))


# --- raw id values -------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix63(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on 63 bits: each step (xor with a right shift, product with an odd
    constant mod 2^63) is a bijection of [0, 2^63), so the whole is one."""
    m = np.uint64(_MASK63)
    x = x ^ (x >> np.uint64(30))
    x = (x * np.uint64(0xBF58476D1CE4E5B9)) & m
    x = x ^ (x >> np.uint64(27))
    x = (x * np.uint64(0x94D049BB133111EB)) & m
    return x ^ (x >> np.uint64(31))


def _id_key(seed: int, feature: int) -> int:
    """The offset in ``[0, 2^63 - 1)`` that :func:`raw_ids` adds to a feature's id indices."""
    return _splitmix64(_splitmix64(seed) ^ (feature + 1)) % RAW_ID_LIMIT


def raw_ids(seed: int, feature: int, index: np.ndarray) -> np.ndarray:
    """Raw int64 id values of id indices ``index`` (in ``[0, 2^63 - 1)``) of one feature.

    ``x = (index + key) mod (2^63 - 1)`` (key from seed and feature) is a bijection onto
    ``[0, 2^63 - 1)``; :func:`_mix63` permutes ``[0, 2^63)``, and cycle walking (mix again while
    the value is ``2^63 - 1``) makes it a permutation of ``[0, 2^63 - 1)``. So distinct indices
    give distinct ids, never ``2^63 - 1``.
    """
    x = ((np.asarray(index, dtype=np.uint64) + np.uint64(_id_key(seed, feature)))
         % np.uint64(RAW_ID_LIMIT))
    y = _mix63(x)
    top = y == np.uint64(RAW_ID_LIMIT)
    while top.any():
        y[top] = _mix63(y[top])
        top = y == np.uint64(RAW_ID_LIMIT)
    return y.astype(np.int64)


# --- the planted model ---------------------------------------------------------------------------

class DriftModel:
    """Id lifecycles, popularity and the ground-truth click model, all derived from the spec.

    Ids of feature ``f`` are indexed ``0 .. total[f] - 1`` in birth order: index ``j`` is born
    in period ``j // n[f] - (lifetime - 1)``, so the ids alive in period ``t`` are the indices
    ``[t * n[f], (t + lifetime) * n[f])``.
    """

    def __init__(self, spec: DriftDataSpec):
        self.spec = spec
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0]))
        self.names = spec.sparse_names
        self.n = [new_ids(spec, f) for f in range(spec.sparse_features)]
        self.total = [(spec.periods + spec.lifetime - 1) * n for n in self.n]
        self.alive = [spec.lifetime * n for n in self.n]
        self.sd = [_EFFECT_SD[f % len(_EFFECT_SD)] for f in range(spec.sparse_features)]
        self.dense_w = np.array([_DENSE_WEIGHTS[d % len(_DENSE_WEIGHTS)]
                                 for d in range(spec.dense_features)])
        self.key, self.effect, self.cdf = [], [], []
        for f in range(spec.sparse_features):
            self.key.append(rng.random(self.total[f]))  # popularity order among the alive ids
            self.effect.append(rng.normal(0.0, self.sd[f], self.total[f]))
            w = np.arange(1, self.alive[f] + 1, dtype=np.float64) ** -spec.zipf_exponent
            self.cdf.append(np.cumsum(w))
        self.raw = [raw_ids(spec.seed, f, np.arange(self.total[f]))
                    for f in range(spec.sparse_features)]
        self._orders: dict[int, list[np.ndarray]] = {}
        self.bias = 0.0
        calib = np.random.default_rng(np.random.SeedSequence([spec.seed, 1]))
        per_period = -(-_CALIBRATION_ROWS // spec.periods)
        z = np.concatenate([self.logit(*self.draw(calib, t, per_period))
                            for t in range(spec.periods)])
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _sigmoid(z + mid).mean() < _TARGET_CTR else (lo, mid)
        self.bias = (lo + hi) / 2

    def order(self, t: int) -> list[np.ndarray]:
        """Per feature, the indices of the ids alive in period ``t``, most popular first."""
        if t not in self._orders:  # rows come period by period: keep only the latest
            self._orders = {t: [lo + np.argsort(self.key[f][lo:lo + self.alive[f]],
                                                kind="stable")
                                for f, lo in enumerate(n * t for n in self.n)]}
        return self._orders[t]

    def draw(self, rng: np.random.Generator, t: int, rows: int
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        """``rows`` rows of period ``t``: dense values (dense_features, rows) and per feature
        the id indices (rows,)."""
        dense = rng.standard_normal((self.spec.dense_features, rows), dtype=np.float32)
        idx = []
        for f, order in enumerate(self.order(t)):
            cdf = self.cdf[f]
            r = np.searchsorted(cdf, rng.random(rows) * cdf[-1], side="right")
            idx.append(order[np.minimum(r, len(cdf) - 1)])  # guards float round-off at 1.0
        return dense, idx

    def logit(self, dense: np.ndarray, idx: list[np.ndarray]) -> np.ndarray:
        out = self.bias + self.dense_w @ dense.astype(np.float64)
        for f, j in enumerate(idx):
            out += self.effect[f][j]
        return out

    def schema(self) -> pa.Schema:
        return pa.schema([pa.field("label", pa.int8())]
                         + [pa.field(n, pa.float32()) for n in self.spec.dense_names]
                         + [pa.field(n, pa.int64()) for n in self.names]
                         + [pa.field(TIME_COLUMN, pa.int32())])

    def table(self, dense: np.ndarray, idx: list[np.ndarray], labels: np.ndarray, t: int
              ) -> pa.Table:
        n = len(labels)
        cols = ([pa.array(labels.astype(np.int8))] + [pa.array(row) for row in dense]
                + [pa.array(self.raw[f][j]) for f, j in enumerate(idx)]
                + [pa.array(np.full(n, t, dtype=np.int32))])
        return pa.Table.from_arrays(cols, schema=self.schema())

    def description(self) -> str:
        dense = " ".join(f"{w:+.2f}*{n}" for n, w in zip(self.spec.dense_names, self.dense_w))
        effects = ", ".join(f"{c}:{sd}" for c, sd in zip(self.names, self.sd))
        return (f"logit = b {dense} + per-id effects e[id] ~ N(0, sd) on {effects}; "
                f"dense ~ N(0, 1); b gives CTR~{_TARGET_CTR}")


# --- the generator -------------------------------------------------------------------------------

def columns_meta(spec: DriftDataSpec, model: DriftModel, distinct: dict[str, int]) -> dict:
    """``metadata.json``'s columns: raw int64 sparse features sized by ``distinct`` ids."""
    return {
        "format_version": 1, "name": "synthetic_ctr_drift", "label": "label",
        "dense": spec.dense_names, "dense_transform": "none",
        "sparse": [{"name": name, "num_embeddings": max(1, distinct[name]), "multi_hot": False,
                    "max_length": 1, "raw": True} for name in model.names],
    }


def period_rows(model: DriftModel, t: int, starts: np.ndarray
                ) -> Iterator[tuple[pa.Table, list[np.ndarray], np.ndarray, np.ndarray]]:
    """Period ``t``'s rows in chunks of at most ``_CHUNK_ROWS``: ``(table, id indices per
    feature, true click probabilities, labels)``, each chunk drawn from its own seed."""
    spec = model.spec
    for c, lo in enumerate(range(int(starts[t]), int(starts[t + 1]), _CHUNK_ROWS)):
        n = min(_CHUNK_ROWS, int(starts[t + 1]) - lo)
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 2, t, c]))
        dense, idx = model.draw(rng, t, n)
        p = _sigmoid(model.logit(dense, idx))
        y = rng.random(n) < p
        yield model.table(dense, idx, y, t), idx, p, y


def _finite(x: float) -> Optional[float]:  # JSON has no NaN (e.g. an empty split)
    return None if math.isnan(x) else x


def generate_ctr_drift(spec: DriftDataSpec, out_dir: str | os.PathLike,
                       progress: bool = True) -> dict:
    """Write ``out_dir/{train,valid,test}/part-NNNNN.parquet`` and ``out_dir/metadata.json``.

    An earlier data set in ``out_dir`` is replaced as by :func:`embedtrain.datagen.generate_ctr`
    (``FileExistsError`` for split folders holding foreign files and no ``metadata.json``). The
    same spec always gives identical files.

    Args:
        spec: size, seed, drift knobs and file layout.
        out_dir: destination folder (created if missing).
        progress: show a progress bar on stderr (rows done / total, rows/s).

    Returns:
        The metadata dict that was written to ``metadata.json``.
    """
    spec.validate()
    out = prepare_out_dir(out_dir)
    model = DriftModel(spec)
    writers = {s: SplitWriter(out, s, spec, model.schema()) for s in SPLITS}
    probs: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    labels: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    n_features = spec.sparse_features
    in_train = [np.zeros(k, dtype=bool) for k in model.total]
    in_split = {s: [np.zeros(k, dtype=bool) for k in model.total] for s in SPLITS}
    unseen = {s: np.zeros(n_features, dtype=np.int64) for s in SPLITS}
    per_period = [[] for _ in range(n_features)]
    starts, splits = period_starts(spec), period_splits(spec)
    with progress_bar(spec.rows, "datagen", disable=not progress) as bar:
        for t in range(spec.periods):
            s = SPLITS[splits[t]]
            seen_now = [np.zeros(k, dtype=bool) for k in model.total]
            for table, idx, p, y in period_rows(model, t, starts):
                n = len(y)
                writers[s].add(table)
                probs[s].append(p)
                labels[s].append(y)
                for f, j in enumerate(idx):
                    seen_now[f][j] = True
                    in_split[s][f][j] = True
                    if s == "train":
                        in_train[f][j] = True
                    else:  # train periods all come first: in_train is complete here
                        unseen[s][f] += int(np.count_nonzero(~in_train[f][j]))
                bar.update(n)
            for f in range(n_features):
                per_period[f].append(int(np.count_nonzero(seen_now[f])))
    for w in writers.values():
        if not w.pending:  # a split without periods still gets one (empty) file
            w.add(model.schema().empty_table())
        w.close()

    p_all = {s: np.concatenate([np.zeros(0), *probs[s]]) for s in SPLITS}
    y_all = {s: np.concatenate([np.zeros(0, dtype=bool), *labels[s]]) for s in SPLITS}
    rows = {s: writers[s].rows for s in SPLITS}

    def share(s: str, f: Optional[int] = None) -> Optional[float]:
        """Share of split ``s``'s lookups (of feature ``f``; of all features) unseen in train."""
        if not rows[s]:
            return None
        if f is None:
            return float(unseen[s].sum() / (rows[s] * n_features))
        return float(unseen[s][f] / rows[s])

    n_periods = split_periods(spec)
    first = np.cumsum([0] + [n_periods[s] for s in SPLITS])
    features = {}
    for f, name in enumerate(model.names):
        features[name] = {
            "new_ids_per_period": model.n[f],
            "alive_ids_per_period": model.alive[f],
            "ids_total": model.total[f],
            "effect_sd": model.sd[f],
            "distinct_ids": {s: int(np.count_nonzero(in_split[s][f])) for s in SPLITS},
            "distinct_ids_per_period": per_period[f],
            "unseen_in_train_share": {s: share(s, f) for s in ("valid", "test")},
        }
    meta = {
        **columns_meta(spec, model, {n: features[n]["distinct_ids"]["train"] for n in model.names}),
        "splits": {s: {"files": writers[s].files, "rows": rows[s]} for s in SPLITS},
        "oracle_auc": {s: _finite(roc_auc(p_all[s], y_all[s])) for s in SPLITS},
        "oracle_logloss": {s: _finite(log_loss(p_all[s], y_all[s])) for s in SPLITS},
        "ctr": {s: float(y_all[s].mean()) if len(y_all[s]) else None for s in SPLITS},
        "drift": {
            "time_column": TIME_COLUMN,
            "periods": spec.periods,
            "lifetime": spec.lifetime,
            "new_ids_per_period": spec.new_ids_per_period,
            "zipf_exponent": float(spec.zipf_exponent),
            "split_periods": {s: [int(first[k]), int(first[k + 1])]
                              for k, s in enumerate(SPLITS)},  # [first, stop)
            "period_rows": [int(r) for r in np.diff(starts)],
            "unseen_in_train_share": {s: share(s) for s in ("valid", "test")},
            "features": features,
        },
        "generator": {"seed": int(spec.seed), "rows": int(spec.rows),
                      "planted": model.description()},
    }
    tmp = out / "metadata.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "metadata.json")
    return meta
