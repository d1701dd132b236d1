"""Extreme-classification models: a bag-of-ids encoder and a class head of C classes.

The encoder is one TorchRec ``EmbeddingBagCollection`` table per sparse feature (token bags,
mean- or sum-pooled; sharded by the planner like DLRM's tables, fused sparse optimizer), the
dense features concatenated, and an MLP whose last layer gives the D-dimensional feature. The
head (:func:`embedtrain.heads.build.build_head`) is one of :mod:`embedtrain.heads`' heads.

For the planner, ``XCModel(..., head=None)`` puts a row-wise ``EmbeddingCollection`` table
``class_head`` (C x D) where the head goes: the dry-run report then shows the head's memory per
rank exactly as the model-parallel heads split it.

Example:
    >>> head = build_head(HeadKind.PARTIAL_FC, 1_000_000, 128, sample_rate=0.1, group=group)
    >>> model = XCModel(meta.features, 64, Pooling.MEAN, [256, 128], head)
    >>> loss = model(dense, kjt, labels)                  # training
    >>> losses, topk_ids = model.eval()(dense, kjt, labels, 5)    # evaluation
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.features import FeatureSpec
from embedtrain.heads.build import planning_head
from embedtrain.models.options import DynamicTable, HeadDtype, Pooling
from embedtrain.tables.dynamic import feature_tables


class XCEncoder(nn.Module):
    """Pooled id bags (+ dense features) -> MLP -> ``[B, D]`` features."""

    def __init__(self, spec: FeatureSpec, embedding_dim: int, pooling: Pooling,
                 mlp: Sequence[int], device: Optional[torch.device] = None,
                 dropout: float = 0.0,
                 dynamic: Optional[Mapping[str, DynamicTable]] = None) -> None:
        super().__init__()
        if not mlp:
            raise ValueError("xc.mlp: needs at least one layer (its last size is the feature "
                             "dimension)")
        if not spec.sparse:
            raise ValueError("xc: the data set has no sparse (id) feature to encode")
        pool = PoolingType.MEAN if pooling is Pooling.MEAN else PoolingType.SUM
        self.ebc = feature_tables(spec.sparse, embedding_dim, pool, dynamic, device)
        layers: list[nn.Module] = []
        width = embedding_dim * len(spec.sparse) + len(spec.dense)
        for i, size in enumerate(mlp):
            layers.append(nn.Linear(width, size, device=device))
            if i < len(mlp) - 1:
                layers.append(nn.ReLU())
                if dropout:  # none at 0: the layers' indices (state dict keys) stay as they were
                    layers.append(nn.Dropout(dropout))
            width = size
        self.mlp = nn.Sequential(*layers)
        self.dim = width

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor) -> Tensor:
        pooled = self.ebc(sparse).values()
        return self.mlp(torch.cat([pooled, dense], dim=1) if dense.shape[1] else pooled)


class XCModel(nn.Module):
    """Encoder + class head; ``forward`` returns the loss (training) or ``(losses, top-k ids)``.

    Args:
        spec: the data set's features (label: class ids, ``spec.num_classes`` of them).
        embedding_dim: the token tables' dimension.
        pooling: how each token bag is pooled.
        mlp: the encoder's layer sizes; the last is the feature dimension D.
        head: the class head (:func:`embedtrain.heads.build.build_head`); ``None`` builds the planning placeholder.
        device: device of the encoder (``meta`` to be materialised by the sharding wrapper).
        dropout: dropout after each hidden layer of the encoder's MLP in training (0: none).
        dynamic: the encoder's dynamic token tables by name (:mod:`embedtrain.tables.dynamic`).
        head_dtype: the planning placeholder's storage (``bf16``: 2 bytes a weight; TorchRec
            makes the placeholder float16, whose size is the same).
    """

    def __init__(self, spec: FeatureSpec, embedding_dim: int, pooling: Pooling,
                 mlp: Sequence[int], head: Optional[nn.Module],
                 device: Optional[torch.device] = None, dropout: float = 0.0,
                 dynamic: Optional[Mapping[str, DynamicTable]] = None,
                 head_dtype: HeadDtype = HeadDtype.FP32) -> None:
        super().__init__()
        self.encoder = XCEncoder(spec, embedding_dim, pooling, mlp, device, dropout, dynamic)
        self.head = head if head is not None else planning_head(
            spec.num_classes, self.encoder.dim, head_dtype, device)

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor, targets: Tensor,
                k: int = 0):
        features = self.encoder(dense, sparse)
        if self.training:
            return self.head(features, targets)
        if targets.dim() == 1:  # padding rows (-1, last) get class 0's loss, dropped by the task
            targets = targets.clamp(min=0)
        losses = self.head.eval_loss(features, targets)
        return losses, self.head.topk(features, k)[1] if k else None
