"""Extreme-classification models: a bag-of-ids encoder and a class head of C classes.

The encoder is one TorchRec ``EmbeddingBagCollection`` table per sparse feature (token bags,
mean- or sum-pooled; sharded by the planner like DLRM's tables, fused sparse optimizer), the
dense features concatenated, and an MLP whose last layer gives the D-dimensional feature. The
head (:func:`build_head`) is one of :mod:`embedtrain.models.class_head`'s model-parallel heads
(``full``, ``partial_fc``, ``hard_negatives``: each rank holds a slice of classes) or a
replicated one of :mod:`embedtrain.models.xc_heads` (``adaptive``, ``mach``).

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
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embedtrain.features import FeatureSpec
from embedtrain.models.class_head import HardNegativeHead, PartialFCHead, ShardedSoftmaxHead
from embedtrain.models.dynamic import feature_tables
from embedtrain.models.low_precision import DTYPES
from embedtrain.models.options import (
    DynamicTable,
    HeadDtype,
    HeadKind,
    HeadLoss,
    Margin,
    NegativeIndex,
    Pooling,
    Rounding,
)

HEAD_TABLE = "class_head"  # the head's name in plans and reports
SHARDED_HEADS = (HeadKind.FULL, HeadKind.PARTIAL_FC, HeadKind.HARD_NEGATIVES)


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
        head: the class head (:func:`build_head`); ``None`` builds the planning placeholder.
        device: device of the encoder (``meta`` to be materialised by the sharding wrapper).
        dropout: dropout after each hidden layer of the encoder's MLP in training (0: none).
        dynamic: the encoder's dynamic token tables by name (:mod:`embedtrain.models.dynamic`).
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


def planning_head(num_classes: int, dim: int, head_dtype: HeadDtype = HeadDtype.FP32,
                  device: Optional[torch.device] = None) -> nn.Module:
    """The head as the planner sees it: a table ``class_head`` of ``num_classes x dim`` (an
    ``EmbeddingCollection``; ``bf16``: 2 bytes a weight, ``fp8``: 1, as the sharded heads store
    it). TorchRec makes every table that is not FP32 float16: the placeholder's weight is cast
    to the head's storage, whose element size the planner counts."""
    ec = EmbeddingCollection(tables=[EmbeddingConfig(
        name=HEAD_TABLE, embedding_dim=dim, num_embeddings=num_classes,
        feature_names=["__classes"],
        data_type=DataType.FP32 if head_dtype is HeadDtype.FP32 else DataType.BF16)],
        device=device)
    return ec.to(DTYPES[head_dtype])


def build_head(kind: HeadKind, num_classes: int, dim: int, *, sample_rate: float = 0.1,
               hard_negatives: int = 10, refresh_every: int = 100, margin: Margin = Margin.NONE,
               margin_value: float = 0.35, scale: float = 30.0, cutoffs: Sequence[int] = (),
               div_value: float = 4.0, mach_buckets: int = 0, mach_repetitions: int = 4,
               loss: HeadLoss = HeadLoss.SOFTMAX, index: NegativeIndex = NegativeIndex.EXACT,
               index_clusters: int = 0, index_probe: int = 0,
               dtype: HeadDtype = HeadDtype.FP32, rounding: Rounding = Rounding.STOCHASTIC,
               group: Optional[dist.ProcessGroup] = None, class_counts: Optional[Tensor] = None,
               seed: int = 0, sample_correction: bool = False) -> nn.Module:
    """The class head of ``kind`` (sharded heads: this rank's slice over ``group``).

    Args:
        kind: which head (:class:`~embedtrain.models.options.HeadKind`).
        num_classes: C.
        dim: the encoder's feature dimension D.
        sample_rate: partial_fc's share of each slice's classes sampled per step;
            hard_negatives' extra uniform sample (0: none).
        hard_negatives, refresh_every: hard_negatives' nearest classes per example and rank,
            and the steps between rebuilds of its index.
        margin, margin_value, scale: CosFace/ArcFace margin on the positives' logits (sharded
            heads only), its ``m`` and the logit scale ``s``.
        cutoffs, div_value: adaptive softmax's cluster boundaries (empty: chosen from C) and
            dimension divisor per cluster.
        mach_buckets, mach_repetitions: MACH's B (0: about sqrt(C), at least 64) and R.
        loss: the sharded heads' training loss (``softmax`` or one-vs-all ``bce``).
        index, index_clusters, index_probe: hard_negatives' index of the nearest classes
            (``exact`` or ``clustered``), its k-means lists per rank and the lists each example
            searches (0: ``ceil(sqrt(slice))`` and a quarter of them).
        dtype, rounding: how a sharded head stores its rows (``fp32``, ``bf16`` or ``fp8``) and
            rounds updated rows back to it (``stochastic`` or ``nearest``).
        group: ranks sharing a sharded head.
        class_counts: ``[C]`` training frequencies (adaptive softmax sorts classes by them;
            partial_fc's ``sample_correction`` takes each sampled class's odds from them).
        seed: initialisation and sampling seed.
        sample_correction: partial_fc with softmax: the log-q correction of the sampled logits
            (:func:`~embedtrain.models.class_sample.sample_log_q`).
    """
    if sample_correction and (kind is not HeadKind.PARTIAL_FC or loss is not HeadLoss.SOFTMAX):
        raise ValueError(f"xc.head.sample_correction: needs kind partial_fc with loss softmax, "
                         f"not {kind.value} with {HeadLoss(loss).value}")
    common = dict(group=group, margin=margin, margin_value=margin_value, scale=scale, seed=seed,
                  loss=loss, dtype=DTYPES[HeadDtype(dtype)], rounding=rounding)
    if kind is HeadKind.FULL:
        return ShardedSoftmaxHead(num_classes, dim, **common)
    if kind is HeadKind.PARTIAL_FC:
        return PartialFCHead(num_classes, dim, sample_rate=sample_rate,
                             class_counts=class_counts if sample_correction else None, **common)
    if kind is HeadKind.HARD_NEGATIVES:
        return HardNegativeHead(num_classes, dim, negatives=hard_negatives,
                                refresh_every=refresh_every, sample_rate=sample_rate, index=index,
                                index_clusters=index_clusters, index_probe=index_probe, **common)
    from embedtrain.models import xc_heads

    for name, value, default in (("margin", margin, Margin.NONE), ("loss", loss, HeadLoss.SOFTMAX),
                                 ("dtype", dtype, HeadDtype.FP32)):
        if value is not default:
            raise ValueError(f"xc.head.{name}: {value.value} needs a full, partial_fc or "
                             f"hard_negatives head, not {kind.value}")
    if kind is HeadKind.ADAPTIVE:
        order = xc_heads.frequency_order(class_counts) if class_counts is not None else None
        return xc_heads.AdaptiveSoftmaxHead(num_classes, dim, cutoffs=list(cutoffs) or None,
                                            div_value=div_value, class_order=order)
    buckets = mach_buckets or max(64, int(round(num_classes ** 0.5)))
    return xc_heads.MACHHead(num_classes, dim, num_buckets=buckets,
                             num_repetitions=mach_repetitions, seed=seed)
