"""Extreme-classification models: a bag-of-ids encoder and a class head of C classes.

The encoder is one TorchRec ``EmbeddingBagCollection`` table per sparse feature (token bags,
mean- or sum-pooled; sharded by the planner like DLRM's tables, fused sparse optimizer), the
dense features concatenated, and an MLP whose last layer gives the D-dimensional feature. The
head (``xc.head.kind``) is one of :mod:`embedtrain.models.class_head`'s model-parallel heads
(``full``, ``partial_fc``, ``hard_negatives``: each rank holds a slice of classes) or a
replicated one of :mod:`embedtrain.models.xc_heads` (``adaptive``, ``mach``).

For the planner, :func:`xc_planning_model` puts a row-wise ``EmbeddingCollection`` table
``class_head`` (C x D, with the head's optimizer) where the head goes: the dry-run report then
shows the head's memory per rank exactly as the model-parallel heads split it.

Example:
    >>> model = XCModel(meta.features, cfg.xc, num_classes=1_000_000, device=torch.device("meta"))
    >>> loss = model(dense, kjt, labels)                  # training
    >>> losses, topk_ids = model.eval()(dense, kjt, labels, 5)    # evaluation
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.config import HeadConfig, HeadKind, Pooling, XCConfig
from embedtrain.features import FeatureSpec
from embedtrain.models.class_head import HardNegativeHead, PartialFCHead, ShardedSoftmaxHead
from embedtrain.models.dlrm import table_name

HEAD_TABLE = "class_head"  # the head's name in plans and reports
SHARDED_HEADS = (HeadKind.FULL, HeadKind.PARTIAL_FC, HeadKind.HARD_NEGATIVES)


class XCEncoder(nn.Module):
    """Pooled id bags (+ dense features) -> MLP -> ``[B, D]`` features."""

    def __init__(self, spec: FeatureSpec, embedding_dim: int, pooling: Pooling,
                 mlp: Sequence[int], device: Optional[torch.device] = None) -> None:
        super().__init__()
        if not mlp:
            raise ValueError("xc.mlp: needs at least one layer (its last size is the feature "
                             "dimension)")
        if not spec.sparse:
            raise ValueError("xc: the data set has no sparse (id) feature to encode")
        pool = PoolingType.MEAN if pooling is Pooling.MEAN else PoolingType.SUM
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=table_name(f.name), embedding_dim=embedding_dim,
                               num_embeddings=f.num_embeddings, feature_names=[f.name],
                               pooling=pool)
            for f in spec.sparse], device=device)
        layers: list[nn.Module] = []
        width = embedding_dim * len(spec.sparse) + len(spec.dense)
        for i, size in enumerate(mlp):
            layers.append(nn.Linear(width, size, device=device))
            if i < len(mlp) - 1:
                layers.append(nn.ReLU())
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
        cfg: the ``xc`` config section.
        head: the class head (:func:`build_head`); ``None`` builds the planning placeholder.
        device: device of the encoder (``meta`` to be materialised by the sharding wrapper).
    """

    def __init__(self, spec: FeatureSpec, cfg: XCConfig, head: Optional[nn.Module],
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.encoder = XCEncoder(spec, cfg.embedding_dim, cfg.pooling, cfg.mlp, device)
        if head is None:  # planning: the head as a row-wise table the planner can size
            head = EmbeddingCollection(tables=[EmbeddingConfig(
                name=HEAD_TABLE, embedding_dim=self.encoder.dim, num_embeddings=spec.num_classes,
                feature_names=["__classes"])], device=device)
        self.head = head

    def forward(self, dense: Tensor, sparse: KeyedJaggedTensor, targets: Tensor,
                k: int = 0):
        features = self.encoder(dense, sparse)
        if self.training:
            return self.head(features, targets)
        if targets.dim() == 1:  # padding rows (-1, last) get class 0's loss, dropped by the task
            targets = targets.clamp(min=0)
        losses = self.head.eval_loss(features, targets)
        return losses, self.head.topk(features, k)[1] if k else None


def build_head(cfg: HeadConfig, num_classes: int, dim: int,
               group: Optional[dist.ProcessGroup] = None,
               class_counts: Optional[Tensor] = None, seed: int = 0) -> nn.Module:
    """The head ``cfg.kind`` describes (sharded heads: this rank's slice over ``group``).

    Args:
        cfg: the ``xc.head`` section.
        num_classes: C.
        dim: the encoder's feature dimension D.
        group: ranks sharing a sharded head.
        class_counts: ``[C]`` training frequencies (adaptive softmax sorts classes by them).
        seed: initialisation and sampling seed.
    """
    common = dict(group=group, margin=cfg.margin, margin_value=cfg.margin_value,
                  scale=cfg.scale, seed=seed)
    if cfg.kind is HeadKind.FULL:
        return ShardedSoftmaxHead(num_classes, dim, **common)
    if cfg.kind is HeadKind.PARTIAL_FC:
        return PartialFCHead(num_classes, dim, sample_rate=cfg.sample_rate, **common)
    if cfg.kind is HeadKind.HARD_NEGATIVES:
        return HardNegativeHead(num_classes, dim, negatives=cfg.hard_negatives,
                                refresh_every=cfg.refresh_every, sample_rate=cfg.sample_rate,
                                **common)
    from embedtrain.models import xc_heads

    if cfg.margin.value != "none":
        raise ValueError(f"xc.head.margin: {cfg.margin.value} needs a full, partial_fc or "
                         f"hard_negatives head, not {cfg.kind.value}")
    if cfg.kind is HeadKind.ADAPTIVE:
        order = xc_heads.frequency_order(class_counts) if class_counts is not None else None
        return xc_heads.AdaptiveSoftmaxHead(num_classes, dim, cutoffs=cfg.cutoffs or None,
                                            div_value=cfg.div_value, class_order=order)
    buckets = cfg.mach_buckets or max(64, int(round(num_classes ** 0.5)))
    return xc_heads.MACHHead(num_classes, dim, num_buckets=buckets,
                             num_repetitions=cfg.mach_repetitions, seed=seed)
