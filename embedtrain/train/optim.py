"""Optimizers: sparse ones fused into the embedding backward (FBGEMM), dense ones as usual.

Embedding tables are updated inside their backward pass by FBGEMM's table-batched kernels
(``apply_optimizer_in_backward`` before ``DistributedModelParallel``), so a table's gradient is
never materialised. Dense parameters get an ordinary ``torch.optim`` optimizer. Both are combined
into one keyed optimizer whose ``state_dict`` checkpoints through DCP.

Example:
    >>> fuse_sparse_optimizer(model, SparseOptimizer.ROWWISE_ADAGRAD, lr=0.05)
    >>> dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    >>> opt = combined_optimizer(dmp, DenseOptimizer.ADAM, lr=1e-3)
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embedtrain.config import DenseOptimizer, SparseOptimizer

_SPARSE = {
    SparseOptimizer.ROWWISE_ADAGRAD: RowWiseAdagrad,
    SparseOptimizer.ADAGRAD: torch.optim.Adagrad,
    SparseOptimizer.SGD: torch.optim.SGD,
    SparseOptimizer.ADAM: torch.optim.Adam,
}
_DENSE = {
    DenseOptimizer.ADAM: torch.optim.Adam,
    DenseOptimizer.ADAGRAD: torch.optim.Adagrad,
    DenseOptimizer.SGD: torch.optim.SGD,
}


def dense_optimizer_slots(kind: DenseOptimizer) -> int:
    """Values of optimizer state per dense parameter (for memory planning)."""
    return {DenseOptimizer.ADAM: 2, DenseOptimizer.ADAGRAD: 1, DenseOptimizer.SGD: 0}[kind]


def fuse_sparse_optimizer(model: nn.Module, kind: SparseOptimizer, lr: float) -> int:
    """Marks every embedding table of ``model`` for an optimizer fused into its backward.

    Call before wrapping with ``DistributedModelParallel``, which turns the mark into FBGEMM's
    fused kernel. Returns the number of tables marked.
    """
    tables = [
        p
        for m in model.modules()
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
        for p in m.parameters()
    ]
    if tables:
        apply_optimizer_in_backward(_SPARSE[kind], tables, {"lr": lr})
    return len(tables)


def combined_optimizer(
    model: DistributedModelParallel, kind: DenseOptimizer, lr: float, weight_decay: float = 0.0
) -> CombinedOptimizer:
    """The sharded model's fused sparse optimizer plus ``kind`` over the dense parameters."""
    dense = dict(in_backward_optimizer_filter(model.named_parameters(), include=False))
    dense_opt = KeyedOptimizerWrapper(
        dense, lambda params: _DENSE[kind](params, lr=lr, weight_decay=weight_decay)
    )
    return CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", dense_opt)])


def init_optimizer_state(optimizer: KeyedOptimizer) -> None:
    """Creates the lazy state of the non-fused optimizers, so a checkpoint can load in place."""
    children = optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else [("", optimizer)]
    for _, child in children:
        if isinstance(child, KeyedOptimizerWrapper):
            child.init_state()
