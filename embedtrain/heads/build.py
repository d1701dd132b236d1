"""The class heads by kind: :func:`build_head` (what training builds from the ``head``
section), :func:`planning_head` (what the planner sees of a sharded one) and their names.

The model-parallel heads (``full``, ``partial_fc``, ``hard_negatives``: each rank holds a slice of
the classes, :mod:`embedtrain.heads.sharded`) or a replicated one
(:mod:`embedtrain.heads.replicated`: ``adaptive``, ``mach``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from embedtrain.heads.low_precision import DTYPES
from embedtrain.heads.sharded import HardNegativeHead, PartialFCHead, ShardedSoftmaxHead
from embedtrain.models.options import (  # noqa: F401  (SHARDED_HEADS: the heads layer's name)
    SHARDED_HEADS, HeadDtype, HeadKind, HeadLoss, Margin, NegativeIndex, Rounding,
    replicated_head_refusal)

HEAD_TABLE = "class_head"  # the head's name in plans and reports


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
        raise ValueError(f"head.sample_correction: needs kind partial_fc with loss softmax, "
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
    from embedtrain.heads import replicated as xc_heads

    refusal = replicated_head_refusal(kind, HeadDtype(dtype), margin, loss)
    if refusal:
        raise ValueError(f"head.{refusal}")
    if kind is HeadKind.ADAPTIVE:
        order = xc_heads.frequency_order(class_counts) if class_counts is not None else None
        return xc_heads.AdaptiveSoftmaxHead(num_classes, dim, cutoffs=list(cutoffs) or None,
                                            div_value=div_value, class_order=order)
    buckets = mach_buckets or max(64, int(round(num_classes ** 0.5)))
    return xc_heads.MACHHead(num_classes, dim, num_buckets=buckets,
                             num_repetitions=mach_repetitions, seed=seed)
