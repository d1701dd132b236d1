"""Sequential recommendation (``task: seq``): a user's item history -> SASRec -> the next item,
ranked over the whole corpus by an XC head (``datagen seq`` or ``ingest`` ``kind: sequence``).

Next-item prediction is extreme classification over the items, so this recipe is the XC
recipe's (:class:`~embedtrain.recipes.xc.XCRecipe`: the ``xc.head`` section's head, sharded or
replicated, its optimizer, plan and reservations) with the ``seq`` section's encoder
(:class:`~embedtrain.models.seq.SeqModel`) in place of the bag-of-ids one, and HR@k / NDCG@k
(:class:`~embedtrain.train.seq.SeqTask`). The data set's rows are ``items`` (the history, a
multi-hot id feature of at most ``max_length`` ids) and ``target`` (the next item: the label).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from embedtrain.config import ClusterConfig
from embedtrain.features import DatasetMeta
from embedtrain.models.seq import SeqModel
from embedtrain.recipes.base import Oracle, oracle_of
from embedtrain.recipes.xc import XCRecipe
from embedtrain.train.seq import SeqTask


class SeqRecipe(XCRecipe):
    """``task: seq``: the ``seq`` section's encoder, the ``xc`` section's head and ``top_k``."""

    oracle = Oracle("oracle_hr_at_10", "hr@10", "HR@10 of the Bayes-optimal ranking")
    printed_metrics = ("mrr",)

    @property
    def feature_dim(self) -> int:
        return self.cfg.seq.dim

    @property
    def max_length(self) -> int:
        """The longest history: the items feature's ``max_length`` in the metadata."""
        return self.dataset.features.sparse[0].max_length

    def load_dataset(self) -> DatasetMeta:
        """The data set's metadata, checked to be a sequence one (``task: seq``)."""
        meta = super().load_dataset()
        where = meta.root / "metadata.json"
        sparse = meta.features.sparse
        if meta.extra.get("task") != "seq" or len(sparse) != 1 or not sparse[0].max_length:
            raise ValueError(f"{where}: task seq needs a sequence data set (one item-history "
                             f"feature and a target; make one with embedtrain datagen seq or "
                             f"embedtrain ingest with kind: sequence)")
        return meta

    def _model(self, head: Optional[nn.Module]) -> SeqModel:
        s = self.cfg.seq
        model = SeqModel(self.dataset.features.num_classes, s.dim, self.max_length, s.layers,
                         s.heads, s.dropout, head, feature=self.dataset.features.sparse[0].name,
                         device=torch.device("meta"), head_dtype=self.cfg.xc.head.dtype,
                         exclude_history=s.exclude_history)
        self.fuse_sparse(model.encoder)
        return model

    def task(self) -> SeqTask:
        """HR@k and NDCG@k for ``xc.top_k`` over every item."""
        return SeqTask(self.cfg.xc.top_k)

    def summary_extra(self) -> dict[str, Any]:
        """The data set's Bayes-optimal HR@10 and NDCG@10 on the test split (synthetic data)."""
        extra = self.dataset.extra
        return {f"oracle_{name}_at_10": value for name in ("hr", "ndcg")
                for value in oracle_of(extra, f"oracle_{name}@10").values()}

    def extra_reservations(self, cluster: ClusterConfig) -> dict[str, int]:
        """The XC head's logits, for every position of a history: ``max_length`` rows an
        example (hard_negatives' selected columns grow with the rows too; not counted)."""
        return {key: value * self.max_length
                for key, value in super().extra_reservations(cluster).items()}

    def export_refusal(self) -> Optional[str]:
        return ("task seq: export (item embeddings, the encoder, top-k next items per user) is "
                "not built yet; evaluate with embedtrain eval")
