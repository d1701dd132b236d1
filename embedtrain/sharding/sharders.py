"""TorchRec sharders for embedtrain's modules, with every sharding type on CPU and qcomms.

TorchRec's stock sharders offer only ``table_wise``, ``column_wise``, ``table_column_wise`` and
``data_parallel`` when the compute device is ``cpu``. ``row_wise`` and ``table_row_wise`` run
fine on gloo (each rank holds a block of rows; the all-to-all and reduce-scatter are plain
collectives), so embedtrain's sharders offer them too. Quantized communication (TorchRec's
qcomms: fp16/bf16 all-to-all) is attached through the codec registry, which is also what the
planner's perf estimator reads to size the messages.

Example:
    >>> sharders = embedding_sharders(CommPrecision.FP16, CommPrecision.BF16)
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import (
    CommType,
    QCommsConfig,
    get_qcomm_codecs_registry,
)
from torchrec.distributed.types import ModuleSharder, ShardingType

from embedtrain.sharding.types import CommPrecision

_CPU_EXTRA = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]


class _AllTypesOnCPU:
    """Mixin: adds row_wise and table_row_wise to what the stock sharder offers for ``cpu``."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))  # type: ignore[misc]
        if compute_device_type == "cpu":
            types += [t for t in _CPU_EXTRA if t not in types]
        return types


class EmbeddingBagCollectionAllTypesSharder(_AllTypesOnCPU, EmbeddingBagCollectionSharder):
    """:class:`EmbeddingBagCollectionSharder` offering all five sharding types on CPU too."""


class EmbeddingCollectionAllTypesSharder(_AllTypesOnCPU, EmbeddingCollectionSharder):
    """:class:`EmbeddingCollectionSharder` offering all its sharding types on CPU too."""


_COMM = {CommPrecision.FP32: CommType.FP32, CommPrecision.FP16: CommType.FP16,
         CommPrecision.BF16: CommType.BF16}


def qcomm_registry(forward_precision: CommPrecision = CommPrecision.FP32,
                   backward_precision: CommPrecision = CommPrecision.FP32) -> Optional[dict]:
    """TorchRec's qcomm codec registry for these all-to-all precisions.

    Args:
        forward_precision: of the forward all-to-all (the pooled embeddings).
        backward_precision: of the backward one (their gradients).

    Returns:
        The registry, or None when both are fp32 (no codecs: plain fp32 collectives).
    """
    if forward_precision is CommPrecision.FP32 and backward_precision is CommPrecision.FP32:
        return None
    return get_qcomm_codecs_registry(QCommsConfig(
        forward_precision=_COMM[forward_precision],
        backward_precision=_COMM[backward_precision],
    ))


def embedding_sharders(
    forward_precision: CommPrecision = CommPrecision.FP32,
    backward_precision: CommPrecision = CommPrecision.FP32,
) -> list[ModuleSharder[nn.Module]]:
    """The sharders for every embedding module embedtrain builds (pooled and sequence tables).

    Args:
        forward_precision, backward_precision: the embedding all-to-all's precisions (qcomms;
            a config's ``sharding.forward_comm_precision`` / ``backward_comm_precision``).

    Returns:
        An :class:`EmbeddingBagCollectionAllTypesSharder`, an
        :class:`EmbeddingCollectionAllTypesSharder` and, for dynamic tables, a
        :class:`~embedtrain.sharding.dynamic.DynamicTablesSharder` (row-wise only), for the
        planner and for ``DistributedModelParallel`` (which must get the same ones the plan was
        made with). The tables they shard on a CPU take their backward over the intra-op
        threads (:mod:`embedtrain.fbgemm_threads`, installed here).
    """
    from embedtrain.fbgemm_threads import install
    from embedtrain.sharding.dynamic import DynamicTablesSharder

    install()

    registry = qcomm_registry(forward_precision, backward_precision)
    bags = EmbeddingBagCollectionAllTypesSharder(qcomm_codecs_registry=registry)
    return [
        bags,
        EmbeddingCollectionAllTypesSharder(qcomm_codecs_registry=registry),
        DynamicTablesSharder(ebc_sharder=bags, qcomm_codecs_registry=registry),
    ]
