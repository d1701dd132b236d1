"""Deterministic synthetic CTR data in the Criteo layout, with a planted click model.

Rows carry a 0/1 ``label``, 13 dense counts ``I1..I13`` and 26 integer-encoded
categorical features ``C1..C26`` (``C24..C26`` are multi-hot lists). Labels are
drawn from a known click probability, so the metadata can report the oracle
AUC / log loss that a perfect model would reach on each split.

Two planted click models share that layout (:class:`CTRStructure`, ``CTRDataSpec.structure``):
``criteo`` (the default) mixes dense, per-id, head, pairwise-table, dense-by-id and multi-hot
terms; ``fm`` is shaped like user-item interaction logs: per-id biases plus rank-8 latent-factor
interactions between three user-like and three item-like fields (:mod:`.ctr_clicks`).

Example:
    >>> from embedtrain.datagen import CTRDataSpec, generate_ctr
    >>> meta = generate_ctr(CTRDataSpec(rows=20_000, seed=1), "/tmp/ctr", progress=False)
    >>> meta["splits"]["train"]["files"]
    ['train/part-00000.parquet']
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedtrain.datagen.ctr_clicks import (  # noqa: F401  (CTRStructure: the spec's)
    _CLICK_MODELS, _TARGET_CTR, CTRStructure, _Chunk)
from embedtrain.utils import is_int, progress_bar

DENSE_NAMES = [f"I{i}" for i in range(1, 14)]
SPARSE_NAMES = [f"C{i}" for i in range(1, 27)]
MULTI_HOT = ("C24", "C25", "C26")
MAX_LENGTH = 5
SPLITS = ("train", "valid", "test")
_CHUNK_ROWS = 250_000
_CALIBRATION_ROWS = 50_000
_PART_RE = re.compile(r"part-\d{5}\.parquet")

# Criteo-like counts: a share of zeros, then a log-normal body with a long tail.
_DENSE_MU = np.array([0.5 + 0.35 * ((5 * j) % 13) for j in range(13)])
_DENSE_SIGMA = np.array([0.9 + 0.15 * (j % 5) for j in range(13)])
_DENSE_ZERO = np.array([0.05 + 0.1 * (j % 4) for j in range(13)])

def vocab_size(index: int) -> int:
    """Vocabulary size of sparse feature ``C{index + 1}`` (0-based ``index``).

    Sizes are log-uniform from 4 to 200,000; a fixed stride scrambles their
    order so that neighbouring features differ widely. Total is ~569k ids.
    """
    rank = (7 * index + 3) % len(SPARSE_NAMES)
    return int(round(4 * (200_000 / 4) ** (rank / (len(SPARSE_NAMES) - 1))))


_SCHEMA = pa.schema(
    [pa.field("label", pa.int8())] + [pa.field(n, pa.int64()) for n in DENSE_NAMES]
    + [pa.field(n, pa.list_(pa.int64()) if n in MULTI_HOT else pa.int64()) for n in SPARSE_NAMES])


@dataclass(frozen=True)
class CTRDataSpec:
    """Knobs of the synthetic data set; validated on construction (``ValueError``)."""

    rows: int = 1_000_000            # total rows across splits
    seed: int = 0
    valid_fraction: float = 0.1
    test_fraction: float = 0.1
    rows_per_row_group: int = 65_536
    rows_per_file: int = 1_000_000   # a split larger than this gets several part files
    zipf_exponent: float = 1.1
    structure: CTRStructure = CTRStructure.CRITEO   # or its value: "criteo", "fm"

    def __post_init__(self) -> None:
        if isinstance(self.structure, str):  # "fm" -> CTRStructure.FM; a bad one fails validate()
            by_value = {s.value: s for s in CTRStructure}
            object.__setattr__(self, "structure", by_value.get(self.structure, self.structure))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message naming the first bad field."""
        checks = [
            *SIZE_CHECKS,
            *SPLIT_FILE_CHECKS,
            ("zipf_exponent", is_real, lambda v: 0 < v < math.inf, "positive and finite"),
            ("structure", lambda v: isinstance(v, CTRStructure), lambda v: True,
             "one of " + ", ".join(s.value for s in CTRStructure)),
        ]
        check_fields(self, checks)
        if self.valid_fraction + self.test_fraction >= 1:
            raise ValueError("CTRDataSpec.valid_fraction + test_fraction must be < 1, got "
                             f"{self.valid_fraction + self.test_fraction!r}")


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC: the Mann-Whitney U statistic with average ranks for tied scores.

    The oracle AUC of the metadata, in NumPy so that datagen needs no torch. It is the metric
    the trainer reports (``torchmetrics.classification.BinaryAUROC``, exact): a test checks the
    two agree to 1e-9, ties included.

    Args:
        scores: predicted scores or probabilities, shape (n,).
        labels: 0/1 (or bool) labels, shape (n,).

    Returns:
        P(score_pos > score_neg) + P(tie) / 2, or NaN if either class is absent.
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    n, n_pos = len(scores), int(labels.sum())
    n_neg = n - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], n]
    ranks = np.empty(n)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)  # 1-based average rank
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(p: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities ``p`` against 0/1 ``labels``; NaN if empty."""
    if len(p) == 0:
        return float("nan")
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1 - 1e-12)
    y = np.asarray(labels).astype(bool)
    return float(-np.mean(np.where(y, np.log(p), np.log1p(-p))))


@lru_cache(maxsize=1)
def _dense_stats() -> tuple[np.ndarray, np.ndarray]:
    # Fixed seed: the dense marginals do not depend on the spec, so neither do these.
    d = _draw_dense(np.random.default_rng(20_240_601), 200_000)
    z = np.log1p(d)
    return z.mean(axis=1), z.std(axis=1)


def _draw_dense(rng: np.random.Generator, n: int) -> np.ndarray:
    d = np.floor(rng.lognormal(_DENSE_MU[:, None], _DENSE_SIGMA[:, None], size=(13, n)))
    d = d.astype(np.int64)
    d[rng.random((13, n)) < _DENSE_ZERO[:, None]] = 0
    return d  # (13, n), one contiguous row per feature


class PlantedModel:
    """Feature distributions plus the ground-truth click model, all derived from the spec.

    For a seed, both structures draw the same dense counts, lists and ids, but for the eight
    fields that carry the fm signal, whose ids are more concentrated with ``fm``; the labels
    differ.
    """

    def __init__(self, spec: CTRDataSpec):
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0]))
        self.structure = spec.structure
        clicks = _CLICK_MODELS[spec.structure]
        self.vocab = {name: vocab_size(i) for i, name in enumerate(SPARSE_NAMES)}
        self.pmf, self.cdf, self.perm = {}, {}, {}
        for name, v in self.vocab.items():
            exponent = clicks.zipf_exponents.get(name, spec.zipf_exponent)
            w = np.arange(1, v + 1, dtype=np.float64) ** -exponent
            self.pmf[name] = w / w.sum()
            self.cdf[name] = np.cumsum(self.pmf[name])
            # so that id 0 is not always the most frequent one
            self.perm[name] = rng.permutation(v).astype(np.int64)
        self.clicks = clicks(rng, self.vocab, self.pmf)
        self.dense_mean, self.dense_std = _dense_stats()
        # The intercept is solved on a separate calibration draw so the CTR is ~25% for any seed.
        self.bias = 0.0
        calib = np.random.default_rng(np.random.SeedSequence([spec.seed, 1]))
        z = self.logit(self.draw(calib, _CALIBRATION_ROWS))
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _sigmoid(z + mid).mean() < _TARGET_CTR else (lo, mid)
        self.bias = (lo + hi) / 2

    def draw(self, rng: np.random.Generator, n: int) -> _Chunk:
        dense = _draw_dense(rng, n)
        ranks, lengths = {}, {}
        for name in SPARSE_NAMES:
            m = n
            if name in MULTI_HOT:
                lengths[name] = rng.binomial(MAX_LENGTH, 0.45, size=n)  # ~5% empty lists
                m = int(lengths[name].sum())
            # Inverse-CDF sampling of the truncated Zipf law.
            u = rng.random(m) * self.cdf[name][-1]
            r = np.searchsorted(self.cdf[name], u, side="right")
            ranks[name] = np.minimum(r, self.vocab[name] - 1)  # guards float round-off at 1.0
        return _Chunk(dense, ranks, lengths)

    def _z(self, chunk: _Chunk, name: str) -> np.ndarray:
        j = DENSE_NAMES.index(name)
        return (np.log1p(chunk.dense[j]) - self.dense_mean[j]) / self.dense_std[j]

    def logit(self, ch: _Chunk) -> np.ndarray:
        """The true click logit of each row of ``ch``; ``sigmoid`` of it is the oracle."""
        out = np.full(ch.dense.shape[1], self.bias)
        return self.clicks.logit(ch, lambda name: self._z(ch, name), out)

    def table(self, ch: _Chunk, labels: np.ndarray) -> pa.Table:
        n = ch.dense.shape[1]
        cols = [pa.array(labels.astype(np.int8))] + [pa.array(ch.dense[j]) for j in range(13)]
        for name in SPARSE_NAMES:
            ids = pa.array(self.perm[name][ch.ranks[name]])
            if name in MULTI_HOT:
                offsets = np.zeros(n + 1, dtype=np.int32)
                np.cumsum(ch.lengths[name], out=offsets[1:])
                ids = pa.ListArray.from_arrays(pa.array(offsets), ids)
            cols.append(ids)
        return pa.Table.from_arrays(cols, schema=_SCHEMA)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def planted_description(structure: CTRStructure = CTRStructure.CRITEO) -> str:
    """One-line human description of the planted click model of ``structure``."""
    return _CLICK_MODELS[structure].description()


class _Rows(NamedTuple):
    """One chunk of generated rows: raw draws, click probabilities, 0/1 labels, split ids."""

    index: int            # chunk number (seeds per-chunk side draws, e.g. the TSV form's nulls)
    draw: _Chunk
    p: np.ndarray
    labels: np.ndarray    # bool
    split: np.ndarray     # 0 train, 1 valid, 2 test (datagen's own split; the TSV form ignores it)


def iter_chunks(spec: CTRDataSpec, model: PlantedModel) -> Iterator[_Rows]:
    """The data set's rows in chunks; every output format (parquet, TSV) draws them from here."""
    for i, lo in enumerate(range(0, spec.rows, _CHUNK_ROWS)):
        n = min(_CHUNK_ROWS, spec.rows - lo)
        # One generator per chunk: a data set is a prefix of a larger one with the same seed.
        rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 2, i]))
        chunk = model.draw(rng, n)
        p = _sigmoid(model.logit(chunk))
        y = rng.random(n) < p
        u = rng.random(n)
        split = np.where(u < spec.test_fraction, 2,
                         np.where(u < spec.test_fraction + spec.valid_fraction, 1, 0))
        yield _Rows(i, chunk, p, y, split)


class SplitWriter:
    """Buffers rows of one split into full row groups and rolls over to a new part file.

    ``spec`` gives the layout (``rows_per_row_group``, ``rows_per_file``); ``schema`` the
    columns (default: the CTR data set's).
    """

    def __init__(self, out_dir: Path, split: str, spec: Any, schema: Optional[pa.Schema] = None):
        self.dir, self.split, self.spec = out_dir / split, split, spec
        self.schema = _SCHEMA if schema is None else schema
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pending: list[pa.Table] = []
        self.n_pending = self.rows = self.file_rows = 0
        self.files: list[str] = []
        self.writer: pq.ParquetWriter | None = None

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.n_pending += table.num_rows
        while self.n_pending >= self._next_size():
            self._flush(self._next_size())

    def _next_size(self) -> int:
        return min(self.spec.rows_per_row_group, self.spec.rows_per_file - self.file_rows)

    def _flush(self, k: int) -> None:
        t = pa.concat_tables(self.pending)
        if self.writer is None:
            name = f"part-{len(self.files):05d}.parquet"
            self.files.append(f"{self.split}/{name}")
            self.writer = pq.ParquetWriter(self.dir / name, self.schema)
        if k:
            self.writer.write_table(t.slice(0, k), row_group_size=k)
        self.pending, self.n_pending = [t.slice(k)], self.n_pending - k
        self.rows, self.file_rows = self.rows + k, self.file_rows + k
        if self.file_rows == self.spec.rows_per_file:
            self.writer.close()
            self.writer, self.file_rows = None, 0

    def close(self) -> None:
        if self.n_pending or not self.files:  # an empty split still gets one (empty) file
            self._flush(self.n_pending)
        if self.writer is not None:
            self.writer.close()


def is_real(x: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_fields(spec: Any, checks: list) -> None:
    """Raises ``ValueError("Spec.field must be ..., got ...")`` for the first failing check.

    ``checks``: ``(field, type_ok, value_ok, wanted)`` tuples, in order.
    """
    for name, type_ok, value_ok, want in checks:
        v = getattr(spec, name)
        if not (type_ok(v) and value_ok(v)):
            raise ValueError(f"{type(spec).__name__}.{name} must be {want}, got {v!r}")


# Field checks (name, type test, value test, what it must be) shared by the data set specs.
SIZE_CHECKS = [
    ("rows", is_int, lambda v: v >= 10, "an integer >= 10"),
    ("seed", is_int, lambda v: v >= 0, "a non-negative integer"),
]
SPLIT_FILE_CHECKS = [
    ("valid_fraction", is_real, lambda v: 0 <= v < 1, "in [0, 1)"),
    ("test_fraction", is_real, lambda v: 0 <= v < 1, "in [0, 1)"),
    ("rows_per_row_group", is_int, lambda v: v >= 1, "an integer >= 1"),
    ("rows_per_file", is_int, lambda v: v >= 1, "an integer >= 1"),
]


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir``, created, with an earlier data set's splits and metadata removed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clear_old(out)
    return out


def clear_old(out: Path) -> None:
    had_meta = (out / "metadata.json").exists()
    for split in SPLITS:  # without metadata, only ever delete our own leftovers (an aborted run)
        d = out / split
        foreign = d.is_dir() and any(not _PART_RE.fullmatch(f.name) for f in d.iterdir())
        if foreign and not had_meta:
            raise FileExistsError(f"{d} holds files not written by datagen; refusing to overwrite")
    (out / "metadata.json").unlink(missing_ok=True)
    for split in SPLITS:
        shutil.rmtree(out / split, ignore_errors=True)


def generate_ctr(spec: CTRDataSpec, out_dir: str | os.PathLike, progress: bool = True) -> dict:
    """Write ``out_dir/{train,valid,test}/part-NNNNN.parquet`` and ``out_dir/metadata.json``.

    If ``out_dir`` already holds a data set (a ``metadata.json``), it is replaced:
    the old metadata and split folders are removed first. Without a
    ``metadata.json``, split folders holding anything but ``part-*.parquet``
    files raise ``FileExistsError``. The same spec always gives identical data.

    ``spec.structure`` picks the planted click model; with ``fm`` the metadata's ``name`` is
    ``synthetic_ctr_fm`` and ``generator.structure`` is ``"fm"`` (the default, ``criteo``,
    writes no ``structure`` key: its metadata is what it was before the option existed).

    Args:
        spec: size, seed, split fractions, file layout and planted model.
        out_dir: destination folder (created if missing).
        progress: show a progress bar on stderr (rows done / total, rows/s).

    Returns:
        The metadata dict that was written to ``metadata.json``.

    Example:
        >>> meta = generate_ctr(CTRDataSpec(rows=100_000), "/tmp/ctr", progress=False)
        >>> round(meta["oracle_auc"]["test"], 2)  # doctest: +SKIP
        0.79
    """
    spec.validate()
    out = prepare_out_dir(out_dir)
    model = PlantedModel(spec)
    writers = {s: SplitWriter(out, s, spec) for s in SPLITS}
    probs: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    labels: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    with progress_bar(spec.rows, "datagen", disable=not progress) as bar:
        for chunk in iter_chunks(spec, model):
            table = model.table(chunk.draw, chunk.labels)
            for k, s in enumerate(SPLITS):
                mask = chunk.split == k
                writers[s].add(table.filter(pa.array(mask)))
                probs[s].append(chunk.p[mask])
                labels[s].append(chunk.labels[mask])
            bar.update(len(chunk.p))
    for w in writers.values():
        w.close()

    def finite(x: float) -> float | None:  # JSON has no NaN (e.g. an empty split)
        return None if math.isnan(x) else x

    p_all = {s: np.concatenate(probs[s]) for s in SPLITS}
    y_all = {s: np.concatenate(labels[s]) for s in SPLITS}
    fm = spec.structure is CTRStructure.FM
    meta = {
        "format_version": 1,
        "name": "synthetic_ctr_fm" if fm else "synthetic_ctr",
        "label": "label",
        "dense": DENSE_NAMES,
        "dense_transform": "log1p",
        "sparse": [{"name": c, "num_embeddings": model.vocab[c], "multi_hot": c in MULTI_HOT,
                    "max_length": MAX_LENGTH if c in MULTI_HOT else 1} for c in SPARSE_NAMES],
        "splits": {s: {"files": writers[s].files, "rows": writers[s].rows} for s in SPLITS},
        "oracle_auc": {s: finite(roc_auc(p_all[s], y_all[s])) for s in SPLITS},
        "oracle_logloss": {s: finite(log_loss(p_all[s], y_all[s])) for s in SPLITS},
        "ctr": {s: finite(float(y_all[s].mean())) if len(y_all[s]) else None for s in SPLITS},
        "generator": {"seed": int(spec.seed), "rows": int(spec.rows),
                      "zipf_exponent": float(spec.zipf_exponent),
                      **({"structure": spec.structure.value} if fm else {}),
                      "planted": planted_description(spec.structure)},
    }
    tmp = out / "metadata.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "metadata.json")
    return meta
