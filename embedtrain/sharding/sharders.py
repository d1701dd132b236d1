"""TorchRec sharders for embedtrain's modules, with every sharding type on CPU and qcomms.

TorchRec's stock sharders offer only ``table_wise``, ``column_wise``, ``table_column_wise`` and
``data_parallel`` when the compute device is ``cpu``. ``row_wise`` and ``table_row_wise`` run
fine on gloo (each rank holds a block of rows; the all-to-all and reduce-scatter are plain
collectives), so embedtrain's sharders offer them too. Quantized communication (TorchRec's
qcomms: fp16/bf16 all-to-all) is attached through the codec registry, which is also what the
planner's perf estimator reads to size the messages.

Example:
    >>> sharders = embedding_sharders(ShardingConfig(forward_comm_precision=CommPrecision.FP16))
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

from embedtrain.config import CommPrecision, ShardingConfig

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


def qcomm_registry(sharding: ShardingConfig) -> Optional[dict]:
    """TorchRec's qcomm codec registry for the configured all-to-all precisions (None: fp32)."""
    if (sharding.forward_comm_precision is CommPrecision.FP32
            and sharding.backward_comm_precision is CommPrecision.FP32):
        return None
    return get_qcomm_codecs_registry(QCommsConfig(
        forward_precision=_COMM[sharding.forward_comm_precision],
        backward_precision=_COMM[sharding.backward_comm_precision],
    ))


def embedding_sharders(sharding: Optional[ShardingConfig] = None) -> list[ModuleSharder[nn.Module]]:
    """The sharders for every embedding module embedtrain builds (pooled and sequence tables)."""
    registry = qcomm_registry(sharding) if sharding is not None else None
    return [
        EmbeddingBagCollectionAllTypesSharder(qcomm_codecs_registry=registry),
        EmbeddingCollectionAllTypesSharder(qcomm_codecs_registry=registry),
    ]
