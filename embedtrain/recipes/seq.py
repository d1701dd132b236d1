"""Sequential recommendation (``task: seq``): a user's item history -> SASRec -> the next item,
ranked over the whole corpus by an XC head (``datagen seq`` or ``ingest`` ``kind: sequence``).

Next-item prediction is extreme classification over the items: the recipe composes the tabular
data (:class:`~embedtrain.recipes.tabular.TabularData`), the ``seq`` section's encoder
(:class:`~embedtrain.models.seq.SeqModel`), a class head over the items
(:class:`~embedtrain.recipes.heads.ClassHeads`, the ``head`` section: sharded or replicated,
its optimizer, plan and reservations) and HR@k / NDCG@k (:class:`~embedtrain.train.seq.SeqTask`). The data set's rows are ``items`` (the history, a
multi-hot id feature of at most ``max_length`` ids) and ``target`` (the next item: the label).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import torch
from torch import nn

from embedtrain.components import Component, build
from embedtrain.config import ClusterConfig
from embedtrain.data.stats import class_counts
from embedtrain.features import DatasetMeta
from embedtrain.models.seq import ITEM_TABLE, SeqDense, SeqModel, excluded_items, pad_history
from embedtrain.recipes.base import Oracle, Recipe, oracle_of
from embedtrain.recipes.export_parts import DenseExport, ExportParts
from embedtrain.recipes.heads import ClassHeads
from embedtrain.recipes.tabular import TabularData
from embedtrain.train.seq import SeqTask


class SeqRecipe(Recipe):
    """``task: seq``: the ``seq`` section's encoder, the ``xc`` section's head and ``top_k``."""

    oracle = Oracle("oracle_hr_at_10", "hr@10", "HR@10 of the Bayes-optimal ranking")
    printed_metrics = ("mrr",)

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.data = TabularData(cfg)
        self.heads = ClassHeads(cfg.head, lambda: self.dataset.features.num_classes,
                                cfg.seq.dim)

    @property
    def max_length(self) -> int:
        """The longest history: the items feature's ``max_length`` in the metadata."""
        return self.dataset.features.sparse[0].max_length

    @functools.cached_property
    def class_counts(self) -> torch.Tensor:
        """Each item's count in the train split's histories and targets: the labels training
        sees are every position's next item, not only the rows' targets."""
        spec = self.dataset.features
        return torch.from_numpy(class_counts(self.dataset, columns=[spec.sparse[0].name,
                                                                    spec.label]))

    def load_dataset(self) -> DatasetMeta:
        """The data set's metadata, checked to be a sequence one (``task: seq``)."""
        meta = self.data.load()
        where = meta.root / "metadata.json"
        sparse = meta.features.sparse
        if meta.extra.get("task") != "seq" or len(sparse) != 1 or not sparse[0].max_length:
            raise ValueError(f"{where}: task seq needs a sequence data set (one item-history "
                             f"feature and a target; make one with embedtrain datagen seq or "
                             f"embedtrain ingest with kind: sequence)")
        self.heads.check()
        return meta

    def head_model(self, head: Optional[nn.Module]) -> SeqModel:
        """The ``seq`` encoder on ``meta`` around ``head`` (None: the planner's table); its
        blocks SASRec's or HSTU's (``seq.model``), or those ``model: {_component_: ...}`` names,
        built with ``dim`` and ``max_length`` and its own keys (:class:`~embedtrain.models.seq.
        SeqEncoder`'s ``blocks``)."""
        s, m = self.cfg.seq, self.cfg.model
        blocks = (build(m, "model", dim=s.dim, max_length=self.max_length)
                  if isinstance(m, Component) else None)
        model = SeqModel(self.dataset.features.num_classes, s.dim, self.max_length, s.layers,
                         s.heads, s.dropout, head, feature=self.dataset.features.sparse[0].name,
                         device=torch.device("meta"), head_dtype=self.cfg.head.dtype,
                         exclude_history=s.exclude_history, model=s.model.value, blocks=blocks,
                         attention_dropout=s.attention_dropout)
        self.fuse_sparse(model.encoder)
        return model

    def task(self) -> SeqTask:
        """HR@k and NDCG@k for ``head.top_k`` over every item."""
        return SeqTask(self.cfg.head.top_k)

    def summary_extra(self) -> dict[str, Any]:
        """The data set's Bayes-optimal HR@10 and NDCG@10 on the test split (synthetic data)."""
        extra = self.dataset.extra
        return {f"oracle_{name}_at_10": value for name in ("hr", "ndcg")
                for value in oracle_of(extra, f"oracle_{name}@10").values()}

    def extra_reservations(self, cluster: ClusterConfig) -> dict[str, int]:
        """The head's logits, for every position of a history: ``max_length`` rows an
        example (hard_negatives' selected columns grow with the rows too; not counted)."""
        return self.heads.reservations(cluster, rows_per_example=self.max_length)

    def export_parts(self, model: nn.Module, tables: Sequence[tuple[str, int, int]]
                     ) -> ExportParts:
        """The item table (written with the tables, looked up per position), the encoder's
        blocks (:class:`SeqDense`: padded history embeddings -> the last position's features)
        and the class head over the items."""
        spec, t, d = self.dataset.features, model.encoder.max_length, model.encoder.dim
        example = (torch.zeros(4, 0), torch.randn(4, t, d), torch.tensor([1, t, 2, t // 2 + 1]))
        inputs = ["dense: float32 [B, 0] (no dense features)",
                  f"history: float32 [B, {t}, {d}] (the rows of {spec.sparse[0].name} in "
                  f"{ITEM_TABLE}, oldest first, zeros past the history's end)",
                  "lengths: int64 [B] (each history's length, 1 to max_length)"]
        dense = DenseExport(SeqDense(model.encoder), "model.encoder.", example, inputs,
                            f"features: float32 [B, {d}] (the newest position's; class scores: "
                            f"features @ head.weight.T)")
        note = "the top-k leave out item 0 (padding)" + (
            " and the row's history (seq.exclude_history)" if self.cfg.seq.exclude_history
            else "")
        # the history's ids and the head's classes are both the item vocabulary's (ingested)
        ingest = dict(self.dataset.extra)
        files = dict(ingest.get("vocab_files") or {})
        item = files.get("item")
        if item:
            files[spec.sparse[0].name] = files[spec.label] = item
        ingest["vocab_files"] = files
        head = self.heads.export(self.cfg.head.top_k, item)
        name = (type(model.encoder.blocks).__name__ if isinstance(self.cfg.model, Component)
                else self.cfg.seq.model.value)
        return ExportParts(name, spec, ingest, dense, head, note)

    def predict_pooled(self, pooled: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The histories' per-position rows (a ``JaggedTensor``), padded: ``(history [B, T, D],
        lengths [B])``."""
        (jt,) = pooled
        lengths = jt.lengths().long()
        return pad_history(jt.values(), lengths, self.max_length), lengths

    def predict_excluded(self, sparse: Any) -> Optional[torch.Tensor]:
        """What evaluation leaves out of the ranking: the padding id 0 and, with
        ``seq.exclude_history``, each row's history items."""
        jt = sparse[self.dataset.features.sparse[0].name]
        return excluded_items(jt.values(), jt.lengths(), self.max_length,
                              self.cfg.seq.exclude_history)
