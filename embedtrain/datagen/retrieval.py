"""Deterministic synthetic retrieval data: query rows, an item table, a planted two-tower model
and its oracle recall@k (``embedtrain datagen retrieval``).

The planted model (all parameters from the spec's seed), in ``dim`` dimensions, every vector of
unit length (``unit``):

- ``categories`` category directions ``c_k``; ``brands`` brands, each of a random category, with
  ``b = unit(c_category + brand_noise * g)``; ``items`` items, each of a random brand, with
  ``v_j = unit(b_brand + item_noise * g_j)`` (``g``: Gaussian, ``N(0, I / dim)``): an item's
  features (category, brand) say most of where it lies, its own id the rest.
- ``segments`` user segments ``s_z``; user ``u`` is of a random segment ``z``; with
  ``attributes`` further user attributes ``a`` (``attribute_values`` values each, directions
  ``w_{a,v}``), user ``u`` has a random value ``v_a`` of each, and ``q_u = unit(s_z + sum_a
  w_{a,v_a} + user_noise * g_u)``: the more attributes, the more of the user its observed
  features say (``attributes`` 0: the segment alone).
- A user's events are independent draws of ``P(j | u) ∝ exp(sharpness * <q_u, v_j>)``. A share
  ``cold_fraction`` of the items is *cold*: never drawn for training (the draw is repeated), drawn
  like any other item for validation and test, so only their features can retrieve them.
- ``n = min_events + Geometric(mean mean_extra_events)`` events a user (at most ``max_events``);
  leave-last-out: the last event is the test row's item, the one before the validation row's,
  the others train rows, oldest first.

Rows (``train``/``valid``/``test``): ``user`` (int64), ``segment`` (int64), ``attr0``,
``attr1``, ... (int64, one column per attribute), ``history``
(list<int64>: the user's events before the row's, newest last, at most ``max_length``), ``item``
(int64: the label, an id of the item table). ``items.parquet`` holds every item's ``item``,
``category`` and ``brand`` (cold ones included): what an item tower embeds. Ids are ``0..N-1``.

The oracle ranks all items by ``P(j | u)`` (the events are independent, so the history adds
nothing once ``q_u`` is known): ``oracle_recall@k`` per split is the share of rows whose item is
in that top ``k``, ``oracle_expected_recall@k`` the mean top-``k`` probability (its expectation,
with less sampling noise); ``k`` 10 and 50. With the defaults (100k users, 50k items, 3 user
attributes, about 40 events a user: 4.0M events) generation takes about two minutes on two
cores, most of it the ``users x items`` scores. ``--attributes 0 --user-noise 0.6
--mean-extra-events 6 --max-events 50`` is the first version's set, where no query feature
holds most of the user.

Example:
    >>> from embedtrain.datagen.retrieval import RetrievalDataSpec, generate_retrieval
    >>> meta = generate_retrieval(RetrievalDataSpec(users=2_000, items=5_000), "/tmp/ret",
    ...                           progress=False)
    >>> meta["task"], meta["num_classes"], meta["splits"]["test"]["rows"]
    ('retrieval', 5000, 2000)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedtrain.datagen.ctr import SPLITS, SplitWriter, check_fields, is_real, prepare_out_dir
from embedtrain.datagen.seq import _events_folder, _write_events, list_slices
from embedtrain.utils import is_int, progress_bar

ITEMS_FILE = "items.parquet"
ITEM_FEATURES = ("category", "brand")
KS = (10, 50)
_BLOCK_USERS = 256  # users scored at a time: 256 x items float64 CDFs


def attribute_names(spec: "RetrievalDataSpec") -> list[str]:
    """The rows' user attribute columns: ``attr0``, ``attr1``, ..."""
    return [f"attr{a}" for a in range(spec.attributes)]


def row_schema(spec: "RetrievalDataSpec") -> pa.Schema:
    """The split files' schema."""
    return pa.schema([pa.field("user", pa.int64()), pa.field("segment", pa.int64())]
                     + [pa.field(n, pa.int64()) for n in attribute_names(spec)]
                     + [pa.field("history", pa.list_(pa.int64())), pa.field("item", pa.int64())])


@dataclass
class RetrievalDataSpec:
    """Sizes and knobs of :func:`generate_retrieval`; a bad value raises a one-line
    ``ValueError`` naming the field."""

    users: int = 100_000
    items: int = 50_000
    dim: int = 16
    segments: int = 50
    attributes: int = 3                   # user attributes beside the segment (attr0, ...)
    attribute_values: int = 10            # the values of each attribute
    categories: int = 100
    brands: int = 1_000
    min_events: int = 4                   # events per user, at least (>= 3: train, valid, test)
    mean_extra_events: float = 40.0       # mean of the geometric count above min_events
    max_events: int = 100
    max_length: int = 20                  # the history kept in a row
    cold_fraction: float = 0.05           # items never drawn for training
    sharpness: float = 25.0               # P(j | u) ∝ exp(sharpness <q_u, v_j>)
    user_noise: float = 0.2
    item_noise: float = 0.3
    brand_noise: float = 0.6
    seed: int = 0
    rows_per_row_group: int = 65_536
    rows_per_file: int = 1_000_000

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` with a one-line message naming the first bad field."""
        noise = (is_real, lambda v: 0 <= v < math.inf, "non-negative and finite")
        check_fields(self, [
            ("users", is_int, lambda v: v >= 10, "an integer >= 10"),
            ("items", is_int, lambda v: v >= 100, "an integer >= 100"),
            ("dim", is_int, lambda v: v >= 2, "an integer >= 2"),
            ("segments", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("attributes", is_int, lambda v: 0 <= v <= 32, "an integer in [0, 32]"),
            ("attribute_values", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("categories", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("brands", is_int, lambda v: 1 <= v <= self.items, "an integer in [1, items]"),
            ("max_events", is_int, lambda v: v >= 3, "an integer >= 3"),
            ("min_events", is_int, lambda v: 3 <= v <= self.max_events,
             f"an integer in [3, max_events={self.max_events}]"),
            ("mean_extra_events", *noise),
            ("max_length", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("cold_fraction", is_real, lambda v: 0 <= v <= 0.5, "in [0, 0.5]"),
            ("sharpness", is_real, lambda v: 0 < v < 1000, "in (0, 1000)"),
            ("user_noise", *noise), ("item_noise", *noise), ("brand_noise", *noise),
            ("seed", is_int, lambda v: v >= 0, "a non-negative integer"),
            ("rows_per_row_group", is_int, lambda v: v >= 1, "an integer >= 1"),
            ("rows_per_file", is_int, lambda v: v >= 1, "an integer >= 1"),
        ])


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class PlantedTowers(NamedTuple):
    """The planted model: item features and vectors, user segments and vectors, cold items."""

    category: np.ndarray   # [items] int64
    brand: np.ndarray      # [items] int64
    item_vectors: np.ndarray   # [items, dim] float32
    segment: np.ndarray    # [users] int64
    user_vectors: np.ndarray   # [users, dim] float32
    cold: np.ndarray       # [items] bool
    attributes: np.ndarray  # [users, attributes] int64
    brand_vectors: np.ndarray  # [brands, dim] float64: an item lies around its brand's


def planted_towers(spec: RetrievalDataSpec) -> PlantedTowers:
    """The spec's planted model (its own random stream: the seed and 0)."""
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 0]))
    d = spec.dim

    def gauss(n: int) -> np.ndarray:
        return rng.standard_normal((n, d)) / math.sqrt(d)

    cat_vec = _unit(rng.standard_normal((spec.categories, d)))
    brand_cat = rng.integers(spec.categories, size=spec.brands)
    brand_vec = _unit(cat_vec[brand_cat] + spec.brand_noise * gauss(spec.brands))
    brand = rng.integers(spec.brands, size=spec.items)
    items = _unit(brand_vec[brand] + spec.item_noise * gauss(spec.items)).astype(np.float32)
    seg_vec = _unit(rng.standard_normal((spec.segments, d)))
    segment = rng.integers(spec.segments, size=spec.users)
    users = seg_vec[segment] + spec.user_noise * gauss(spec.users)
    cold = np.zeros(spec.items, bool)
    cold[rng.permutation(spec.items)[: round(spec.cold_fraction * spec.items)]] = True
    # the attributes draw from their own stream: specs without them keep their planted model
    arng = np.random.default_rng(np.random.SeedSequence([spec.seed, 2]))
    attrs = arng.integers(spec.attribute_values, size=(spec.users, spec.attributes))
    for a in range(spec.attributes):
        users += _unit(arng.standard_normal((spec.attribute_values, d)))[attrs[:, a]]
    return PlantedTowers(brand_cat[brand].astype(np.int64), brand.astype(np.int64), items,
                         segment.astype(np.int64), _unit(users).astype(np.float32), cold,
                         attrs.astype(np.int64), brand_vec)


def probabilities(spec: RetrievalDataSpec, model: PlantedTowers, users: slice) -> np.ndarray:
    """``P(j | u)`` over every item for the ``users`` rows: ``[users, items]`` float64."""
    scores = spec.sharpness * (model.user_vectors[users] @ model.item_vectors.T).astype(np.float64)
    scores -= scores.max(axis=1, keepdims=True)
    p = np.exp(scores)
    return p / p.sum(axis=1, keepdims=True)


def _draw(cdf: np.ndarray, rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One item of each ``rows[i]``'s distribution (``cdf``: its rows' cumulative sums)."""
    n = cdf.shape[1]
    flat = (cdf + np.arange(cdf.shape[0])[:, None]).ravel()  # rows stacked, increasing
    u = rng.random(len(rows)) * cdf[rows, -1] + rows
    return np.minimum(np.searchsorted(flat, u, side="right") - rows * n, n - 1)


def draw_events(spec: RetrievalDataSpec, model: PlantedTowers, lo: int, hi: int,
                p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Users ``lo..hi-1``'s events (``p``: their probabilities): ``(offsets, items)``, each
    user's events oldest first, the last two from every item, the others from warm ones."""
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 1, lo]))
    count = hi - lo
    extra = rng.geometric(1.0 / (1.0 + spec.mean_extra_events), size=count) - 1 \
        if spec.mean_extra_events > 0 else np.zeros(count, np.int64)
    n = np.minimum(spec.min_events + extra, spec.max_events)
    offsets = np.zeros(count + 1, np.int64)
    np.cumsum(n, out=offsets[1:])
    user = np.repeat(np.arange(count), n)
    last_two = np.arange(offsets[-1]) >= np.repeat(offsets[1:] - 2, n)
    cdf = np.cumsum(p, axis=1)
    items = _draw(cdf, user, rng)
    redraw = ~last_two & model.cold[items]
    while redraw.any():  # training never sees a cold item
        items[redraw] = _draw(cdf, user[redraw], rng)
        redraw &= model.cold[items]
    return offsets, items


def split_tables(spec: RetrievalDataSpec, model: PlantedTowers, lo: int, offsets: np.ndarray,
                 items: np.ndarray) -> dict[str, pa.Table]:
    """The users' rows of each split (leave-last-out; histories of at most ``max_length``)."""
    n, first = np.diff(offsets), offsets[:-1]
    user = np.arange(lo, lo + len(n), dtype=np.int64)
    out = {}
    # train rows: every event but the last two, each with the events before it
    per_user = n - 2
    owner = np.repeat(np.arange(len(n)), per_user)
    t = np.arange(per_user.sum()) - np.repeat(np.cumsum(per_user) - per_user, per_user)
    end = first[owner] + t
    rows = {"train": (owner, end)}
    for split, back in (("valid", 2), ("test", 1)):
        rows[split] = (np.arange(len(n)), offsets[1:] - back)
    for split, (who, end) in rows.items():
        start = np.maximum(first[who], end - spec.max_length)
        out[split] = pa.Table.from_arrays(
            [pa.array(user[who]), pa.array(model.segment[user[who]])]
            + [pa.array(model.attributes[user[who], a]) for a in range(spec.attributes)]
            + [list_slices(items, start, end), pa.array(items[end])], schema=row_schema(spec))
    return out


def oracle_hits(p: np.ndarray, targets: dict[str, np.ndarray]
                ) -> dict[str, dict[int, tuple[float, float]]]:
    """Per split and ``k``: the summed hits of the oracle's top ``k`` on the rows' ``targets``
    and the summed top-``k`` probability (ties rank the smaller id first)."""
    k_max = max(KS)
    part = np.argpartition(-p, k_max, axis=1)[:, :k_max]
    rows = np.arange(p.shape[0])[:, None]
    order = np.lexsort((part, -p[rows, part]), axis=1)
    top = part[rows, order]
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for split, target in targets.items():
        out[split] = {}
        for k in KS:
            hit = (top[:, :k] == target[:, None]).any(axis=1)
            out[split][k] = (float(hit.sum()), float(p[rows, top[:, :k]].sum()))
    return out


def write_items(spec: RetrievalDataSpec, model: PlantedTowers, out: Path) -> None:
    """``items.parquet``: every item's id and features."""
    table = pa.table({"item": np.arange(spec.items, dtype=np.int64), "category": model.category,
                      "brand": model.brand})
    pq.write_table(table, out / (ITEMS_FILE + ".tmp"), row_group_size=1 << 20)
    os.replace(out / (ITEMS_FILE + ".tmp"), out / ITEMS_FILE)


def event_log(spec: RetrievalDataSpec, model: PlantedTowers, lo: int, offsets: np.ndarray,
              items: np.ndarray) -> pa.Table:
    """Users ``lo..``'s events as an event log: ``user``, ``segment``, ``attr*``, ``item`` and
    ``timestamp`` (int64 seconds: a user's events in order, from a stream of their own)."""
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, 3, lo]))
    n, first = np.diff(offsets), offsets[:-1]
    start = 1_600_000_000 + rng.integers(0, 180 * 86_400, size=len(n))
    gaps = 1 + np.floor(rng.exponential(6 * 3_600, size=len(items))).astype(np.int64)
    gaps[first] = 0
    cum = np.cumsum(gaps)
    users = np.repeat(np.arange(lo, lo + len(n), dtype=np.int64), n)
    return pa.table({"user": users, "segment": model.segment[users],
                     **{a: model.attributes[users, i] for i, a in enumerate(attribute_names(spec))},
                     "item": items, "timestamp": np.repeat(start - cum[first], n) + cum})


def generate_retrieval(spec: RetrievalDataSpec, out_dir: str | os.PathLike,
                       progress: bool = True, events: bool = False) -> dict:
    """Write ``out_dir/{train,valid,test}/part-NNNNN.parquet``, ``out_dir/items.parquet`` and
    ``out_dir/metadata.json`` (an earlier data set there is replaced, as
    :func:`embedtrain.datagen.ctr.generate_ctr` does). The same spec gives identical files.
    ``events``: also the raw event log the rows come from, ``out_dir/events/part-00000.parquet``
    (:func:`event_log`, all users' events in time order): what ``embedtrain ingest`` with
    ``kind: sequence``, ``task: retrieval`` turns into the same rows
    (``configs/ingest/retrieval_events.yaml``).

    Returns:
        The metadata written to ``metadata.json``.
    """
    spec.validate()
    out = prepare_out_dir(out_dir)
    model = planted_towers(spec)
    writers = {s: SplitWriter(out, s, spec, row_schema(spec)) for s in SPLITS}
    sums = {s: {k: np.zeros(2) for k in KS} for s in ("valid", "test")}
    folder, logs = (_events_folder(out), []) if events else (None, [])
    n_events = cold_rows = 0
    with progress_bar(spec.users, "datagen retrieval", unit="users",
                      disable=not progress) as bar:
        for lo in range(0, spec.users, _BLOCK_USERS):
            hi = min(lo + _BLOCK_USERS, spec.users)
            p = probabilities(spec, model, slice(lo, hi))
            offsets, items = draw_events(spec, model, lo, hi, p)
            tables = split_tables(spec, model, lo, offsets, items)
            for s, table in tables.items():
                writers[s].add(table)
            targets = {s: tables[s]["item"].to_numpy() for s in ("valid", "test")}
            cold_rows += int(model.cold[targets["test"]].sum())
            for s, per_k in oracle_hits(p, targets).items():
                for k, figures in per_k.items():
                    sums[s][k] += figures
            n_events += len(items)
            if folder is not None:
                logs.append(event_log(spec, model, lo, offsets, items))
            bar.update(hi - lo)
    for w in writers.values():
        w.close()
    write_items(spec, model, out)
    if folder is not None:
        _write_events(folder, logs, "parquet")
    oracle = {f"oracle_{what}@{k}": {s: float(sums[s][k][j] / spec.users) for s in sums}
              for k in KS for j, what in enumerate(("recall", "expected_recall"))}
    meta = {
        "format_version": 1,
        "name": "synthetic_retrieval",
        "task": "retrieval",
        "label": "item", "dense": [], "num_classes": spec.items,
        "sparse": [{"name": "user", "num_embeddings": spec.users},
                   {"name": "segment", "num_embeddings": spec.segments},
                   *({"name": n, "num_embeddings": spec.attribute_values}
                     for n in attribute_names(spec)),
                   {"name": "history", "num_embeddings": spec.items, "multi_hot": True,
                    "max_length": spec.max_length}],
        "item_table": {"file": ITEMS_FILE, "id": "item",
                       "features": [{"name": "category", "num_embeddings": spec.categories},
                                    {"name": "brand", "num_embeddings": spec.brands}]},
        "num_users": spec.users, "events": n_events,
        "cold_items": int(model.cold.sum()), "cold_test_rows": cold_rows,
        "split_method": "leave_last_out",
        "splits": {s: {"files": writers[s].files, "rows": writers[s].rows} for s in SPLITS},
        **oracle,
        "generator": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
    }
    tmp = out / "metadata.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "metadata.json")
    return meta
