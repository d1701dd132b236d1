"""Retrieval (``task: retrieval``): a query tower and an item tower trained with an in-batch
sampled softmax, evaluated over the whole item table (``datagen retrieval`` data).

The family is three builders: the tabular data (:class:`~embedtrain.recipes.tabular.
TabularData`: query rows whose label is an item id) with the data set's item table
(``items.parquet``: every item's features, :func:`load_item_table`), the towers (``model:``, a
component: :class:`~embedtrain.models.retrieval.TwoTower` by default, or one's own with the same
contract) inside :class:`~embedtrain.models.retrieval.RetrievalModel`, and the task
(:class:`~embedtrain.train.retrieval.Retrieval`: ``task: retrieval``, or ``task: {_component_:
embedtrain.tasks:Retrieval, ...}`` with its keys). No key of the family is in a global section.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pyarrow.parquet as pq
import torch
from torch import nn

from embedtrain.components import Component, build
from embedtrain.config import ModelConfig
from embedtrain.config_io import ConfigError
from embedtrain.features import DatasetMeta, SparseFeature
from embedtrain.models.retrieval import ItemTable, RetrievalModel
from embedtrain.recipes.base import Oracle, Recipe, oracle_of
from embedtrain.recipes.export_parts import DenseExport, ExportParts, ItemsExport
from embedtrain.tables.dynamic import table_name
from embedtrain.recipes.tabular import TabularData
from embedtrain.train.retrieval import Retrieval

DEFAULT_TOWERS = "embedtrain.models.retrieval:TwoTower"
EXPORT_CONTRACT = ("query_dense", "item_dense", "query_keys", "item_keys", "item_lookup_ids")


def load_item_table(meta: DatasetMeta) -> ItemTable:
    """The data set's item table (``metadata.json``'s ``item_table``: its file, id column and
    categorical features), as ``[num_items, features]`` ids in item-id order.

    Raises:
        ValueError: no item table, a missing file or column, ids that are not ``0..N-1`` once
            each, or a feature id outside its vocabulary (one line naming the file and column).
    """
    where = meta.root / "metadata.json"
    entry = meta.extra.get("item_table")
    if not isinstance(entry, dict) or "file" not in entry:
        raise ValueError(f"{where}: item_table: missing (task retrieval needs every item's "
                         "features; make a data set with embedtrain datagen retrieval)")
    path = meta.root / entry["file"]
    features = tuple(SparseFeature(f["name"], int(f["num_embeddings"]))
                     for f in entry.get("features", []))
    id_column = entry.get("id", "item")
    try:
        table = pq.read_table(path, columns=[id_column, *(f.name for f in features)])
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (metadata.json's item_table)") from None
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    n = meta.features.num_classes
    ids = table[id_column].to_numpy().copy()
    if len(ids) != n or not (torch.from_numpy(ids).sort().values == torch.arange(n)).all():
        raise ValueError(f"{path}: column {id_column}: expected the ids 0..{n - 1} once each "
                         f"(num_classes {n}), got {len(ids):,} rows")
    order = torch.from_numpy(ids).argsort()
    columns = []
    for f in features:
        values = torch.from_numpy(table[f.name].to_numpy().copy())
        bad = ((values < 0) | (values >= f.num_embeddings)).nonzero()
        if len(bad):
            row = int(bad[0])
            raise ValueError(f"{path}: column {f.name}, row {row}: id {int(values[row])} outside "
                             f"[0, {f.num_embeddings})")
        columns.append(values[order])
    stacked = torch.stack(columns, 1) if columns else torch.zeros(n, 0, dtype=torch.int64)
    return ItemTable(features, stacked.long())


class RetrievalRecipe(Recipe):
    """``task: retrieval``: the towers ``model:`` names, the in-batch softmax, full-corpus
    recall@k."""

    oracle = Oracle("oracle_recall_at_10", "recall@10",
                    "recall@10 of the planted model's ranking")
    printed_metrics = ("mrr",)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.data = TabularData(cfg)
        self._seen: Optional[tuple[str, Any]] = None  # predict_excluded's task, made once

    def load_dataset(self) -> DatasetMeta:
        """The data set's metadata, checked to be a retrieval one; its item table read."""
        meta = self.data.load()
        if meta.extra.get("task") != "retrieval" or meta.features.num_classes is None:
            raise ValueError(f"{meta.root / 'metadata.json'}: task retrieval needs a retrieval "
                             "data set (query rows labelled with an item id and an item table; "
                             "make one with embedtrain datagen retrieval)")
        self.items = load_item_table(meta)
        return meta

    def towers_spec(self) -> Component:
        """``model:`` as a component: the one named, or the built-in towers with their
        defaults where the section is left out."""
        m = self.cfg.model
        if isinstance(m, Component):
            return m
        if m != ModelConfig():
            raise ConfigError("model: task retrieval takes its towers as a component (model: "
                              f"{{_component_: {DEFAULT_TOWERS}, dim: 64, ...}}), not the CTR "
                              "model's keys")
        return Component(DEFAULT_TOWERS, {})

    def planning_model(self) -> nn.Module:
        """The towers on ``meta`` in a :class:`RetrievalModel`, their tables fused."""
        meta = self.dataset
        towers = build(self.towers_spec(), "model", features=meta.features, items=self.items,
                       device=torch.device("meta"))
        if not hasattr(towers, "temperature"):
            raise ConfigError(f"model: {self.towers_spec().path}: has no temperature (a towers "
                              "model scores <query, item> / temperature)")
        return self.fuse_sparse(RetrievalModel(towers, self.items.num_items))

    def task(self) -> Retrieval:
        """The in-batch softmax with the log-q correction; recall@10/50 over all items."""
        return Retrieval(seed=self.cfg.train.seed)

    def task_supplies(self) -> dict[str, Any]:
        """``seed``: the run's (``train.seed``), for the negatives' draws."""
        return {"seed": self.cfg.train.seed}

    def summary_extra(self) -> dict[str, Any]:
        """The planted model's recall@10 and @50 on the test split (synthetic data)."""
        extra = self.dataset.extra
        return {f"oracle_recall_at_{k}": v for k in (10, 50)
                for v in oracle_of(extra, f"oracle_recall@{k}").values()}

    def export_refusal(self) -> Optional[str]:
        """A towers model exports when it says what follows its lookups (``query_dense``,
        ``item_dense``), in which tables (``query_keys``, ``item_keys``) and which rows an item
        looks up (``item_lookup_ids``), as :class:`~embedtrain.models.retrieval.TwoTower`
        does."""
        towers = self.planning_model().towers
        missing = [a for a in EXPORT_CONTRACT if not hasattr(towers, a)]
        if missing:
            return (f"model: {self.towers_spec().path}: has no {', '.join(missing)} (what "
                    f"export writes: the towers after their lookups, their tables and an "
                    f"item's rows)")
        return None

    def export_parts(self, model: nn.Module, tables: Sequence[tuple[str, int, int]]
                     ) -> ExportParts:
        """The query tower after its lookups as the dense program (``(dense, pooled [B,
        tables, D]) -> query [B, D]``), and the item side: the item tower after its lookups,
        the item tables and every item's rows in them, the item table file."""
        towers, meta = model.towers, self.dataset
        dims = {name: dim for name, _, dim in tables}
        query_tables = [table_name(k) for k in towers.query_keys]
        dim = dims[query_tables[0]]
        n_dense = len(meta.features.dense)
        example = (torch.randn(4, n_dense), torch.randn(4, len(query_tables), dim))
        inputs = [f"dense: float32 [B, {n_dense}] (features.dense, in order)",
                  f"pooled: float32 [B, {len(query_tables)}, {dim}] (the pooled embeddings of "
                  f"{', '.join(towers.query_keys)}, in that order)"]
        dense = DenseExport(towers.query_dense, "model.towers.query_dense.", example, inputs,
                            "query: float32 [B, D], a unit row; an item's score is query @ "
                            "its row of items/embeddings.npy")
        entry = meta.extra["item_table"]
        columns = [f.name for f in self.items.features]
        columns += [entry.get("id", "item")] * (len(towers.item_keys) - len(columns))
        task = self.make_task()
        items = ItemsExport(towers.item_dense, "model.towers.item_dense.",
                            [table_name(k) for k in towers.item_keys], columns,
                            towers.item_lookup_ids(torch.arange(self.items.num_items)),
                            meta.root / entry["file"], list(getattr(task, "ks", (10,))))
        name = type(towers).__name__
        return ExportParts("two_tower" if name == "TwoTower" else name, meta.features,
                           meta.extra, dense, items=items,
                           note="predict ranks every item of items/embeddings.npy for a row's "
                                "query (flat: exact; hnsw/ivf: the FAISS index)")

    def predict_pooled(self, pooled: list[torch.Tensor]) -> torch.Tensor:
        """The query tables' pooled embeddings stacked: ``[B, tables, D]``."""
        return torch.stack(pooled, 1)

    def predict_excluded(self, sparse: Any) -> Optional[torch.Tensor]:
        """With ``task.exclude_seen``, each row's seen items (its ``task.seen_feature``), left
        out of its top-k as its evaluation leaves them out."""
        if self._seen is None:
            task = self.make_task()
            self._seen = (task.seen_feature if getattr(task, "exclude_seen", False) else "", task)
        if not self._seen[0]:
            return None
        return self._seen[1].seen(sparse, 1)
